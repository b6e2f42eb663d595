"""The `kvsplice` command: serve | generate | pull | bench | report | workload | fidelity.

    kvsplice serve [--model M] [--served-model-name NAME ...] [--host H] [--port P] [--api-key K ...]
                   [model / cache / scheduler / SCR / server flags]   (docs/SERVING.md lists every flag)
    kvsplice generate [--model M] --prompt TEXT [--max-tokens N] [--temperature T] [--seed S] [--chat]
    kvsplice pull                      fetch and convert the default model
    kvsplice bench | report | workload (see kvsplice/bench/commands.py)
    kvsplice fidelity (see kvsplice/bench/fidelity_cli.py)

The flags come in vLLM's groups: model, cache, scheduler, suffix cache reuse (SCR), server / frontend.
Engine flags are built from EngineConfig's fields (ENGINE_FLAGS: type and default from the dataclass);
SCR flags from `kvsplice.reuse.config.ENV_TABLE`, for the few settings a user tunes (SCR_FLAG_FIELDS).
The other SCR settings (session-matching heuristics, diff chunking, hybrid-model state, control
experiments) are set through their KVREUSE_* variables; their old flags still work, hidden, with a
one-line deprecation warning, as do `--no-scr` and `--model-path`. `--decode-arena-tokens`,
`--num-state-slots`, `--tenant-kv-share`, `--grammar-compile-timeout`, `--min-prefill-tokens` and
`--admin-api-key`, `--hf-overrides` work but are not listed by --help (rarely tuned; docs/SERVING.md lists them). Precedence for SCR settings:
command-line flag > KVREUSE_* environment variable > default; API keys: `--api-key` flags >
KVSPLICE_API_KEY (comma-separated), `--admin-api-key` > KVSPLICE_ADMIN_API_KEY. Bad input exits with status 2 and a message saying what is wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional

from kvsplice.cache.disk_tier import DiskTierConfig, DiskTierError
from kvsplice.config import COMPILE_DECODE_CHOICES, FUSED_RELOCATION_CHOICES, WEIGHT_FORMAT_CHOICES, EngineConfig
from kvsplice.models.hf_overrides import parse_hf_overrides
from kvsplice.reuse.config import ENV_TABLE, FIELD_TYPES, EnvVar, ReuseConfig, check_field

BAD_INPUT = 2
DEFAULT_KV_DISK_GB = 16.0   # --kv-disk-gb when only --kv-disk-dir is given

# The SCR settings offered as flags, by ReuseConfig field name; a name missing from ENV_TABLE is skipped.
SCR_FLAG_FIELDS: tuple[str, ...] = ("enabled", "max_spans", "tail", "min_span", "seam_tokens", "message_start_tokens")

MODEL, CACHE, SCHEDULER, SCR, SERVER = "model", "cache", "scheduler", "suffix cache reuse (SCR)", "server / frontend"
GROUP_HELP = {
    MODEL: None,
    CACHE: None,
    SCHEDULER: None,
    SCR: "flag > KVREUSE_* variable > default. The other SCR settings (session store and matching, diff "
         "chunking, hybrid-model state, control experiments) are set by KVREUSE_* variables only "
         "(docs/SERVING.md lists them)",
    SERVER: "address, chat parsing, API keys, request limits (past the body limit: 413; past the others: 400)",
}


def _typed(parser_fn: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap an ENV_TABLE parser so that argparse reports its ValueError as a usage error."""

    def convert(raw: str) -> Any:
        try:
            return parser_fn(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parser_fn, "__name__", "value").removeprefix("parse_")
    return convert


class DeprecatedFlag(argparse.Action):
    """A hidden flag kept so that old command lines still work: it stores what its replacement would
    (`const` when it takes no value) and prints one line to stderr naming the replacement."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str, **kwargs: Any):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.replacement = replacement

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"kvsplice: {option_string} is deprecated and will be removed; {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def _auto_or_count(low: int, high: int) -> Callable[[str], int | str]:
    """An argparse type: "auto", or an integer in [low, high] (else an error naming the range)."""
    def parse(raw: str) -> int | str:
        if raw == "auto":
            return raw
        try:
            value = int(raw)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected auto or an integer in [{low}, {high}], got {raw!r}")
        return value
    parse.__name__ = "count"
    return parse


def _hf_overrides_text(raw: str) -> str:
    """--hf-overrides: the JSON text, checked (a usage error naming the bad key)."""
    try:
        parse_hf_overrides(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return raw


class EngineFlag(NamedTuple):
    """One EngineConfig field offered as a flag. The flag's name is the field's (`--num-slots`; a
    boolean field that defaults to True gets `--no-<name>`), its type and default are the field's,
    unless `parse` / `cli_default` say otherwise (the CLI's "auto" values)."""

    field: str
    group: str
    help: str
    metavar: Optional[str] = None
    parse: Optional[Callable[[str], Any]] = None
    cli_default: Any = None
    choices: Optional[tuple[str, ...]] = None
    hidden: bool = False            # works, but not listed by --help (docs/SERVING.md lists it)
    bare: Optional[str] = None   # the value of the flag given without one (None: it needs one)


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("dtype", MODEL, "weights and KV dtype: auto | float32 | bfloat16 | float16; auto is bfloat16 where "
               "the CPU has native bf16 matmul (avx512_bf16 / amx_bf16), else float32", cli_default="auto"),
    EngineFlag("weight_format", MODEL, "projection / lm_head weights: auto (int4 where the checkpoint already is "
               "int4 data, e.g. a Q4_0 / Q4_1 GGUF, with bf16; a GGUF's own blocks where they are other formats, "
               "e.g. Q4_K_M), dense, int8, int4, gguf (a GGUF's own blocks for decode rows)", choices=WEIGHT_FORMAT_CHOICES),
    EngineFlag("max_model_len", MODEL, "longest prompt + completion (default: the model's own limit)"),
    EngineFlag("hf_overrides", MODEL, "JSON object of model config keys to override (vLLM's flag): rope_scaling / "
               "rope_parameters, rope_theta, max_position_embeddings, ...; e.g. YaRN to extend the context",
               metavar="JSON", parse=_hf_overrides_text, hidden=True),
    EngineFlag("device", MODEL, "torch device"),
    EngineFlag("fast_path", MODEL, "run every step on the reference Decoder (no fused / packed fast path)"),
    EngineFlag("compile_decode", MODEL, "compile decode-only steps with torch.compile (inductor, C++ wrapper): "
               "fewer per-op dispatches per token; the graphs build in the background while eager steps serve "
               "(minutes on 2 cores, under a minute once the compile cache holds them; `kvsplice pull --compile` "
               "fills it); on needs int4 / int8 weights and a C++ compiler; auto: built where that holds on a CPU "
               "with native bf16 (avx512_bf16 / amx_bf16) and bf16 activations, then switched in only where "
               "it times faster than the eager step; a bare flag is on",
               choices=COMPILE_DECODE_CHOICES, cli_default="auto", bare="on"),
    EngineFlag("fused_relocation", MODEL, "turn relocated bf16 / fp16 keys (SCR) with one compiled kernel "
               "(torch.compile, inductor) instead of about twenty eager ops, with the same bits (checked when it "
               "is built at start, seconds); auto: on where the keys are bf16 / fp16 on a CPU with a C++ "
               "compiler; where building fails the eager turn serves and the reason is logged",
               choices=FUSED_RELOCATION_CHOICES, cli_default="auto", bare="on", hidden=True),
    EngineFlag("num_slots", CACHE, "KV pool size in tokens"),
    EngineFlag("prefix_cache", CACHE, "turn the radix prefix cache off (and with it SCR)"),
    EngineFlag("decode_arena_tokens", CACHE, "bound (tokens) of the contiguous K/V copies of decoding requests; "
               "0 = off", hidden=True),
    EngineFlag("num_state_slots", CACHE, "recurrent-state slots of a hybrid model (default from --max-running)",
               hidden=True),
    EngineFlag("tenant_kv_share", CACHE, "share (0, 1] of the pool's slots and the disk tier's bytes one cache "
               "namespace (API key + cache_salt) holds before its own least recently used K/V is evicted first",
               hidden=True),
    EngineFlag("max_batch_tokens", SCHEDULER, "token budget of one forward (the chunked-prefill size)"),
    EngineFlag("max_running", SCHEDULER, "requests decoding at once"),
    EngineFlag("max_waiting", SCHEDULER, "queue length beyond which requests get 503"),
    EngineFlag("step_budget_ratio", SCHEDULER, "without a prefill lane, while requests decode, size each step's "
               "prefill share so that the step takes about this many times a decode-only step"),
    EngineFlag("grammar_compile_timeout", SCHEDULER, "seconds a structured-output constraint may take to compile "
               "before its request is refused with a 400", hidden=True),
    EngineFlag("min_prefill_tokens", SCHEDULER, "prefill tokens every step carries at least, so prefill always "
               "progresses", hidden=True),
    EngineFlag("decode_threads", SCHEDULER, "intra-op threads of steps with decode rows: N, or auto (every "
               "thread, as the other steps get; a smaller N leaves cores to other work while tokens stream)",
               metavar="N|auto", parse=_auto_or_count(1, 1024), cli_default="auto"),
    EngineFlag("prefill_lane_threads", SCHEDULER, "while requests decode, prefill other requests on a thread of "
               "their own with N intra-op threads (the decode steps run alone on the rest); 0 = off: prefill "
               "chunks share the decode steps; auto: 1 where the process has 2 threads or more, else 0",
               metavar="N|auto", parse=_auto_or_count(0, 1024), cli_default="auto"),
)

_ENGINE_FIELDS = {spec.name: spec for spec in dataclasses.fields(EngineConfig)}


def _field_type(name: str) -> type:
    """The type of EngineConfig field `name`, without its `| None`."""
    hint = typing.get_type_hints(EngineConfig)[name]
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return args[0] if args else hint


def _add_engine_flag(group: argparse._ArgumentGroup, spec: EngineFlag) -> None:
    """Add `spec` to `group`; unset, it is None (EngineConfig's default) or its `cli_default`."""
    default = _ENGINE_FIELDS[spec.field].default
    name = spec.field.replace("_", "-")
    if _field_type(spec.field) is bool:
        flag = f"--no-{name}" if default else f"--{name}"
        group.add_argument(flag, dest=spec.field, action="store_const", const=not default, default=None,
                           help=argparse.SUPPRESS if spec.hidden else spec.help)
        return
    shown = spec.cli_default if spec.cli_default is not None else default
    suffix = f" (default {shown})" if shown is not None else ""
    bare = {"nargs": "?", "const": spec.bare} if spec.bare is not None else {}
    group.add_argument(f"--{name}", dest=spec.field, type=spec.parse or _field_type(spec.field), **bare,
                       default=spec.cli_default, choices=spec.choices, help=argparse.SUPPRESS if spec.hidden else spec.help + suffix,
                       metavar=spec.metavar or (None if spec.choices else _metavar(_field_type(spec.field), name)))


def _metavar(kind: type, name: str) -> str:
    """N for a count, F for a number, else the flag's last word (DTYPE, DEVICE, MODE)."""
    return {int: "N", float: "F"}.get(kind, name.split("-")[-1].upper())


def _scr_default(field: str) -> str:
    value = getattr(ReuseConfig(), field)
    return str(int(value)) if isinstance(value, bool) else str(value)


def _scr_kwargs(entry: EnvVar) -> dict[str, Any]:
    """argparse keywords shared by the SCR flag of `entry` and its hidden alias."""
    kind = FIELD_TYPES.get(entry.field, str)
    kwargs: dict[str, Any] = {"dest": f"scr_{entry.field}", "default": None, "type": _typed(entry.parser),
                              "metavar": "BOOL" if kind is bool else _metavar(kind, entry.flag)}
    if kind is bool:
        kwargs.update(nargs="?", const=True)
    return kwargs


def add_scr_args(group: argparse._ArgumentGroup, table: tuple[EnvVar, ...] = ENV_TABLE) -> None:
    """A flag for each entry of `table` whose field is in SCR_FLAG_FIELDS; every other entry keeps its
    old flag as a hidden deprecated alias of its variable; `--no-scr` a hidden alias of `--scr-enabled 0`.
    Fields named in SCR_FLAG_FIELDS but absent from `table` are skipped."""
    for entry in table:
        if entry.field in SCR_FLAG_FIELDS:
            group.add_argument(entry.flag, help=f"{entry.help} (default {_scr_default(entry.field)}) "
                                                f"[env {entry.name}]", **_scr_kwargs(entry))
        else:
            group.add_argument(entry.flag, action=DeprecatedFlag, replacement=f"set {entry.name} instead",
                               **_scr_kwargs(entry))
    enabled = next((entry.flag for entry in table if entry.field == "enabled"), None)
    if enabled is not None:
        group.add_argument("--no-scr", dest="scr_enabled", action=DeprecatedFlag, nargs=0, const=False,
                           replacement=f"use {enabled} 0")


def add_engine_args(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """Add the model, cache, scheduler and SCR groups (every ENGINE_FLAGS entry, --model, the SCR flags
    of SCR_FLAG_FIELDS) and the hidden deprecated aliases; returns the groups by title."""
    groups = {title: parser.add_argument_group(title, GROUP_HELP[title]) for title in (MODEL, CACHE, SCHEDULER, SCR)}
    groups[MODEL].add_argument("--model", dest="model", default=None,
                               help="HF model dir, GGUF file, llama2.c .bin or hub id "
                                    "(default: SmolLM2-135M-Instruct)")
    groups[MODEL].add_argument("--model-path", dest="model", action=DeprecatedFlag, replacement="use --model")
    for spec in ENGINE_FLAGS:
        _add_engine_flag(groups[spec.group], spec)
    add_disk_tier_args(groups[CACHE])
    add_scr_args(groups[SCR])
    return groups


def add_disk_tier_args(group: argparse._ArgumentGroup) -> None:
    """--kv-disk-dir and --kv-disk-gb: the disk tier under the KV pool (kvsplice.cache.disk_tier)."""
    group.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                       help="keep the K/V the pool evicts in DIR and load it back for a later prompt with that "
                            "prefix, instead of prefilling it again (survives restarts; default: off)")
    group.add_argument("--kv-disk-gb", type=float, default=None, metavar="F",
                       help=f"most the disk tier's files take, in GB (default {DEFAULT_KV_DISK_GB:g})")


def disk_tier_from_args(args: argparse.Namespace) -> DiskTierConfig | None:
    """The DiskTierConfig of --kv-disk-dir / --kv-disk-gb, or None. ValueError (exit 2) for a budget
    without a directory, a budget that is not positive, or a directory that cannot be created or
    written (checked here, before the model loads)."""
    if args.kv_disk_dir is None:
        if args.kv_disk_gb is not None:
            raise ValueError("--kv-disk-gb needs --kv-disk-dir")
        return None
    gb = DEFAULT_KV_DISK_GB if args.kv_disk_gb is None else args.kv_disk_gb
    if not 0 < gb < 1e9 or int(gb * 1e9) < 1:
        raise ValueError(f"--kv-disk-gb must be positive, got {args.kv_disk_gb}")
    _check_writable_dir(os.path.expanduser(args.kv_disk_dir), "--kv-disk-dir")
    # an evicted run is cut into many entries (kvsplice.engine.cache_manager): a deep writer queue,
    # bounded in bytes by max_queued_bytes
    return DiskTierConfig.from_gb(os.path.expanduser(args.kv_disk_dir), gb, write_queue_size=4096)


def _check_writable_dir(path: str, flag: str) -> None:
    """Create `path` if missing and write a probe file into it; ValueError naming `flag` if either fails."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag}: {path} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".kvsplice-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{flag}: cannot write to {path} ({exc.strerror or exc})") from None


def reuse_config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ReuseConfig:
    """ReuseConfig from defaults, then KVREUSE_* variables in `environ`, then flags. ValueError if bad
    (naming the flag)."""
    config = ReuseConfig.from_env(environ)
    overrides = {entry.field: getattr(args, f"scr_{entry.field}") for entry in ENV_TABLE
                 if getattr(args, f"scr_{entry.field}", None) is not None}
    for entry in ENV_TABLE:
        if entry.field in overrides:
            check_field(entry.field, overrides[entry.field], label=entry.flag)
    return config.replace(**overrides) if overrides else config


def resolve_prefill_lane_threads(value: int | str, threads: int) -> int:
    """--prefill-lane-threads as a count: auto is 1 when `threads` (the process's intra-op
    threads) is at least 2, else 0."""
    if value == "auto":
        return 1 if threads >= 2 else 0
    return int(value)


def engine_config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> EngineConfig:
    """EngineConfig from parsed engine flags (unset flags keep EngineConfig's defaults). ValueError if bad."""
    import torch

    kwargs: dict[str, Any] = {"model": args.model, "reuse": reuse_config_from_args(args, environ),
                              "disk_tier": disk_tier_from_args(args)}
    for spec in ENGINE_FLAGS:
        value = getattr(args, spec.field)
        if value is not None:
            kwargs[spec.field] = value
    if kwargs.get("decode_threads") == "auto":
        del kwargs["decode_threads"]   # auto: EngineConfig's default, every thread
    kwargs["prefill_lane_threads"] = resolve_prefill_lane_threads(args.prefill_lane_threads, torch.get_num_threads())
    return EngineConfig(**kwargs)


def _check_model_arg(model: Optional[str]) -> None:
    """ValueError for a path-looking --model that does not exist (hub ids have no leading / or .)."""
    if model and model.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(model)):
        raise ValueError(f"--model: {model} does not exist")


def add_server_args(group: argparse._ArgumentGroup) -> None:
    """The server / frontend flags: address, names in logs, parsers, chat template, keys, request limits
    (RequestLimits, kvsplice.server.limits)."""
    from kvsplice.server import limits

    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    group.add_argument("--replica-name", default=None, metavar="NAME", help="name put in every request log line")
    group.add_argument("--log-level", default="warning", metavar="LEVEL", help="uvicorn log level (default warning)")
    group.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) used instead of the model's")
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="tool-call syntax of the model, by vLLM's names: hermes | llama3_json | mistral "
                            "(default: detected from the chat template; hermes when it has none)")
    group.add_argument("--reasoning-parser", action="store_true",
                       help="move <think>...</think> blocks of replies into reasoning_content")
    group.add_argument("--api-key", action="append", dest="api_keys", default=None, metavar="KEY",
                       help="accept requests with `Authorization: Bearer KEY` only (every route but the health "
                            "probes, /metrics and /get_load); repeat for several tenants, each with its own cache "
                            "namespace [env KVSPLICE_API_KEY, comma-separated; prefer it: flags show in ps]; "
                            "POST /flush_cache then flushes the caller's own cache, all of it with the operator "
                            "key --admin-api-key KEY [env KVSPLICE_ADMIN_API_KEY]")
    group.add_argument("--admin-api-key", default=None, metavar="KEY", help=argparse.SUPPRESS)
    group.add_argument("--expose-model-path", action="store_true",
                       help="show the model's filesystem path in /get_server_info, /get_model_info and /v1/models "
                            "(by default they show the served model name)")
    group.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                       help=f"request body size (default: context tokens x {limits.BYTES_PER_TOKEN} + "
                            f"{limits.BODY_OVERHEAD >> 20} MiB)")
    group.add_argument("--max-messages", type=int, default=None, metavar="N",
                       help="messages in one chat request (default: the context length in tokens)")
    group.add_argument("--max-stop", type=int, default=limits.MAX_STOP, metavar="N",
                       help=f"entries of `stop`, and of `stop_token_ids` (default {limits.MAX_STOP})")
    group.add_argument("--max-stop-chars", type=int, default=limits.MAX_STOP_CHARS, metavar="N",
                       help=f"characters of one stop string (default {limits.MAX_STOP_CHARS})")
    group.add_argument("--max-id-chars", type=int, default=limits.MAX_ID_CHARS, metavar="N",
                       help=f"characters of session_id, cache_salt, X-SMG-Routing-Key and rid "
                            f"(default {limits.MAX_ID_CHARS})")
    group.add_argument("--max-json-depth", type=int, default=limits.MAX_JSON_DEPTH, metavar="N",
                       help=f"nesting of arrays and objects in a request body (default {limits.MAX_JSON_DEPTH})")


def request_limits_from_args(args: argparse.Namespace):
    """RequestLimits from the limit flags. ValueError for a value below 1."""
    from kvsplice.server.limits import RequestLimits

    return RequestLimits(max_body_bytes=args.max_body_bytes, max_messages=args.max_messages, max_stop=args.max_stop,
                         max_stop_chars=args.max_stop_chars, max_id_chars=args.max_id_chars,
                         max_json_depth=args.max_json_depth)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of serve / generate / pull (bench, report, workload parse their own argv)."""
    parser = argparse.ArgumentParser(prog="kvsplice", description="LLM serving with Suffix Cache Reuse.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,pull,bench,report,workload,fidelity}")
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server")
    groups = add_engine_args(serve)
    groups[MODEL].add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                               help="names to serve the model under: responses report the first, requests may "
                                    "use any (default: the model's name, e.g. SmolLM2-135M-Instruct)")
    add_server_args(serve.add_argument_group(SERVER, GROUP_HELP[SERVER]))
    generate = sub.add_parser("generate", help="print one completion")
    add_engine_args(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    pull = sub.add_parser("pull", help="fetch and convert the default model")
    pull.add_argument("--model", default=None, metavar="PATH",
                      help="a model of your own (HF directory, .gguf, llama2.c .bin) to convert (a GGUF) and load "
                           "once instead of the default model")
    pull.add_argument("--compile", action="store_true",
                      help="also build its compiled decode step into the compile cache, as `serve` would use it")
    for name in PASS_THROUGH:
        sub.add_parser(name, help=f"see `kvsplice {name} --help`", add_help=False)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from kvsplice.server.api import ServerSettings
    from kvsplice.server.auth import ApiKeys
    from kvsplice.server.launch import serve
    from kvsplice.server.model_names import check_served_names

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    _check_model_arg(args.model)
    config = engine_config_from_args(args, os.environ)
    names = check_served_names(args.served_model_name) if args.served_model_name is not None else ()
    limits = request_limits_from_args(args)
    try:
        api_keys = ApiKeys.from_sources(args.api_keys, os.environ, args.admin_api_key)
    except ValueError as exc:
        raise ValueError(f"--api-key / --admin-api-key / KVSPLICE_API_KEY / KVSPLICE_ADMIN_API_KEY: {exc}") from None
    settings = ServerSettings(model_path=args.model, served_model_names=names, replica_name=args.replica_name,
                              reasoning_parser=args.reasoning_parser, host=args.host, port=args.port,
                              api_keys=api_keys, limits=limits, expose_model_path=args.expose_model_path,
                              **_chat_settings(args))
    try:
        return serve(config, settings, log_level=args.log_level)
    except DiskTierError as exc:    # e.g. another server holds the directory
        raise ValueError(f"--kv-disk-dir: {exc}") from None


def _chat_settings(args: argparse.Namespace) -> dict[str, Any]:
    """--tool-call-parser and --chat-template, checked before the model loads (ValueError if bad)."""
    from kvsplice.server.chat import load_chat_template
    from kvsplice.server.tool_parsers import get_parser

    if args.tool_call_parser is not None:
        get_parser(args.tool_call_parser)
    template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    return {"tool_call_parser": args.tool_call_parser, "chat_template": template}


def _generate(args: argparse.Namespace) -> int:
    from kvsplice.engine.llm import LLM, build_engine
    from kvsplice.sampling_params import SamplingParams

    _check_model_arg(args.model)
    config = engine_config_from_args(args, os.environ)
    if config.compile_decode == "auto":   # one completion: a compile would cost more than it saves
        config = dataclasses.replace(config, compile_decode="off")
    if config.fused_relocation == "auto":   # one completion relocates nothing
        config = dataclasses.replace(config, fused_relocation="off")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    llm = LLM(engine=build_engine(config))
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _pull(args: argparse.Namespace) -> int:
    """The default model (or `--model`, a GGUF converted into the cache), then with `--compile` the
    engine `kvsplice serve --model` builds with its default flags, waited for, so that the compile
    cache holds its graphs. ValueError (exit 2) for a model that does not exist or cannot be read."""
    from kvsplice.models.default_model import pull_default_model
    from kvsplice.models.loader import load_checkpoint

    if args.model is None:
        print(pull_default_model(progress=True))
    else:
        _check_model_arg(args.model)
        checkpoint = load_checkpoint(args.model)   # converts a GGUF into the cache
        print(f"{args.model}: {checkpoint.name} ({checkpoint.hf_config.get('model_type')}) ready")
    if args.compile:
        import torch

        from kvsplice.engine.llm import warm_compile_cache

        lane = resolve_prefill_lane_threads("auto", torch.get_num_threads())
        print(warm_compile_cache(EngineConfig(model=args.model, dtype="auto", prefill_lane_threads=lane,
                                              fused_relocation="auto")), flush=True)
    return 0


def _bench_command(name: str):
    """The `*_main(argv) -> int` of a subcommand that parses its own arguments (imported lazily)."""
    def load():
        if name == "fidelity":
            from kvsplice.bench.fidelity_cli import fidelity_main
            return fidelity_main
        from kvsplice.bench import commands
        return getattr(commands, f"{name}_main")
    return load


PASS_THROUGH = {name: _bench_command(name) for name in ("bench", "report", "workload", "fidelity")}


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `kvsplice` command; returns the exit status (2 for bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASS_THROUGH:
        return PASS_THROUGH[argv[0]]()(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else BAD_INPUT
    if args.command is None:
        parser.print_help(sys.stderr)
        return BAD_INPUT
    handler = {"serve": _serve, "generate": _generate, "pull": _pull}[args.command]
    try:
        return handler(args)
    except ValueError as exc:
        print(f"kvsplice {args.command}: {exc}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
