"""`GGUFLinear`: y = x W^T (+ b) with W kept in its GGUF block format's integers, never expanded whole.

    layout  formats               held as                                   fast path
    int4    Q4_0, Q4_1, Q4_K      values 0..15 packed for the int4 kernel,  aten._weight_int4pack_mm_for_cpu
                                  per group of 32 an fp32 scale and zero    (x rounded to fp32, up to
                                  (w = (v - 8) s + z); the same values as   `small_batch_rows` rows); else
                                  nibbles [N, K / 2] for the row blocks     row blocks (below)
    int8    Q5_0, Q5_K, Q6_K,     values int8 [N, K], per group of 32       row blocks
            Q8_0                  (Q6_K: 16) an fp32 scale (and offset)

Row blocks: a few hundred output rows at a time are dequantized to fp32 (a buffer of about
`BLOCK_ELEMENTS` values, kept in cache) and multiplied, so no dense copy of the whole weight ever
exists. The row blocks compute gguf-py's own weights (the same fp32 products, bit for bit). The int4
kernel computes (v - 8) s + z with z = fl((lo + 8) s + offset) (lo: the format's smallest value), one
more rounding: exact for Q4_0 (z = 0), within one fp32 ulp of |z| per weight for Q4_1 and Q4_K (the
tests state it). `reference` multiplies with the whole dequantized weight in one matmul, the pure-torch path beside
the fast ones.

Memory per weight: int8 layout 1 byte + 4 (Q5_K: 8) bytes per group; int4 layout 1 byte (the kernel's
packing and the nibbles) + 12 (Q4_1, Q4_K: 16, the offsets) bytes per group of 32 (the kernel's scale
and zero, and the row blocks' own scale); against 2 bytes for a
bf16 copy, 4 for fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvsplice.layers.gguf_blocks import GroupedWeight, decode_blocks

INT4_KERNEL_GROUP = 32
# Rows <= this go through the int4 kernel: it dequantizes per row, so many rows are faster in blocks.
INT4_SMALL_BATCH_ROWS = 8
BLOCK_ELEMENTS = 1 << 18     # one row block's fp32 buffer: 1 MiB, within a core's L2


@dataclass(frozen=True)
class Int4Kernel:
    """The int4 kernel's operands: `packed` (aten._convert_weight_to_int4pack_for_cpu of v, 0..15) and
    `scales_zeros` fp32 [K / 32, N, 2] (scale, zero per group)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor


class GGUFLinear:
    """y = x W^T (+ b) for W a GGUF block-format weight; callable on x [M, K] -> [M, N] in x.dtype
    (computed in fp32). `grouped`: the weight's GroupedWeight, except that int4 layouts keep their
    values as `nibbles` instead (values - lo, two per byte: column 2j low, 2j + 1 high) and drop
    `grouped.values` (None). Build with `GGUFLinear.from_blocks` or `from_reader_tensor`."""

    def __init__(self, grouped: GroupedWeight, bias: Optional[torch.Tensor],
                 nibbles: Optional[torch.Tensor], kernel: Optional[Int4Kernel], small_batch_rows: int):
        self.grouped, self.bias = grouped, bias
        self.nibbles, self.kernel, self.small_batch_rows = nibbles, kernel, small_batch_rows
        self.out_features, self.in_features = grouped.scales.shape[0], self._in_features()

    def _in_features(self) -> int:
        if self.nibbles is not None:
            return self.nibbles.shape[1] * 2
        return self.grouped.values.shape[1]

    @staticmethod
    def from_blocks(raw: torch.Tensor, type_name: str, in_features: int,
                    bias: Optional[torch.Tensor] = None, small_batch_rows: Optional[int] = None) -> "GGUFLinear":
        """From a weight's GGUF bytes (uint8 [N, row bytes], see `gguf_blocks.decode_blocks`)."""
        grouped = decode_blocks(raw, type_name, in_features)
        bias = None if bias is None else bias.detach().float()
        if not grouped.fmt.int4:
            return GGUFLinear(grouped, bias, None, None, 0)
        lo = grouped.value_range[0]
        levels = (grouped.values.to(torch.int16) - lo).to(torch.uint8)
        nibbles = levels[:, 0::2] | (levels[:, 1::2] << 4)
        kernel = _int4_kernel(levels, grouped, lo)
        rows = INT4_SMALL_BATCH_ROWS if small_batch_rows is None else small_batch_rows
        without_values = GroupedWeight(grouped.fmt, None, grouped.scales, grouped.offsets)
        return GGUFLinear(without_values, bias, nibbles.contiguous(), kernel, rows)

    @staticmethod
    def from_reader_tensor(tensor, bias: Optional[torch.Tensor] = None) -> "GGUFLinear":
        """From a gguf.ReaderTensor of a 2-D block-format weight (its `shape` is GGUF's [K, N])."""
        in_features, out_features = (int(n) for n in tensor.shape)
        raw = torch.from_numpy(tensor.data.reshape(out_features, -1).copy())
        return GGUFLinear.from_blocks(raw, tensor.tensor_type.name, in_features, bias)

    def nbytes(self) -> int:
        """Bytes held for the weight (and bias)."""
        held = [self.grouped.values, self.grouped.scales, self.grouped.offsets, self.nibbles, self.bias]
        if self.kernel is not None:
            held += [self.kernel.packed, self.kernel.scales_zeros]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if t is not None}
        return sum(storages.values())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype is torch.float32 else x.float()
        if self.kernel is not None and x.shape[0] <= self.small_batch_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xf.contiguous(), self.kernel.packed,
                                                           INT4_KERNEL_GROUP, self.kernel.scales_zeros)
        else:
            y = self._row_blocks(xf)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype is x.dtype else y.to(x.dtype)

    def _row_blocks(self, x: torch.Tensor) -> torch.Tensor:
        step = max(16, BLOCK_ELEMENTS // self.in_features // 16 * 16)
        parts = [x @ self.dequantized_rows(start, start + step).t()
                 for start in range(0, self.out_features, step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def dequantized_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the weight in fp32, as the row blocks use them (gguf-py's values)."""
        grouped = self.grouped
        group = grouped.fmt.group
        if self.nibbles is None:
            values = grouped.values[start:stop]
        else:
            packed = self.nibbles[start:stop]
            levels = torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(packed.shape[0], -1)
            values = levels.to(torch.int8) + grouped.value_range[0]
        rows = values.shape[0]
        w = grouped.scales[start:stop, :, None] * values.view(rows, -1, group)
        if grouped.offsets is not None:
            w = w + grouped.offsets[start:stop, :, None]
        return w.view(rows, -1)

    def dequantized(self) -> torch.Tensor:
        """The whole fp32 [N, K] weight (for tests and the reference path)."""
        return self.dequantized_rows(0, self.out_features)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same product with the dequantized weight, in fp32, whatever the batch size."""
        y = x.float() @ self.dequantized().t()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def _int4_kernel(levels: torch.Tensor, grouped: GroupedWeight, lo: int) -> Int4Kernel:
    """w = s value + o = s (v + lo) + o = (v - 8) s + z with z = (lo + 8) s + o."""
    zeros = (lo + 8) * grouped.scales
    if grouped.offsets is not None:
        zeros = zeros + grouped.offsets
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels.to(torch.int32), 1)
    scales_zeros = torch.stack((grouped.scales, zeros), dim=-1).transpose(0, 1).contiguous()
    return Int4Kernel(packed, scales_zeros)


def linear_from_gguf(reader, name: str, bias_name: Optional[str] = None) -> GGUFLinear:
    """The GGUFLinear of tensor `name` of a gguf.GGUFReader (and its bias `bias_name`, an F32 tensor)."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if name not in tensors:
        raise ValueError(f"GGUF file has no tensor {name!r}")
    bias = None
    if bias_name is not None:
        bias = torch.from_numpy(tensors[bias_name].data.astype("float32").copy())
    return GGUFLinear.from_reader_tensor(tensors[name], bias)
