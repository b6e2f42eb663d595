"""The `kvsplice` command: serve | generate | pull | bench | report | workload | fidelity.

    kvsplice serve [--model M | --model-path M] [--served-model-name NAME ...] [--host H] [--port P]
                   [--api-key K ...] [limit flags] [engine flags] [SCR flags]   (docs/SERVING.md lists every flag)
    kvsplice generate [--model M] --prompt TEXT [--max-tokens N] [--temperature T] [--seed S] [--chat]
    kvsplice pull                      fetch and convert the default model
    kvsplice bench | report | workload (see kvsplice/bench/commands.py)
    kvsplice fidelity (see kvsplice/bench/fidelity_cli.py)

Engine flags mirror EngineConfig; SCR flags mirror `kvsplice.reuse.config.ENV_TABLE`. Precedence for SCR
settings: command-line flag > KVREUSE_* environment variable > default; API keys: `--api-key` flags >
KVSPLICE_API_KEY (comma-separated). Bad input exits with status 2 and a message saying what is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any, Callable, Optional

from kvsplice.config import WEIGHT_FORMAT_CHOICES
from kvsplice.reuse.config import ENV_TABLE, FIELD_TYPES, ReuseConfig

BAD_INPUT = 2


def _typed(parser_fn: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap an ENV_TABLE parser so that argparse reports its ValueError as a usage error."""

    def convert(raw: str) -> Any:
        try:
            return parser_fn(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parser_fn, "__name__", "value").removeprefix("parse_")
    return convert


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add --model/--model-path, every EngineConfig flag, every ENV_TABLE SCR flag and --no-scr."""
    parser.add_argument("--model", "--model-path", dest="model", default=None,
                        help="HF model dir, GGUF file, llama2.c .bin or hub id (default: SmolLM2-135M-Instruct)")
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", default="auto",
                       help="auto | float32 | bfloat16 | float16 (default auto: bfloat16 where the CPU has "
                            "native bf16 matmul, avx512_bf16 / amx_bf16, else float32)")
    group.add_argument("--weight-format", default=None, choices=WEIGHT_FORMAT_CHOICES,
                       help="projection / lm_head weights: auto (int4 where the checkpoint already is int4 "
                            "data, e.g. a Q4_0 / Q4_1 GGUF, with bf16), dense, int8, int4 (default auto)")
    group.add_argument("--no-fast-path", action="store_true",
                       help="run every step on the reference Decoder (no fused / packed fast path)")
    group.add_argument("--compile-decode", action="store_true",
                       help="compile decode-only steps with torch.compile (inductor, C++ wrapper): fewer "
                            "per-op dispatches per token; start-up compiles first (minutes on 2 cores, under a "
                            "minute once inductor's cache holds it); needs int4 / int8 weights and a C++ compiler")
    group.add_argument("--decode-arena-tokens", type=int, default=None,
                       help="bound (tokens) of the contiguous K/V copies of decoding requests; 0 = off")
    group.add_argument("--step-budget-ratio", type=float, default=None,
                       help="while requests decode, size each step's prefill share so that the step takes "
                            "about this many times a decode-only step (default 2.5)")
    group.add_argument("--min-prefill-tokens", type=int, default=None,
                       help="prefill tokens every step carries at least, so prefill always progresses (default 16)")
    group.add_argument("--decode-threads", type=_decode_threads, default="auto",
                       help="intra-op threads of steps with decode rows: N, or auto (default: every thread, as the "
                            "other steps get; a smaller N leaves cores to other work while tokens stream)")
    group.add_argument("--prefill-lane-threads", type=_prefill_lane_threads, default="auto",
                       help="while requests decode, prefill other requests on a thread of their own with N "
                            "intra-op threads (the decode steps run alone on the rest); 0 = off: prefill "
                            "chunks share the decode steps; auto (default): 1 where the process has 2 threads "
                            "or more, else 0")
    group.add_argument("--device", default="cpu", help="torch device (default cpu)")
    group.add_argument("--num-slots", type=int, default=None, help="KV pool size in tokens")
    group.add_argument("--max-batch-tokens", type=int, default=None, help="token budget of one forward")
    group.add_argument("--max-running", type=int, default=None, help="requests decoding at once")
    group.add_argument("--max-waiting", type=int, default=None, help="queue length beyond which requests get 503")
    group.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion")
    group.add_argument("--num-state-slots", type=int, default=None,
                       help="recurrent-state slots of a hybrid model (default from --max-running)")
    group.add_argument("--no-prefix-cache", action="store_true", help="turn the radix prefix cache off")
    scr = parser.add_argument_group("suffix cache reuse (flag > env var > default)")
    scr.add_argument("--no-scr", action="store_true", help="turn SCR off (same as --scr-enabled 0)")
    for entry in ENV_TABLE:
        kwargs: dict[str, Any] = {"dest": f"scr_{entry.field}", "default": None, "type": _typed(entry.parser),
                                  "help": f"{entry.help} [env {entry.name}]"}
        if FIELD_TYPES[entry.field] is bool:
            kwargs.update(nargs="?", const=True, metavar="BOOL")
        scr.add_argument(entry.flag, **kwargs)


def reuse_config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ReuseConfig:
    """ReuseConfig from defaults, then KVREUSE_* variables in `environ`, then flags. ValueError if bad."""
    config = ReuseConfig.from_env(environ)
    overrides = {entry.field: getattr(args, f"scr_{entry.field}") for entry in ENV_TABLE
                 if getattr(args, f"scr_{entry.field}", None) is not None}
    if args.no_scr:
        overrides["enabled"] = False
    return config.replace(**overrides) if overrides else config


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
    return parse


_decode_threads = _auto_or_count(1, 1024)
_prefill_lane_threads = _auto_or_count(0, 1024)


def resolve_prefill_lane_threads(value: int | str, threads: int) -> int:
    """--prefill-lane-threads as a count: auto is 1 when `threads` (the process's intra-op
    threads) is at least 2, else 0."""
    if value == "auto":
        return 1 if threads >= 2 else 0
    return int(value)


def engine_config_from_args(args: argparse.Namespace, environ: Mapping[str, str]):
    """EngineConfig from parsed engine flags (unset flags keep EngineConfig's defaults). ValueError if bad."""
    from kvsplice.config import EngineConfig

    import torch

    decode_threads = None if args.decode_threads == "auto" else args.decode_threads
    lane_threads = resolve_prefill_lane_threads(args.prefill_lane_threads, torch.get_num_threads())
    kwargs: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "device": args.device,
                              "decode_threads": decode_threads, "prefill_lane_threads": lane_threads,
                              "prefix_cache": not args.no_prefix_cache, "fast_path": not args.no_fast_path,
                              "compile_decode": args.compile_decode, "reuse": reuse_config_from_args(args, environ)}
    for name in ("num_slots", "max_batch_tokens", "max_running", "max_waiting", "max_model_len", "num_state_slots",
                 "weight_format", "decode_arena_tokens", "step_budget_ratio", "min_prefill_tokens"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    return EngineConfig(**kwargs)


def _check_model_arg(model: Optional[str]) -> None:
    """ValueError for a path-looking --model that does not exist (hub ids have no leading / or .)."""
    if model and model.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(model)):
        raise ValueError(f"--model: {model} does not exist")


def add_security_args(parser: argparse.ArgumentParser) -> None:
    """--api-key (repeatable) and --expose-model-path."""
    group = parser.add_argument_group("security (docs/SECURITY.md)")
    group.add_argument("--api-key", action="append", dest="api_keys", default=None, metavar="KEY",
                       help="accept requests with `Authorization: Bearer KEY` only (every route but the health "
                            "probes, /metrics and /get_load); repeat for several tenants, each with its own cache "
                            "namespace [env KVSPLICE_API_KEY, comma-separated; prefer it: flags show in ps]")
    group.add_argument("--expose-model-path", action="store_true",
                       help="show the model's filesystem path in /get_server_info, /get_model_info and /v1/models "
                            "(by default they show the served model name)")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """The per-request limits of RequestLimits (kvsplice.server.limits)."""
    from kvsplice.server import limits

    group = parser.add_argument_group("request limits (past them: 413 for the body, 400 otherwise)")
    group.add_argument("--max-body-bytes", type=int, default=None,
                       help=f"request body size (default: context tokens x {limits.BYTES_PER_TOKEN} + "
                            f"{limits.BODY_OVERHEAD >> 20} MiB)")
    group.add_argument("--max-messages", type=int, default=None,
                       help="messages in one chat request (default: the context length in tokens)")
    group.add_argument("--max-stop", type=int, default=limits.MAX_STOP,
                       help=f"entries of `stop`, and of `stop_token_ids` (default {limits.MAX_STOP})")
    group.add_argument("--max-stop-chars", type=int, default=limits.MAX_STOP_CHARS,
                       help=f"characters of one stop string (default {limits.MAX_STOP_CHARS})")
    group.add_argument("--max-id-chars", type=int, default=limits.MAX_ID_CHARS,
                       help=f"characters of session_id, cache_salt, X-SMG-Routing-Key and rid "
                            f"(default {limits.MAX_ID_CHARS})")
    group.add_argument("--max-json-depth", type=int, default=limits.MAX_JSON_DEPTH,
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
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="names to serve the model under: responses report the first, requests may use "
                            "any (default: the model's name, e.g. SmolLM2-135M-Instruct)")
    serve.add_argument("--replica-name", default=None, help="name put in every request log line")
    serve.add_argument("--reasoning-parser", action="store_true",
                       help="move <think>...</think> blocks of replies into reasoning_content")
    serve.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="tool-call syntax of the model, by vLLM's names: hermes | llama3_json | mistral "
                            "(default: detected from the chat template; hermes when it has none)")
    serve.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) used instead of the model's")
    serve.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    add_security_args(serve)
    add_limit_args(serve)
    generate = sub.add_parser("generate", help="print one completion")
    add_engine_args(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    sub.add_parser("pull", help="fetch and convert the default model")
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
        api_keys = ApiKeys.from_sources(args.api_keys, os.environ)
    except ValueError as exc:
        raise ValueError(f"--api-key / KVSPLICE_API_KEY: {exc}") from None
    settings = ServerSettings(model_path=args.model, served_model_names=names, replica_name=args.replica_name,
                              reasoning_parser=args.reasoning_parser, host=args.host, port=args.port,
                              api_keys=api_keys, limits=limits, expose_model_path=args.expose_model_path,
                              **_chat_settings(args))
    return serve(config, settings, log_level=args.log_level)


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


def _pull(_: argparse.Namespace) -> int:
    from kvsplice.models.default_model import pull_default_model

    print(pull_default_model(progress=True))
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
