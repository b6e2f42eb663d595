"""Engine-level configuration (frozen). Model facts live in `kvsplice.models.config`, reuse
settings (and their KVREUSE_* environment table) in `kvsplice.reuse.config`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvsplice.cache.disk_tier import DiskTierConfig
from kvsplice.models.hf_overrides import parse_hf_overrides
from kvsplice.reuse.config import ReuseConfig

WEIGHT_FORMAT_CHOICES = ("auto", "dense", "int8", "int4", "gguf")
COMPILE_DECODE_CHOICES = ("auto", "on", "off")
FUSED_RELOCATION_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs one model.

    num_slots: KV pool size in tokens (one slot = one token's K and V in every layer).
    max_batch_tokens: token budget of one forward (decode tokens first, then prefill chunks);
        this is also the chunked-prefill chunk size.
    max_running: requests decoding at once. max_waiting: queue length beyond which new
        requests are refused (the server answers 503 with Retry-After).
    max_model_len: longest sequence (prompt + completion) accepted; None = the model's own limit.
    hf_overrides: keys set on the model's config.json before it is read, as JSON text (a dict is taken
        too, kept as its JSON): RoPE scaling and max_position_embeddings (`kvsplice.models.hf_overrides`,
        vLLM's `--hf-overrides`); checked here, ValueError naming a bad key.
    prefix_cache: share exact prefixes through the radix tree.
    num_state_slots: recurrent-state slots of a hybrid (linear-attention) model: one per running
        request plus checkpoints and SCR sessions; None = a default from max_running and
        max_sessions. One slot of a large hybrid is big (all linear layers' conv and recurrent
        states), so size it to memory. Ignored for models without linear-attention layers.
    dtype: "float32" | "bfloat16" | "float16", or "auto": bfloat16 where the CPU multiplies bf16
        natively (avx512_bf16 / amx_bf16), float32 elsewhere (`kvsplice.engine.llm.resolve_auto_dtype`).
    weight_format: "auto" | "dense" | "int8" | "int4" (`kvsplice.models.quantize`): the form of
        the projection and lm_head weights; "auto" uses int4 only where the checkpoint already
        is int4 data (a GGUF Q4_0 / Q4_1) and the activations are bf16, a GGUF's own blocks where
        its projections are other block formats (Q4_K_M files; bf16, fast path), else dense;
        "gguf": a GGUF's own blocks for decode rows (bf16).
    fast_path: run eligible models through `kvsplice.models.fast_decode.FastDecoder` (fused,
        packed, decode over the DecodeArena); False: the reference Decoder for every step.
    compile_decode: "on": compile the fast path's decode-only steps with torch.compile
        (`kvsplice.models.compiled_decode`; needs the fast path, the DecodeArena, int4 / int8
        projections and a C++ compiler), on a background thread: minutes on 2 cores, under a
        minute with the compile cache warm; "off"; "auto": on where it is expected faster
        (`kvsplice.models.compile_choice`), resolved by `build_engine` (an Engine built directly
        takes auto as off). True / False are taken as "on" / "off".
    fused_relocation: "on": SCR relocation turns bf16 / fp16 keys with one compiled kernel
        (`kvsplice.layers.fused_turn`, torch.compile; the same bits as the eager turn, checked when
        it is built at start, seconds; where it fails the eager turn serves and the reason is
        logged); "off"; "auto": on where the keys are bf16 / fp16 on a CPU with a C++ compiler,
        resolved by `build_engine` (an Engine built directly takes auto as off).
    decode_arena_tokens: bound of the DecodeArena (rows x capacity, tokens), the contiguous
        copies of decoding requests' K/V; 0 disables it (decode rows gather from the pool).
    step_budget_ratio: without a prefill lane, while requests decode, a step's prefill share is
        sized so that the step takes about this many times a decode-only step
        (`kvsplice.engine.step_budget`).
    min_prefill_tokens: prefill tokens every step carries at least (when there are any, and at
        most max_batch_tokens), so prefill always progresses.
    decode_threads: intra-op threads of steps with decode rows (`kvsplice.utils.thread_policy`);
        None: the same as every other step (torch's thread count), what `kvsplice serve`'s
        auto gives.
    prefill_lane_threads: while requests decode, other requests' prefill runs on a thread of its
        own with this many intra-op threads, in chunks of max_batch_tokens, and the decode steps
        run alone on the rest (`kvsplice.engine.prefill_lane`); 0: prefill chunks share the
        decode steps (StepBudget). Needs the fast path and fewer threads than the engine's;
        otherwise off. `kvsplice serve` defaults to 1 where the process has 2 threads or more.
    disk_tier: where the K/V the pool evicts goes instead of being dropped, and from where a later
        prefix match loads it (`kvsplice.cache.disk_tier`; `--kv-disk-dir`, `--kv-disk-gb`); None:
        no disk tier. On a hybrid its entries carry the linear layers' state checkpoints too; ignored
        with a windowed pool (sliding-window models).
    tenant_kv_share: the share (0, 1] of the pool's slots, and of the disk tier's bytes, one cache
        namespace (API-key tenant + cache_salt) may hold in cached K/V before eviction takes its
        own least recently used entries first (`kvsplice.cache.tenant_share`); 1: plain LRU.
    grammar_compile_timeout: seconds a structured-output constraint (schema, regex, EBNF, forced
        tool call) may take to compile before the request is refused (`kvsplice.structured.grammar`).
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    num_slots: int = 65_536
    max_batch_tokens: int = 2048
    max_running: int = 64
    max_waiting: int = 512
    max_model_len: int | None = None
    hf_overrides: str | None = None
    prefix_cache: bool = True
    num_state_slots: int | None = None
    weight_format: str = "auto"
    fast_path: bool = True
    compile_decode: str = "off"
    fused_relocation: str = "off"
    decode_arena_tokens: int = 32_768
    step_budget_ratio: float = 2.5
    min_prefill_tokens: int = 16
    decode_threads: int | None = None
    prefill_lane_threads: int = 0
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    disk_tier: DiskTierConfig | None = None
    tenant_kv_share: float = 1.0
    grammar_compile_timeout: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.compile_decode, bool):
            object.__setattr__(self, "compile_decode", "on" if self.compile_decode else "off")
        if self.compile_decode not in COMPILE_DECODE_CHOICES:
            raise ValueError(f"compile_decode must be one of {COMPILE_DECODE_CHOICES}, got {self.compile_decode!r}")
        if self.fused_relocation not in FUSED_RELOCATION_CHOICES:
            raise ValueError(f"fused_relocation must be one of {FUSED_RELOCATION_CHOICES}, got {self.fused_relocation!r}")
        for name in ("num_slots", "max_batch_tokens", "max_running", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_state_slots is not None and self.num_state_slots < 2:
            raise ValueError(f"num_state_slots must be >= 2, got {self.num_state_slots}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if isinstance(self.hf_overrides, dict):
            object.__setattr__(self, "hf_overrides", json.dumps(self.hf_overrides, sort_keys=True))
        if self.hf_overrides is not None:
            parse_hf_overrides(self.hf_overrides)
        if self.weight_format not in WEIGHT_FORMAT_CHOICES:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMAT_CHOICES}, got {self.weight_format!r}")
        if not 0 <= self.decode_arena_tokens <= 1 << 30:
            raise ValueError(f"decode_arena_tokens must be in [0, 2^30], got {self.decode_arena_tokens}")
        if not 1.0 <= self.step_budget_ratio <= 100.0:
            raise ValueError(f"step_budget_ratio must be in [1, 100], got {self.step_budget_ratio}")
        if self.decode_threads is not None and not 1 <= self.decode_threads <= 1024:
            raise ValueError(f"decode_threads must be in [1, 1024], got {self.decode_threads}")
        if not 0 <= self.prefill_lane_threads <= 1024:
            raise ValueError(f"prefill_lane_threads must be in [0, 1024], got {self.prefill_lane_threads}")
        if not 0.0 < self.tenant_kv_share <= 1.0:
            raise ValueError(f"tenant_kv_share must be in (0, 1], got {self.tenant_kv_share}")
        if not 0.0 < self.grammar_compile_timeout <= 3600.0:
            raise ValueError(f"grammar_compile_timeout must be in (0, 3600] seconds, got {self.grammar_compile_timeout}")
        if not 1 <= self.min_prefill_tokens <= 1 << 20:
            raise ValueError(f"min_prefill_tokens must be in [1, 2^20], got {self.min_prefill_tokens}")
