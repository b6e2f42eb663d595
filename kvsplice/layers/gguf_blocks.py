"""GGUF block formats (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) decoded in torch, to groups.

Every format stores a weight row as blocks of bytes; each block decodes to integer values and, per
group of 32 (Q6_K: 16) values, a scale and possibly an offset:

    format  block   bytes  values            per group               w =
    Q4_0     32      18    q - 8  (-8..7)    d (fp16)                d (q - 8)
    Q4_1     32      20    q      (0..15)    d, m (fp16)             d q + m
    Q5_0     32      22    q - 16 (-16..15)  d (fp16)                d (q - 16)
    Q8_0     32      34    q      (-128..127) d (fp16)               d q
    Q4_K    256     144    q      (0..15)    d sc, dmin mn (6 bits)  (d sc) q - (dmin mn)
    Q5_K    256     176    q      (0..31)    d sc, dmin mn (6 bits)  (d sc) q - (dmin mn)
    Q6_K    256     210    q - 32 (-32..31)  d sc (sc int8, 16-group) (d sc) (q - 32)

`decode_blocks` gives that form (`GroupedWeight`: values int8, scales and offsets fp32), and
`dequantize_grouped` the floats: w = scale * value + offset, the products and sums in the same
order and fp32 rounding as gguf-py's `gguf.quants.dequantize`, so the result equals it bit for bit
(a K-quant's `- dmin mn` is `+ (-(dmin mn))`, and negation is exact). The K-quants' 6-bit sub-block
scales become one fp32 scale (and offset) per group of 32: the same numbers gguf-py computes, so the
regrouping loses nothing. Byte layouts follow llama.cpp's ggml-quants (and gguf-py's readers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

QK_K = 256            # the K-quants' superblock
K_SCALE_BYTES = 12    # Q4_K / Q5_K: eight 6-bit scales and eight 6-bit mins


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: `block_size` values in `type_size` bytes, one scale per `group`
    values; `int4`: every value fits 4 bits (16 levels), so the int4 kernel can hold it."""

    name: str
    block_size: int
    type_size: int
    group: int
    int4: bool


BLOCK_FORMATS = {
    "Q4_0": BlockFormat("Q4_0", 32, 18, 32, True),
    "Q4_1": BlockFormat("Q4_1", 32, 20, 32, True),
    "Q5_0": BlockFormat("Q5_0", 32, 22, 32, False),
    "Q8_0": BlockFormat("Q8_0", 32, 34, 32, False),
    "Q4_K": BlockFormat("Q4_K", QK_K, 144, 32, True),
    "Q5_K": BlockFormat("Q5_K", QK_K, 176, 32, False),
    "Q6_K": BlockFormat("Q6_K", QK_K, 210, 16, False),
}


@dataclass(frozen=True)
class GroupedWeight:
    """A `[N, K]` weight as w[n, k] = scales[n, g] * values[n, k] + offsets[n, g], g = k // group.
    `values` int8 [N, K]; `scales`, `offsets` fp32 [N, K / group]; `offsets` None where the format has
    none (the term is then absent, not zero: d q + 0 would turn -0.0 into +0.0)."""

    fmt: BlockFormat
    values: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @property
    def value_range(self) -> tuple[int, int]:
        """The smallest and largest value the format can store (not the ones present)."""
        return _VALUE_RANGES[self.fmt.name]


_VALUE_RANGES = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q5_0": (-16, 15), "Q8_0": (-128, 127),
                 "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31)}


def block_format(type_name: str) -> BlockFormat:
    """The BlockFormat named `type_name` (a GGMLQuantizationType's name, e.g. "Q4_K"), else ValueError."""
    if type_name not in BLOCK_FORMATS:
        raise ValueError(f"GGUF tensor type {type_name!r} is not a supported block format "
                         f"(supported: {sorted(BLOCK_FORMATS)})")
    return BLOCK_FORMATS[type_name]


def decode_blocks(raw: torch.Tensor, type_name: str, in_features: int) -> GroupedWeight:
    """Decode `raw` (uint8, one row of `in_features` values per row: [N, in_features / block_size *
    type_size] bytes, as a GGUF file stores a [N, K] weight) into its GroupedWeight."""
    fmt = block_format(type_name)
    if in_features % fmt.block_size:
        raise ValueError(f"{fmt.name} rows hold multiples of {fmt.block_size} values, not {in_features}")
    rows = raw.shape[0]
    row_bytes = in_features // fmt.block_size * fmt.type_size
    if raw.dtype is not torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes:
        raise ValueError(f"{fmt.name} [{rows}, {in_features}] needs uint8 [{rows}, {row_bytes}] bytes, "
                         f"got {raw.dtype} {list(raw.shape)}")
    blocks = raw.contiguous().view(-1, fmt.type_size)
    values, scales, offsets = _DECODERS[fmt.name](blocks)
    groups = in_features // fmt.group
    offsets = None if offsets is None else offsets.reshape(rows, groups)
    return GroupedWeight(fmt, values.reshape(rows, in_features), scales.reshape(rows, groups), offsets)


def dequantize_grouped(weight: GroupedWeight) -> torch.Tensor:
    """The fp32 [N, K] weight: gguf-py's `dequantize` of the same bytes, bit for bit."""
    rows, cols = weight.shape
    group = weight.fmt.group
    values = weight.values.view(rows, cols // group, group).float()
    w = weight.scales[:, :, None] * values
    if weight.offsets is not None:
        w = w + weight.offsets[:, :, None]
    return w.view(rows, cols)


def dequantize(raw: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """The fp32 [N, in_features] weight that GGUF bytes `raw` (see `decode_blocks`) stand for."""
    return dequantize_grouped(decode_blocks(raw, type_name, in_features))


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at bytes [start, start + 2) of every block, as fp32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes [n, chunks * width] -> 4-bit values [n, chunks * 2 * width]: per chunk of `width`
    bytes, the low nibbles first, then the high ones (ggml's layout)."""
    chunks = qs.reshape(qs.shape[0], -1, 1, width)
    shifts = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return ((chunks >> shifts) & 0x0F).reshape(qs.shape[0], -1)


def _bits(qh: torch.Tensor, count: int, width: int, bits: int = 1) -> torch.Tensor:
    """Bytes [n, width] -> [n, count * width]: field i (of `bits` bits) of every byte, i = 0..count-1,
    one row of `width` per field."""
    shifts = torch.arange(0, count * bits, bits, dtype=torch.uint8).view(1, count, 1)
    return ((qh.reshape(qh.shape[0], 1, width) >> shifts) & ((1 << bits) - 1)).reshape(qh.shape[0], -1)


def _signed(q: torch.Tensor, bias: int) -> torch.Tensor:
    return (q.to(torch.int16) - bias).to(torch.int8)


def _q4_0(blocks):
    return _signed(_nibbles(blocks[:, 2:], 16), 8), _fp16(blocks, 0), None


def _q4_1(blocks):
    return _nibbles(blocks[:, 4:], 16).to(torch.int8), _fp16(blocks, 0), _fp16(blocks, 2)


def _q5_0(blocks):
    # qh: 32 bits little-endian, bit i is value i's fifth bit (byte i // 8, bit i % 8)
    high = _bits(blocks[:, 2:6], 8, 4).view(-1, 8, 4).transpose(1, 2).reshape(-1, 32)
    low = _nibbles(blocks[:, 6:], 16)
    return _signed(low | (high << 4), 16), _fp16(blocks, 0), None


def _q8_0(blocks):
    return blocks[:, 2:].contiguous().view(torch.int8), _fp16(blocks, 0), None


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (llama.cpp's
    get_scale_min_k4): bytes 0-3 / 4-7 hold scales / mins 0-3 in their low 6 bits and the top 2
    bits of 4-7; bytes 8-11 hold the low 4 bits of scales / mins 4-7."""
    low, high, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=1)
    mins = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=1)
    return scales.float(), mins.float()


def _k_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: per sub-block of 32, the scale d sc and the offset -(dmin mn)."""
    scales, mins = _k_scales_mins(blocks[:, 4:4 + K_SCALE_BYTES])
    return _fp16(blocks, 0) * scales, -(_fp16(blocks, 2) * mins)


def _q4_k(blocks):
    scales, offsets = _k_groups(blocks)
    return _nibbles(blocks[:, 16:], 32).to(torch.int8), scales, offsets


def _q5_k(blocks):
    scales, offsets = _k_groups(blocks)
    high = _bits(blocks[:, 16:48], 8, 32)      # sub-block j's fifth bits: bit j of qh
    low = _nibbles(blocks[:, 48:], 32)
    return (low | (high << 4)).to(torch.int8), scales, offsets


def _q6_k(blocks):
    # ql 128 bytes: two halves of 64, each low nibbles then high ones; qh 64 bytes: two halves of 32,
    # each four 2-bit fields; then 16 int8 sub-block scales and the fp16 d
    low = _nibbles(blocks[:, :128], 64)
    high = _bits(blocks[:, 128:192].reshape(-1, 32), 4, 32, bits=2).reshape(-1, QK_K)
    sub_scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    return _signed(low | (high << 4), 32), _fp16(blocks, 208) * sub_scales, None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
