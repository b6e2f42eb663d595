"""The configs of the layers that take more than sizes: RoPE (`kvsplice.layers.rotary`) and the
Gated DeltaNet layers of a hybrid (`kvsplice.layers.gated_deltanet`, whose per-slot states
`kvsplice.cache.state_pool` holds). They sit below cache, layers and models, which all read them;
`kvsplice.models.config` reads them from a checkpoint's config.json into a ModelConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

RopeKind = Literal["default", "linear", "llama3", "yarn"]
HybridLayout = Literal["qwen3_5", "qwen3_next"]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters of one model (HF half-split layout).

    `rotary_dim` = int(head_dim * partial_rotary_factor) dims of each head are rotated, the rest pass
    through. The scaling fields are only meaningful for the kinds that use them:
    linear: factor; llama3: factor, low/high_freq_factor, original_max_position_embeddings;
    yarn: factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim,
    attention_factor, truncate. None means "not given" (the formula's default applies).
    """

    theta: float
    head_dim: int
    rotary_dim: int
    kind: RopeKind = "default"
    factor: Optional[float] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None
    beta_fast: Optional[float] = None
    beta_slow: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True
    max_position_embeddings: Optional[int] = None  # yarn: factor = max / original when factor is None


@dataclass(frozen=True)
class LinearAttnConfig:
    """Shape of the Gated DeltaNet layers of a hybrid (transformers' `linear_*` config keys) and
    the projection layout of its checkpoints."""

    layout: HybridLayout
    conv_kernel: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def num_params(self, hidden_size: int) -> int:
        """Parameters of one linear-attention layer (projections, conv, dt_bias, A_log, norm)."""
        proj = hidden_size * (self.conv_dim + self.value_dim + 2 * self.num_v_heads)
        return proj + self.conv_dim * self.conv_kernel + 2 * self.num_v_heads + self.v_head_dim \
            + self.value_dim * hidden_size
