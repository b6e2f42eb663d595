"""The offline Python API: `LLM(model=...).generate(prompts, SamplingParams(...))` and `stream`.

    from kvsplice import LLM, SamplingParams
    llm = LLM()                                    # the default model, SmolLM2-135M-Instruct
    [out] = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))
    print(out.text)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine, RequestFailedError
from kvsplice.engine.failpoints import Failpoints
from kvsplice.engine.request import RequestOutput
from kvsplice.layers.block_int8_head import row_head_serves
from kvsplice.layers.sampler import TokenLogprob
from kvsplice.message_offsets import message_offsets
from kvsplice.models.compile_choice import (choose_compile_decode, compile_cache_dir, compile_cache_key,
                                            cpu_identity, find_cpp_compiler, model_identity)
from kvsplice.models.compiled_decode import InductorBuilder
from kvsplice.models.config import ModelConfig
from kvsplice.models.decoder import Decoder
from kvsplice.models.default_model import cache_dir, resolve_model
from kvsplice.models.fast_decode import FastDecoder
from kvsplice.models.hf_overrides import apply_hf_overrides, parse_hf_overrides
from kvsplice.models.gguf_convert import open_gguf
from kvsplice.models.loader import gguf_projection_types, load_checkpoint, load_gguf_blocks, resolve_dtype
from kvsplice.models.quantize import WeightFormat, may_want_gguf_blocks, resolve_weight_format, wants_gguf_blocks
from kvsplice.reuse.accounting import ReuseStats
from kvsplice.sampling_params import SamplingParams
from kvsplice.utils.machine import read_cpu_flags
from kvsplice.utils.thread_policy import ThreadPolicy

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    """A finished request, as `LLM.generate` returns it."""

    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None
    reuse: ReuseStats
    prompt_logits: dict | None = None
    state_reuse: object | None = None   # hybrid models: StateReuse (checkpoint depth, state mode)


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU multiplies bf16 in hardware (flag avx512_bf16 or amx_bf16 in `cpuinfo`);
    False where that cannot be read (bf16 is then emulated, slower than fp32)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_auto_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """`resolve_dtype(name)`, where "auto" is bfloat16 on a device with native bf16 matmul (CUDA
    with bf16 support, a CPU with avx512_bf16 / amx_bf16) and float32 elsewhere."""
    if str(name).strip().lower() != "auto":
        return resolve_dtype(name)
    if str(device).startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def build_engine(config: EngineConfig, failpoints: Failpoints | None = None, decode_builder=None,
                 wait_for_compile: bool = True) -> Engine:
    """Load `config.model` (a local HF dir, a GGUF file, a llama2.c .bin, a hub id, or None for
    the default model) and build an Engine around it (`config.dtype` may be "auto"; `failpoints`:
    a test seam, see Engine).

    `config.compile_decode` "auto" is decided here from the machine and the model
    (`kvsplice.models.compile_choice`; the reason logged once), and then, once the graphs are built,
    by timing them against the eager step (the speed trial of kvsplice.models.compiled_decode). Where it is on, the compiled decode step builds on a background thread
    (`decode_builder`, default inductor with its cache under kvsplice's cache directory,
    `decode_cache_dir`); `wait_for_compile` starts it and waits for it (raising what the build
    raised); else the caller starts it (`engine.runner.fast.compiled.start()`: the server does once
    it has warmed the engine up) and the engine steps eagerly until the graphs are built."""
    path = resolve_model(config.model)
    dtype = resolve_auto_dtype(config.dtype, config.device)
    facts = _compile_facts(config, dtype)
    # what the machine alone decides, before the weights are read (their format, the model's kind)
    choice = choose_compile_decode(config.compile_decode, weight_format="int4", fast_path=None, **facts)
    # the head's int8 blocks, for the row head (kvsplice.layers.block_int8_head)
    ckpt = load_checkpoint(path, dtype=dtype, head_blocks=row_head_serves(dtype, config.device))
    hf_config = apply_hf_overrides(ckpt.hf_config, parse_hf_overrides(config.hf_overrides or "{}"))
    model_config = ModelConfig.from_hf_config(hf_config)
    model = Decoder.from_config(model_config, dtype=dtype)
    model.load_hf_state_dict(ckpt.state_dict, ckpt.head_blocks)
    model.gguf_blocks = _gguf_blocks(config, ckpt, model_config, dtype)
    model.to(config.device).eval()
    if choice.enabled:
        weight_format = resolve_weight_format(config.weight_format, model)
        choice = choose_compile_decode(config.compile_decode, weight_format=weight_format.projections,
                                       fast_path=_fast_path_missing(config, model_config), **facts)
    _log.info("compiled decode: %s", choice.reason)
    measure = config.compile_decode == "auto"   # auto switches only where the step measures faster
    config = dataclasses.replace(config, compile_decode="on" if choice.enabled else "off",
                                 fused_relocation=_fused_relocation(config, dtype, facts["compiler"]))
    if choice.enabled and decode_builder is None:
        decode_builder = InductorBuilder(decode_cache_dir(config, ckpt.name, hf_config, model_config,
                                                          weight_format), measure=measure)
    engine = Engine(model, model_config, ckpt.tokenizer, config, name=ckpt.name, failpoints=failpoints,
                    decode_builder=decode_builder)
    compiled = engine.runner.fast.compiled if engine.runner.fast is not None else None
    if wait_for_compile and compiled is not None:
        compiled.wait()
    return engine


def warm_compile_cache(config: EngineConfig) -> str:
    """Build the engine of `config` (its fused relocation turn too, where `config.fused_relocation`
    asks for it) and wait for its compiled decode step, so that the compile cache holds them for the
    next start with the same settings (`kvsplice pull --compile`). Returns
    a line saying how long it took and where it is cached; raises what the build raised."""
    import time

    started = time.perf_counter()
    build_engine(dataclasses.replace(config, compile_decode="on"))
    return (f"compiled decode: built in {time.perf_counter() - started:.0f} s, cached in "
            f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'inductor default cache')}")


def _fused_relocation(config: EngineConfig, dtype: torch.dtype, compiler: str | None) -> str:
    """`config.fused_relocation` with auto decided: on where relocated keys are bf16 / fp16 on a CPU
    with a C++ compiler (inductor needs one); the reason it is off logged once."""
    if config.fused_relocation != "auto":
        return config.fused_relocation
    why_not = ("keys are float32 (one turn by the delta)" if dtype not in (torch.bfloat16, torch.float16)
               else "not on a CPU" if str(config.device) != "cpu"
               else "no C++ compiler found" if compiler is None else None)
    if why_not is not None:
        _log.info("fused relocation: off, %s", why_not)
    return "off" if why_not else "on"


def _compile_facts(config: EngineConfig, dtype: torch.dtype) -> dict:
    """What `choose_compile_decode` needs of the machine and the dtype (read once, cheap)."""
    on_cpu = str(config.device) == "cpu"
    return {"cpu_flags": read_cpu_flags() if on_cpu else frozenset(), "compiler": find_cpp_compiler(),
            "dtype": str(dtype).removeprefix("torch.")}


def _gguf_blocks(config: EngineConfig, ckpt, model_config: ModelConfig, dtype: torch.dtype) -> dict:
    """The GGUF's blocks where the weight format takes them (`wants_gguf_blocks`), else {}. The
    file's header is read only where they may be taken, and once (a reader parses all of it)."""
    fast_path = config.fast_path and FastDecoder.supports(model_config)
    bf16 = dtype == torch.bfloat16
    if not may_want_gguf_blocks(config.weight_format, bf16, fast_path) or not ckpt.source_path.lower().endswith(".gguf"):
        return {}
    reader = open_gguf(ckpt.source_path)
    if not wants_gguf_blocks(config.weight_format, gguf_projection_types(reader), bf16=bf16, fast_path=fast_path):
        return {}
    return load_gguf_blocks(reader, ckpt.hf_config)


def _fast_path_missing(config: EngineConfig, model_config: ModelConfig) -> str | None:
    """Why the decode step would not run on the fast path over the DecodeArena, or None."""
    if not config.fast_path:
        return "--no-fast-path"
    if not FastDecoder.supports(model_config):
        return f"{model_config.model_type} is not an attention-only model the fast path runs"
    if FastDecoder.compile_refusal(model_config):
        return f"the compiled step does not run {model_config.model_type} ({FastDecoder.compile_refusal(model_config)})"
    if not config.decode_arena_tokens:
        return "the DecodeArena is off (--decode-arena-tokens 0)"
    if str(config.device) != "cpu":
        return f"the device is {config.device}, not the CPU"
    return None


def _installed_version() -> str:
    """kvsplice's installed version (part of the compile cache key), "unknown" when not installed."""
    try:
        return metadata.version("kvsplice")
    except metadata.PackageNotFoundError:
        return "unknown"


def decode_cache_dir(config: EngineConfig, name: str, hf_config: dict, model_config: ModelConfig,
                     weight_format: WeightFormat) -> Path:
    """The compile cache of this model's decode graphs: `<kvsplice cache>/inductor/<key>`, the key
    from torch's version, the model's identity, the graphs' shapes, formats and thread counts,
    and the CPU (`kvsplice.models.compile_choice`)."""
    threads = ThreadPolicy.from_config(config.decode_threads, config.prefill_lane_threads)
    dtype = str(resolve_auto_dtype(config.dtype, config.device))   # "auto" and its value share graphs
    shapes = {"kvsplice": _installed_version(), "dtype": dtype, "weights": weight_format.describe(),
              "layers": model_config.num_layers, "hidden": model_config.hidden_size,
              "heads": model_config.num_heads, "kv_heads": model_config.num_kv_heads,
              "head_dim": model_config.head_dim, "vocab": model_config.vocab_size,
              "threads": threads.compiled_step_counts()}
    key = compile_cache_key(torch.__version__, model_identity(name, hf_config), shapes,
                            cpu_identity(torch.backends.cpu.get_cpu_capability(), read_cpu_flags()))
    return compile_cache_dir(cache_dir(), key)


class LLM:
    """A blocking front door to the engine (one caller thread)."""

    def __init__(self, model: str | None = None, engine: Engine | None = None, **engine_kwargs):
        self.engine = engine or build_engine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def _encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 message_offsets: list[int] | list[list[int] | None] | None = None,
                 **request_kwargs) -> list[GenerationResult]:
        """Run every prompt (text or token ids) to completion, batched; results in input order.
        `request_kwargs` (cache_salt, session_id, scr) apply to every prompt. `message_offsets`:
        where each prompt's messages start (token offsets, see `Engine.add_request`): one list for a
        single prompt, or one list (or None) per prompt. Raises RequestFailedError (once every
        request has ended) if one failed inside the engine."""
        single = isinstance(prompts, str) or bool(prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        offsets_list = self._offsets_per_prompt(message_offsets, len(prompts), single)
        prompt_ids = [self._encode(p) for p in prompts]
        rids = [self.engine.add_request(ids, sp, message_offsets=offsets, **request_kwargs)
                for ids, sp, offsets in zip(prompt_ids, params_list, offsets_list)]
        collected = {rid: [] for rid in rids}
        while any(not outs or not outs[-1].finished for outs in collected.values()):
            for out in self.engine.step():
                collected[out.rid].append(out)
        return [self._merge(rid, ids, collected[rid]) for rid, ids in zip(rids, prompt_ids)]

    @staticmethod
    def _offsets_per_prompt(message_offsets, num_prompts: int, single: bool) -> list:
        """`generate`'s message_offsets as one entry per prompt; ValueError when they do not line up."""
        if message_offsets is None:
            return [None] * num_prompts
        if single and all(isinstance(o, int) for o in message_offsets):
            return [message_offsets]
        if len(message_offsets) != num_prompts or any(o is not None and not isinstance(o, (list, tuple))
                                                      for o in message_offsets):
            raise ValueError(f"message_offsets: expected one list per prompt ({num_prompts}), got {message_offsets!r}")
        return list(message_offsets)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               message_offsets: list[int] | None = None, **request_kwargs) -> Iterator[RequestOutput]:
        """Yield one RequestOutput delta per generated token; the last has finished=True.
        Closing the iterator early aborts the request. RequestFailedError if it fails.
        `message_offsets`: see `generate`."""
        rid = self.engine.add_request(self._encode(prompt), params or SamplingParams(),
                                      message_offsets=message_offsets, **request_kwargs)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.rid == rid:
                        finished = out.finished
                        if out.error is not None:
                            raise RequestFailedError(rid, out.error)
                        yield out
        finally:
            if not finished:
                self.engine.abort(rid)
                self.engine.step()

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             **request_kwargs) -> GenerationResult:
        """Apply the model's chat template and generate the assistant's reply. On a hybrid model
        whose checkpoint policy uses messages, the message offsets are computed from the template
        (`kvsplice.message_offsets`) and passed with the request."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        cache = self.engine.cache
        offsets = message_offsets(self.tokenizer, messages, ids) \
            if cache.states is not None and cache.policy.messages else None
        return self.generate([ids], params, message_offsets=[offsets], **request_kwargs)[0]

    @staticmethod
    def _merge(rid: str, prompt_ids: list[int], outs: list[RequestOutput]) -> GenerationResult:
        last = outs[-1]
        if last.error is not None:
            raise RequestFailedError(rid, last.error)
        token_ids = [t for o in outs for t in o.new_token_ids]
        return GenerationResult(rid, prompt_ids, token_ids, "".join(o.new_text for o in outs),
                                last.finish_reason, [lp for o in outs for lp in o.logprobs],
                                next((list(o.prompt_logprobs) for o in outs if o.prompt_logprobs), None),
                                last.reuse, next((o.prompt_logits for o in outs if o.prompt_logits), None),
                                next((o.state_reuse for o in outs if o.state_reuse is not None), None))
