"""Gated feed-forward, llama layout: down_proj(act(gate_proj(x)) * up_proj(x)); SiLU makes it
SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"), GELU-tanh Gemma's GeGLU."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kvsplice.layers.quant_linear import BucketedLinear


def _silu_inplace(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # transformers' "gelu_pytorch_tanh" (GELUTanh) is exactly this
    return F.gelu(x, approximate="tanh")


# the activation of the gate's output: a fresh [tokens, intermediate] tensor, so it may be in place
ACTIVATIONS = {"silu": _silu_inplace, "gelu_pytorch_tanh": _gelu_tanh}


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)); parameter names match HF checkpoints.
    `activation`: "silu" (llama, qwen) or "gelu_pytorch_tanh" (Gemma 3)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r} (supported: {sorted(ACTIVATIONS)})")
        self.gate_proj = BucketedLinear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = BucketedLinear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = BucketedLinear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., hidden]` -> `[..., hidden]`."""
        # in place: the gate's activation buffer is reused for the product (one fewer
        # [tokens, intermediate] allocation per layer; safe, nothing else holds it)
        hidden = self.act(self.gate_proj(x)).mul_(self.up_proj(x))
        return self.down_proj(hidden)
