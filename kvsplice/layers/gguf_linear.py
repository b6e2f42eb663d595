"""`GGUFLinear`: y = x W^T (+ b) with W kept in its GGUF block format, never expanded whole.

It holds the decoded blocks (`gguf_blocks.GroupedWeight`: int8 values, an fp32 scale and offset per
group) and, for the formats with groups of 32 (Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q8_0), the same weight
as int4 planes for aten._weight_int4pack_mm_for_cpu, which computes sum over k of x (v - 8) s + z,
v in 0..15 per weight and a scale s and zero z per group of 32:

    w = s value + o,  u = value - lo (lo: the format's smallest value; u has 4, 5 or 8 bits)
      = sum over planes p of ((u >> 4p) & 15 - 8) s 16^p + z_p,
        z_0 = (lo + 8) s + o,  z_p = 8 s 16^p above

One plane for the 4-bit formats, two for Q5_0 / Q5_K (the second holds the fifth bit) and Q8_0.
The kernel is fast only with bf16 activations and bf16 scales (its fp32 path is many times slower
on AVX-512 CPUs), so the planes hold bf16 `s 16^p` and `z_p` by default: each weight is then off by
at most 2^-7 (8 |s_p| + |z_p|) summed over its planes, the bf16 roundings (unit roundoff 2^-8) of
its scale, zero and output (the tests check the bound); with `kernel_dtype=torch.float32` only the
fp32 roundings of z_0 and of the kernel remain.

Above `small_batch_rows` rows (the kernel dequantizes per row), for Q6_K (groups of 16, which the
kernel does not take) and without planes (`kernel_dtype=None`), the product runs in row blocks: a
few hundred output rows at a time are dequantized to fp32 (a buffer of about `BLOCK_ELEMENTS`
values) and multiplied, so those are gguf-py's own weights, bit for bit, and no dense copy of the
whole weight ever exists. bf16 activations of `BF16_BLOCK_ROWS` rows or more multiply the blocks
rounded to bf16 (as a dense bf16 copy holds them: oneDNN's bf16 matmul is several times faster
than fp32 on AVX512-BF16 / AMX); other activations in fp32, exactly. `reference` multiplies with
the whole dequantized weight in one matmul, the pure-torch path beside the fast ones.

Memory per weight: the decoded blocks 1 byte + 4 (Q4_1, Q4_K, Q5_K: 8) bytes per group, plus the
planes' 0.5 byte and 4 bytes per group of 32 each; against 2 bytes for a bf16 copy, 4 for fp32.
Without planes that is 1.13 to 1.25 bytes; with them 1.75 to 1.88 (Q4_*), 2.38 to 2.5 (Q5_*,
Q8_0): the price of the fast small batches, as PackedLinear pays for its dense copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn import functional as F

from kvsplice.layers.gguf_blocks import GroupedWeight, block_format, decode_blocks, dequantize_grouped

INT4_KERNEL_GROUP = 32
KERNEL_ROWS = 16             # the int4 kernel's packing takes N divisible by this (else: row blocks only)
# Rows <= this go through the int4 planes: the kernel dequantizes per row, so many rows are faster
# in row blocks (decoded once for all rows).
SMALL_BATCH_ROWS = 16
BLOCK_ELEMENTS = 1 << 18     # one row block's fp32 buffer: 1 MiB, within a core's L2
# bf16 activations from this many rows on multiply bf16 row blocks (below, oneDNN's reorder of each
# block's weight costs more than the fp32 matmul; measured on a core with AMX: fp32 faster
# at 8 rows, bf16 at 16 and 64)
BF16_BLOCK_ROWS = 16
_VALUE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_K": 5, "Q8_0": 8}


@dataclass(frozen=True)
class Int4Plane:
    """One plane's kernel operands: `packed` (aten._convert_weight_to_int4pack_for_cpu of its 4-bit
    values) and `scales_zeros` [K / 32, N, 2] (scale, zero per group) in the kernel dtype."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor


class GGUFLinear:
    """y = x W^T (+ b) for W a GGUF block-format weight; callable on x [M, K] -> [M, N] in x.dtype.
    `grouped`: the decoded blocks (int8 values, fp32 scales and offsets); `planes`: the int4 planes
    (empty where the format has none or they were not asked for). Build with
    `GGUFLinear.from_blocks` or `from_reader_tensor`."""

    def __init__(self, grouped: GroupedWeight, bias: Optional[torch.Tensor], planes: tuple[Int4Plane, ...],
                 small_batch_rows: int):
        self.grouped, self.bias = grouped, bias
        self.planes, self.small_batch_rows = planes, small_batch_rows
        self.out_features, self.in_features = grouped.shape

    @staticmethod
    def from_blocks(raw: torch.Tensor, type_name: str, in_features: int, bias: Optional[torch.Tensor] = None,
                    kernel_dtype: Optional[torch.dtype] = torch.bfloat16,
                    small_batch_rows: int = SMALL_BATCH_ROWS) -> "GGUFLinear":
        """From a weight's GGUF bytes (uint8 [N, row bytes], see `gguf_blocks.decode_blocks`).
        `kernel_dtype`: the int4 planes' activation and scale dtype (bf16: fast; fp32: ~exact,
        slow); None: no planes, every product in row blocks (so too where N is not a multiple of
        KERNEL_ROWS)."""
        grouped = decode_blocks(raw, type_name, in_features)       # validates the bytes too
        bias = None if bias is None else bias.detach().float()
        planes = ()
        if kernel_dtype is not None and type_name in _VALUE_BITS and grouped.shape[0] % KERNEL_ROWS == 0:
            planes = int4_planes(grouped, _VALUE_BITS[type_name], kernel_dtype)
        return GGUFLinear(grouped, bias, planes, small_batch_rows)

    @staticmethod
    def from_reader_tensor(tensor, bias: Optional[torch.Tensor] = None, **options) -> "GGUFLinear":
        """From a gguf.ReaderTensor of a 2-D block-format weight (its `shape` is GGUF's [K, N])."""
        in_features, out_features = (int(n) for n in tensor.shape)
        raw = torch.from_numpy(tensor.data.reshape(out_features, -1).copy())
        return GGUFLinear.from_blocks(raw, tensor.tensor_type.name, in_features, bias, **options)

    def nbytes(self) -> int:
        """Bytes held for the weight (and bias)."""
        grouped = self.grouped
        held = [grouped.values, grouped.scales, grouped.offsets, self.bias]
        held += [t for plane in self.planes for t in (plane.packed, plane.scales_zeros)]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    @property
    def few_row_limit(self) -> int:
        """The most rows multiplied by the int4-plane kernel (0: it has none)."""
        return self.small_batch_rows if self.planes else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.planes and x.shape[0] <= self.small_batch_rows:
            y = self._planes_mm(x)
        elif x.dtype is torch.bfloat16 and x.shape[0] >= BF16_BLOCK_ROWS:
            y = self._row_blocks(x, torch.bfloat16)
        else:
            y = self._row_blocks(x if x.dtype is torch.float32 else x.float(), torch.float32)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype is x.dtype else y.to(x.dtype)

    def _planes_mm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.planes[0].scales_zeros.dtype
        xk = (x if x.dtype is dtype else x.to(dtype)).contiguous()
        y = None
        for plane in self.planes:
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, plane.packed, INT4_KERNEL_GROUP,
                                                              plane.scales_zeros).float()
            y = part if y is None else y.add_(part)
        return y

    def _row_blocks(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x [M, K] (in `dtype`) times row blocks of the weight rounded to `dtype` (fp32: exact)."""
        step = max(16, BLOCK_ELEMENTS // self.in_features // 16 * 16)
        parts = [F.linear(x, self._rows_in(start, start + step, dtype))
                 for start in range(0, self.out_features, step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _rows_in(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        rows = self.dequantized_rows(start, stop)
        return rows if dtype is torch.float32 else rows.to(dtype)

    def dequantized_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the weight in fp32: gguf-py's values, bit for bit."""
        return self._dequantize(slice(start, stop))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64, any shape) of the weight in fp32, [*ids.shape, K]: the lookup of a
        token embedding stored in a block format (a tied lm_head's weight)."""
        return self._dequantize(ids.reshape(-1)).view(*ids.shape, self.in_features)

    def _dequantize(self, rows) -> torch.Tensor:
        grouped = self.grouped
        offsets = None if grouped.offsets is None else grouped.offsets[rows]
        return dequantize_grouped(GroupedWeight(grouped.fmt, grouped.values[rows], grouped.scales[rows], offsets))

    def dequantized(self) -> torch.Tensor:
        """The whole fp32 [N, K] weight (for tests and the reference path)."""
        return self.dequantized_rows(0, self.out_features)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same product with the dequantized weight, in fp32, whatever the batch size."""
        y = x.float() @ self.dequantized().t()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def int4_planes(grouped: GroupedWeight, bits: int, dtype: torch.dtype) -> tuple[Int4Plane, ...]:
    """`grouped` (groups of 32, values of `bits` bits) as int4 planes: see the module docstring."""
    if grouped.fmt.group != INT4_KERNEL_GROUP:
        raise ValueError(f"{grouped.fmt.name} has groups of {grouped.fmt.group}; the int4 kernel takes 32")
    lo = grouped.value_range[0]
    levels = (grouped.values.to(torch.int32) - lo)
    zero = (lo + 8) * grouped.scales
    if grouped.offsets is not None:
        zero = zero + grouped.offsets
    planes = []
    for index in range((bits + 3) // 4):
        scale = grouped.scales * 16 ** index
        nibbles = (levels >> (4 * index)) & 0x0F
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.contiguous(), 1)
        scales_zeros = torch.stack((scale, zero if index == 0 else 8 * scale), dim=-1)
        planes.append(Int4Plane(packed, scales_zeros.transpose(0, 1).contiguous().to(dtype)))
    return tuple(planes)


def linear_from_gguf(reader, name: str, bias_name: Optional[str] = None, **options) -> GGUFLinear:
    """The GGUFLinear of tensor `name` of a gguf.GGUFReader (and its bias `bias_name`, an F32 tensor);
    `options` as `GGUFLinear.from_blocks` takes them."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if name not in tensors:
        raise ValueError(f"GGUF file has no tensor {name!r}")
    block_format(tensors[name].tensor_type.name)
    bias = None
    if bias_name is not None:
        bias = torch.from_numpy(tensors[bias_name].data.astype("float32").copy())
    return GGUFLinear.from_reader_tensor(tensors[name], bias, **options)


def stack_grouped(parts: list[GroupedWeight]) -> GroupedWeight:
    """`parts` of one block format side by side as one weight (rows concatenated)."""
    fmt = parts[0].fmt
    if any(part.fmt != fmt for part in parts):
        raise ValueError("only weights of one block format stack")
    offsets = None if parts[0].offsets is None else torch.cat([part.offsets for part in parts])
    return GroupedWeight(fmt, torch.cat([part.values for part in parts]), torch.cat([part.scales for part in parts]),
                         offsets)


class GGUFPlanesLinear:
    """A fused projection (weights side by side, as `PackedLinear.build` fuses them) whose few-row
    products run on the GGUF blocks' int4 planes and whose larger ones on `dense` (a dense
    PackedLinear of the same weights in the model dtype, the copy the reference path computes
    with). Adjacent parts of one block format share one set of planes (one kernel call per
    plane); a part whose format has no planes (Q6_K: groups of 16) sends every product to
    `dense`. Each planed weight is off the dense one by the bound in the module docstring.

        q (Q5_0) | k (Q5_0) | v (Q8_0)   ->   planes of [q | k] (2), planes of v (2), outputs side by side
    """

    def __init__(self, parts: list[GroupedWeight], dense, small_batch_rows: int = SMALL_BATCH_ROWS,
                 kernel_dtype: torch.dtype = torch.bfloat16):
        runs: list[list[GroupedWeight]] = []
        for part in parts:
            if runs and runs[-1][0].fmt == part.fmt:
                runs[-1].append(part)
            else:
                runs.append([part])
        stacked = [stack_grouped(run) for run in runs]
        planable = all(g.fmt.name in _VALUE_BITS and g.shape[0] % KERNEL_ROWS == 0 for g in stacked)
        self.planes = tuple(int4_planes(g, _VALUE_BITS[g.fmt.name], kernel_dtype) for g in stacked) if planable else ()
        self.dense, self.small_batch_rows = dense, small_batch_rows
        self.weight, self.bias = dense.weight, dense.bias

    @property
    def out_features(self) -> int:
        return self.dense.out_features

    @property
    def few_row_limit(self) -> int:
        """The most rows multiplied by the int4-plane kernel (0: it has none; above it, the dense copy's)."""
        return self.small_batch_rows if self.planes else self.dense.few_row_limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.planes or x.shape[0] > self.small_batch_rows:
            if torch.compiler.is_compiling():   # the prepacked copy is opaque to tracing; the plain one has its bits
                return F.linear(x, self.weight, self.bias)
            return self.dense(x)
        dtype = self.planes[0][0].scales_zeros.dtype
        xk = (x if x.dtype is dtype else x.to(dtype)).contiguous()
        outputs = []
        for planes in self.planes:
            y = None
            for plane in planes:
                part = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, plane.packed, INT4_KERNEL_GROUP,
                                                                  plane.scales_zeros)
                y = part.float() if y is None else y.add_(part.float())
            outputs.append(y)
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)
