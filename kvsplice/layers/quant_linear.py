"""Weight formats of a linear layer, and `PackedLinear`: a weight held in one of them.

    format  held as                                     small-batch kernel (bf16 activations)
    dense   W [N, K] in the model dtype                 F.linear
    int8    q int8 [N, K], scale [N] (per out channel)  aten._weight_int8pack_mm
    int4    q in [0, 16) [N, K], per group of 32 input  aten._weight_int4pack_mm_for_cpu
            columns a scale s and zero z: w = (q - 8) s + z

`quantize(w, fmt)` rounds a weight to a format and `dequantize` gives the floats back; the fast
path multiplies with the integer form, the reference path with `dequantize(quantize(w))`, so both
compute the same model. Asymmetric min-max int4 over groups of 32 is GGUF's Q4_1 block
(w = d q + m): a Q4_1 tensor dequantized to floats and quantized again gives back its own values,
so a Q4_1 checkpoint runs on its own quantization (`is_lossless` checks it). Scales and zeros are
held in bf16, as the kernels take them.

The kernels are fast only for a few rows (they dequantize per row); above `small_batch_rows`
rows `PackedLinear` multiplies with the dense copy instead (bf16 matmul is compute-efficient
there). `SMALL_BATCH_ROWS` holds the crossovers measured on SmolLM2-135M's 30 layers (figures in
docs/BENCHMARKS_HISTORY.md, "Figures formerly quoted in code").

Where oneDNN runs bf16 natively (avx512_bf16 / AMX), a bf16 dense copy is also held prepacked in
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the layout torch.compile's
CPU backend packs linears into): a plain bf16 F.linear reorders its weight on every call. The
results are the same (bit for bit). The prepacked copy was measured faster, at every row count
and for the lm_head, and moves the crossovers down, so `SMALL_BATCH_ROWS_PREPACKED` holds them
there (figures in docs/BENCHMARKS_HISTORY.md, "Figures formerly quoted in code"). The prepacked
copy costs the memory of the dense one again.

Batch invariance. oneDNN's bf16 matmul picks its blocking from the row count, and some row counts
sum a row's products in another order than others (the small ones up to ROW_TILE and the largest
agree; the figures are in benchmarks/scr_bf16.py), so a row's output depended on how many other
rows shared its call, and the rows an edited turn recomputes did not match the same rows of a full
prefill. The dense path therefore runs in `ROW_TILE`-row calls (`row_tiled_linear`): every row is
computed by a call of at most ROW_TILE rows, whatever else is in the batch
(tests/layers/test_batch_invariance.py checks it bitwise). fp32 matmuls are left whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from kvsplice.layers.shape_bucket import PADDED_DTYPES, bucket

WEIGHT_FORMATS = ("dense", "int8", "int4")
INT4_GROUP = 32                      # GGUF's Q4_0 / Q4_1 block size
SMALL_BATCH_ROWS = {"int8": 6, "int4": 12}
SMALL_BATCH_ROWS_PREPACKED = {"int8": 3, "int4": 8}   # against the faster prepacked dense copy
# bf16 / fp16 dense products run in calls of at most this many rows (see "Batch invariance" above):
# the largest row count of oneDNN's small-row blocking, which gives the same bits as its
# large-row one
ROW_TILE = 32
_KERNEL_DTYPE = torch.bfloat16       # the activation dtype both packed kernels are fast for


@dataclass(frozen=True)
class QuantizedWeight:
    """The integer form of a `[N, K]` weight: `values` int8 (int8: signed; int4: 0..15) and
    `scales` (int8: `[N]`; int4: `[K / 32, N, 2]`, scale then zero per group, bf16)."""

    fmt: str
    values: torch.Tensor
    scales: torch.Tensor


def check_format(fmt: str) -> str:
    """`fmt` if it is one of WEIGHT_FORMATS, else ValueError."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {WEIGHT_FORMATS}")
    return fmt


def supports(fmt: str, weight: torch.Tensor) -> bool:
    """True when `weight [N, K]` can be held in `fmt` (int4 needs K divisible by 32)."""
    return fmt != "int4" or weight.shape[1] % INT4_GROUP == 0


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Round `weight [N, K]` to int8 (symmetric, per output channel: s = max|w| / 127) or int4
    (asymmetric min-max per group of 32 inputs: s = (max - min) / 15, z = min + 8 s)."""
    w = weight.detach().to(torch.float32)
    if fmt == "int8":
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        scale = scale.to(_KERNEL_DTYPE)
        values = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(fmt, values, scale)
    if fmt == "int4":
        n, k = w.shape
        groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        exact_scale = (high - low) / 15
        # the zero from the unrounded scale: rounding both to bf16 then errs by (q - 8) ds + dz,
        # centred on the group's middle, not q ds growing towards its top
        scale = exact_scale.to(_KERNEL_DTYPE).float()
        zero = (low + 8 * exact_scale).to(_KERNEL_DTYPE).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((groups - zero[..., None]) / safe[..., None] + 8).clamp(0, 15)
        q = torch.where(scale[..., None] > 0, q, torch.full_like(q, 8))
        scales = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(_KERNEL_DTYPE)
        return QuantizedWeight(fmt, q.view(n, k).to(torch.int8), scales)
    raise ValueError(f"cannot quantize to {fmt!r}")


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The fp32 `[N, K]` weight that `qw` stands for."""
    if qw.fmt == "int8":
        return qw.values.float() * qw.scales.float()[:, None]
    n, k = qw.values.shape
    scale = qw.scales[..., 0].float().t()[:, :, None]   # [N, K/32, 1]
    zero = qw.scales[..., 1].float().t()[:, :, None]
    q = qw.values.float().view(n, k // INT4_GROUP, INT4_GROUP)
    return ((q - 8) * scale + zero).view(n, k)


def round_to_format(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """`weight` as the format stores it, in weight.dtype (dense: unchanged)."""
    if fmt == "dense":
        return weight
    return dequantize(quantize(weight, fmt)).to(weight.dtype)


def is_lossless(weight: torch.Tensor, fmt: str) -> bool:
    """True when `weight` already is `fmt` data: every int8 row integer multiples of one scale
    (exactly), every int4 group of 32 on a 16-level grid (a GGUF Q4_0 / Q4_1 tensor) up to the
    rounding of weight.dtype (a bf16 copy of Q4_1 data still counts). The format then loses only the bf16
    rounding of its scales."""
    if fmt == "dense":
        return True
    if not supports(fmt, weight):
        return False
    w = weight.detach().float()
    rounding = 2 * torch.finfo(weight.dtype).eps if weight.is_floating_point() else 0.0
    if fmt == "int8":
        top = w.abs().amax(dim=1, keepdim=True)
        # no allowance for the dtype here: bf16's 8-bit mantissa is itself an int8 grid
        grid_top, step, rounding = top, (top / 127).clamp(min=torch.finfo(torch.float32).tiny), 0.0
        off_grid = (w / step - (w / step).round()).abs() * step
    else:
        groups = w.view(w.shape[0], -1, INT4_GROUP)
        low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
        grid_top = torch.maximum(low.abs(), high.abs())
        step = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        off_grid = ((groups - low) / step - ((groups - low) / step).round()).abs() * step
    return bool((off_grid <= 1e-3 * step + rounding * grid_top).all())


# Linears in bf16 / fp16 run at `shape_bucket.bucket(rows)` rows: every distinct row count keeps
# kernel code for good (docs/BENCHMARKS_HISTORY.md, "Soak: hostile and ordinary traffic against
# one server"); bucketed, the 64 small row counts become 7 shapes per weight.
def bucketed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    prepacked: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], computed on `bucket(M)` rows (zero rows, sliced off)
    when x is bf16 / fp16 (see kvsplice.layers.shape_bucket); the same values, [M, N]. With
    `prepacked` (`prepack(weight)`), x [M, K] is multiplied with that instead."""
    rows = x.shape[0]
    if x.dtype not in PADDED_DTYPES or x.dim() != 2 or rows == 0 or bucket(rows) == rows:
        return _linear(x, weight, bias, prepacked)
    return _linear(F.pad(x, (0, 0, 0, bucket(rows) - rows)), weight, bias, prepacked)[:rows]


def row_tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     prepacked: Optional[torch.Tensor] = None, tile: int = ROW_TILE) -> torch.Tensor:
    """`bucketed_linear` of x [M, K] in calls of at most `tile` rows (the last one padded to its
    bucket): the same values, [M, N], and each row's bits independent of M where the kernel's are
    for calls of 1..tile rows. fp32 x (and M <= tile) in one call."""
    rows = x.shape[0]
    if rows <= tile or x.dtype not in PADDED_DTYPES:
        return bucketed_linear(x, weight, bias, prepacked)
    return torch.cat([bucketed_linear(x[start:start + tile], weight, bias, prepacked)
                      for start in range(0, rows, tile)])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            prepacked: Optional[torch.Tensor]) -> torch.Tensor:
    if prepacked is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), prepacked, bias, "none", [], "")


def can_prepack(weight: torch.Tensor) -> bool:
    """True when `weight` is a bf16 CPU tensor and oneDNN runs bf16 natively on this CPU."""
    return (weight.dtype is torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """`weight [N, K]` in oneDNN's blocked layout, for `bucketed_linear(..., prepacked=)` (an opaque
    mkldnn tensor; the row hint only picks a blocking, any row count can use it); None where
    `can_prepack` says no."""
    if not can_prepack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16)


class BucketedLinear(nn.Linear):
    """nn.Linear whose forward is `bucketed_linear` (rows of every leading dimension flattened):
    the reference Decoder's layers, so hybrid models and `--no-fast-path` keep a bounded set of
    bf16 kernel shapes too. Same parameters, state dict and values as nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return bucketed_linear(rows, self.weight, self.bias).reshape(*x.shape[:-1], self.out_features)


class PackedLinear:
    """y = x W^T (+ b) with W held in `fmt`; callable on `x [M, K]` -> `[M, N]` in x.dtype.

    Holds the dense copy `weight` (model dtype; for int8/int4 the dequantized values) for large
    batches and, for int8/int4, the packed form for batches of at most `small_batch_rows` rows.
    Both compute the same weights; the packed kernels take bf16 activations, so an fp32 x is
    rounded to bf16 on that path. `prepacked`: the dense copy in oneDNN's layout (`can_prepack`),
    which the large batches then use. `row_tile`: those batches run in calls of at most this many
    rows (`row_tiled_linear`, batch-invariant bits); None: in one call. Build it with
    `PackedLinear.build`.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], fmt: str,
                 packed: Optional[tuple[torch.Tensor, torch.Tensor]], small_batch_rows: int,
                 prepacked: Optional[torch.Tensor] = None, row_tile: Optional[int] = ROW_TILE):
        self.weight, self.bias, self.fmt = weight, bias, fmt
        self.packed, self.small_batch_rows = packed, small_batch_rows
        self.prepacked, self.row_tile = prepacked, row_tile

    @staticmethod
    def build(weights: list[torch.Tensor], biases: list[Optional[torch.Tensor]], fmt: str,
              small_batch_rows: Optional[int] = None, row_tile: Optional[int] = ROW_TILE) -> "PackedLinear":
        """One PackedLinear for the row-wise concatenation of `weights` (a fused projection:
        y splits back into each weight's outputs). Biases are concatenated likewise (a None
        bias is zeros). The dense copy keeps the first weight's dtype; for one dense weight it
        is that tensor itself (no copy)."""
        check_format(fmt)
        dense = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights], dim=0)
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else torch.zeros(w.shape[0], dtype=dense.dtype)
                              for w, b in zip(weights, biases)])
        if fmt == "dense" or not supports(fmt, dense):
            dense = dense.contiguous()
            return PackedLinear(dense, bias, "dense", None, 0, prepack(dense), row_tile)
        qw = quantize(dense, fmt)
        if fmt == "int8":
            packed = (qw.values.contiguous(), qw.scales)
        else:
            packed = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.values.to(torch.int32), 1),
                      qw.scales)
        weight = dequantize(qw).to(dense.dtype).contiguous()
        prepacked = prepack(weight)
        limits = SMALL_BATCH_ROWS if prepacked is None else SMALL_BATCH_ROWS_PREPACKED
        rows = limits[fmt] if small_batch_rows is None else small_batch_rows
        return PackedLinear(weight, bias, fmt, packed, rows, prepacked, row_tile)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def few_row_limit(self) -> int:
        """The most rows multiplied by the packed few-row kernel (0: it has none), whose bits
        differ from the dense path's."""
        return self.small_batch_rows if self.packed is not None else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.shape[0] > self.small_batch_rows:
            if self.row_tile is None:
                return bucketed_linear(x, self.weight, self.bias, self.prepacked)
            return row_tiled_linear(x, self.weight, self.bias, self.prepacked, self.row_tile)
        if x.dtype is _KERNEL_DTYPE:   # (no .to() calls: each costs a dispatch on the hot path)
            y = self._packed_mm(x)
        else:
            y = self._packed_mm(x.to(_KERNEL_DTYPE)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        values, scales = self.packed
        x = x.contiguous()   # both kernels refuse strided rows (e.g. a view of half a wider tensor)
        if self.fmt == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, values, scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, values, INT4_GROUP, scales)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same product with the dense copy, whatever the batch size (for tests)."""
        return F.linear(x, self.weight, self.bias)
