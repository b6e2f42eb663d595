"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 like transformers' LlamaRMSNorm, and the
zero-centred variant of Qwen3.5 / Qwen3-Next."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in fp32 (returns fp32)."""
    x32 = x.to(torch.float32)
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); the normalisation runs in fp32 and is cast back to
    x.dtype BEFORE the weight multiply, exactly as transformers does (so bf16 results match)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dim; any leading shape."""
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """y = norm(x) * (1 + weight), in fp32, cast to x.dtype at the end (transformers'
    `Qwen3_5RMSNorm` / `Qwen3NextRMSNorm`: the stored weight is centred on 0)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dim; any leading shape."""
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.to(torch.float32))).to(x.dtype)
