"""Engine-level configuration (frozen). Model facts live in `kvsplice.models.config`, reuse
settings (and their KVREUSE_* environment table) in `kvsplice.reuse.config`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsplice.reuse.config import ReuseConfig


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs one model.

    num_slots: KV pool size in tokens (one slot = one token's K and V in every layer).
    max_batch_tokens: token budget of one forward (decode tokens first, then prefill chunks);
        this is also the chunked-prefill chunk size.
    max_running: requests decoding at once. max_waiting: queue length beyond which new
        requests are refused (the server answers 503 with Retry-After).
    max_model_len: longest sequence (prompt + completion) accepted; None = the model's own limit.
    prefix_cache: share exact prefixes through the radix tree.
    num_state_slots: recurrent-state slots of a hybrid (linear-attention) model: one per running
        request plus checkpoints and SCR sessions; None = a default from max_running and
        max_sessions. One slot of a large hybrid is big (all linear layers' conv and recurrent
        states), so size it to memory. Ignored for models without linear-attention layers.
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    num_slots: int = 65_536
    max_batch_tokens: int = 2048
    max_running: int = 64
    max_waiting: int = 512
    max_model_len: int | None = None
    prefix_cache: bool = True
    num_state_slots: int | None = None
    reuse: ReuseConfig = field(default_factory=ReuseConfig)

    def __post_init__(self) -> None:
        for name in ("num_slots", "max_batch_tokens", "max_running", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_state_slots is not None and self.num_state_slots < 2:
            raise ValueError(f"num_state_slots must be >= 2, got {self.num_state_slots}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
