"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 like transformers' LlamaRMSNorm, and the
zero-centred variant of Qwen3.5 / Qwen3-Next."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


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


def doubled_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` twice, end to end: the weight `rms_norm_via_layer_norm` takes."""
    return torch.cat((weight, weight)).detach()


def rms_norm_via_layer_norm(x: torch.Tensor, weight2: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x [..., H]` times the weight, as one native layer_norm kernel (the fast path).

    F.rms_norm is a composite of about ten ops on CPU; layer_norm is one kernel, and on [x, -x]
    (mean exactly 0, variance mean(x^2)) it is RMSNorm: its first half is x / sqrt(mean(x^2) + eps)
    times weight. `weight2` is `doubled_weight(weight)`. Statistics in fp32 (layer_norm's opmath);
    the weight is applied before rounding to x.dtype, where `RMSNorm` rounds first (bf16 results
    differ by that rounding). Returns a view of the first half, in x.dtype.
    """
    width = x.shape[-1]
    return F.layer_norm(torch.cat((x, x.neg()), dim=-1), (2 * width,), weight2, None, eps)[..., :width]
