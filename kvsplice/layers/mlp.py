"""SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"), llama layout."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kvsplice.layers.quant_linear import BucketedLinear


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); parameter names match HF checkpoints."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.gate_proj = BucketedLinear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = BucketedLinear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = BucketedLinear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., hidden]` -> `[..., hidden]`."""
        # in place: the gate's activation buffer is reused for the product (one fewer
        # [tokens, intermediate] allocation per layer; safe, nothing else holds it)
        hidden = F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x))
        return self.down_proj(hidden)
