"""The lm_head of up to 8 decode rows from the checkpoint's own int8 blocks (a GGUF Q8_0 head), by a
C kernel (csrc/int8_tiles.c, built by kvsplice.layers.native_build) that streams them at the
machine's read bandwidth.

Why: speed and fidelity. The head is the largest single read of a decode step (Gemma 3 270M's
262,144 x 640 embedding: 168 MB of int8 against 335 MB in bf16), and one row is memory-bound. The
int8 blocks are half the bytes of the bf16 copy, but no torch kernel read them at the machine's
bandwidth (inductor's loop, the one this kernel replaces, reached about two thirds of it); this
kernel does (docs/BENCHMARKS_HISTORY.md, "The lm_head of up to 8 rows on a C kernel"). And the
blocks are the file's exact weights, where the bf16 copy keeps 8 significant bits of each d q.

Layout. Int8Blocks holds the weight in tiles of 16 outputs, each tile's K inputs in blocks of 32
(one scale each), each block as 16 steps of an input pair for all 16 outputs: the 512 bytes of a
tile's block are adjacent, so the kernel reads the weights once, front to back, for all rows.

    values [T, K/32, 16, 16, 2] int8    values[t, b, s, l, j] = q[16 t + l, 32 b + 2 s + j]
    scales [T, K/32, 16]        fp16    scales[t, b, l]       = d[16 t + l, b]
                                        (fp32 where a scale is no fp16 number; then no kernel)
    T = ceil(V / 16): a last partial tile is padded with zero weights, its outputs dropped

Numerics. GGUF's Q8_0 stores w = d q per block of 32 inputs (q int8 with max |q| = 127, d fp16).
The converter dequantizes that to fp32 exactly (an 11-bit d times a 7-bit q fits in fp32's 24
bits), and `int8_blocks` recovers (q, d) from the fp32 values bit for bit before the model is cast
to bf16. The kernel scales each row's block of 32 inputs to int16 (sx = max |x| / 32767,
xq = round(x / sx): a relative error of at most 2^-16 of the block's largest input, where the bf16
row itself carries 2^-9 of each), sums q xq exactly in int32 and accumulates
(sum) * (d sx) over the blocks in fp32:

    y[v] = sum_b fp32(sum_i q[v, 32 b + i] xq[32 b + i]) * (d[v, b] * sx[b])

Its code paths (AVX-512 VNNI, AVX2, plain C) give the same bits, and one row's logits do not
depend on the rows computed beside it. `tile_product_reference` is the same computation in torch.
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from kvsplice.layers.native_build import NativeUnavailable, load_native

_log = logging.getLogger(__name__)
BLOCK = 32          # inputs per scale, as GGUF's Q8_0
TILE = 16           # outputs per tile: one 16-lane fp32 vector
_INT8_MAX = 127
_INT16_MAX = 32767
_PROBE_ROWS = 64    # rows checked first, so that a weight that is not int8 blocks is rejected fast
TRIAL_CALLS = 7     # calls of each head per row count in fit_rows


@dataclass(frozen=True)
class Int8Blocks:
    """A `[V, K]` weight as int8 `values` and fp16 (or fp32) `scales` in tiles of 16 outputs (layout
    in the module docstring): w[v, 32 b + i] = d[v, b] q[v, 32 b + i] exactly, V = `out_features`."""

    values: torch.Tensor
    scales: torch.Tensor
    out_features: int

    @property
    def in_features(self) -> int:
        return self.values.shape[1] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The fp32 `[V, K]` weight these blocks hold."""
        tiles = self.values.shape[0]
        q = self.values.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, -1, BLOCK)   # [V', K/32, 32]
        d = self.scales.permute(0, 2, 1).reshape(tiles * TILE, -1, 1)           # [V', K/32, 1]
        return (q.float() * d.float()).reshape(tiles * TILE, -1)[:self.out_features]


def _exact_blocks(weight: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(values [V, K/32, 32] int8, scales [V, K/32] fp32) with values * scales == weight exactly,
    each scale its block's amax / 127 (1 for an all-zero block); None when no such pair exists."""
    blocks = weight.float().reshape(weight.shape[0], -1, BLOCK)
    scales = blocks.abs().amax(-1) / _INT8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = blocks / scales.unsqueeze(-1)
    rounded = values.round()
    if not torch.equal(values, rounded) or not torch.equal(rounded * scales.unsqueeze(-1), blocks):
        return None
    return rounded.to(torch.int8), scales


def int8_blocks(weight: torch.Tensor) -> Optional[Int8Blocks]:
    """`weight [V, K]` (as the checkpoint stores it, before any cast) as Int8Blocks when it is
    exactly int8 values times one scale per block of 32 inputs (GGUF's Q8_0 dequantized); None
    otherwise, and for a weight whose width does not split into blocks. Reads the whole weight
    (the default model's 28 M values) unless its first rows already fail."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK or not weight.is_floating_point():
        return None
    if _exact_blocks(weight[:_PROBE_ROWS]) is None:
        return None
    exact = _exact_blocks(weight)
    if exact is None:
        return None
    values, scales = exact
    # the same numbers in half the bytes where they are all fp16 numbers (a Q8_0 file's are): the
    # head is memory-bound, and multiplying by an fp16 scale widens it to fp32 exactly
    halves = scales.half()
    if torch.equal(halves.float(), scales):
        scales = halves
    return _tiled(values, scales)


def _tiled(values: torch.Tensor, scales: torch.Tensor) -> Int8Blocks:
    """values [V, K/32, 32] and scales [V, K/32] in the tile layout, the last tile padded with zero
    weights (scale 1)."""
    out_features, blocks = scales.shape
    padding = -out_features % TILE
    if padding:
        values = torch.cat([values, values.new_zeros(padding, blocks, BLOCK)])
        scales = torch.cat([scales, scales.new_ones(padding, blocks)])
    tiles = values.shape[0] // TILE
    tiled = values.reshape(tiles, TILE, blocks, BLOCK // 2, 2).permute(0, 2, 3, 1, 4).contiguous()
    return Int8Blocks(tiled, scales.reshape(tiles, TILE, blocks).permute(0, 2, 1).contiguous(), out_features)


def tile_product_reference(x: torch.Tensor, blocks: Int8Blocks) -> torch.Tensor:
    """fp32 `[R, V]` of rows `x [R, K]` times `blocks`, computed as the kernel computes it (module
    docstring) in torch, the fp32 accumulation over blocks in float64 (so within fp32 rounding of
    the kernel's, not its bits). For tests and the benchmark: it holds R x V x K floats at once."""
    rows = x.shape[0]
    xb = x.float().reshape(rows, -1, BLOCK)                                   # [R, K/32, 32]
    sx = xb.abs().amax(-1) / _INT16_MAX
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = (xb / sx.unsqueeze(-1)).round().reshape(rows, 1, -1, BLOCK // 2, 1, 2)   # [R, 1, K/32, 16, 1, 2]
    sums = (blocks.values.long().unsqueeze(0) * xq.long()).sum((3, 5))        # [R, T, K/32, 16] exact
    scale = blocks.scales.float().unsqueeze(0) * sx.reshape(rows, 1, -1, 1)   # fp32, as the kernel
    logits = (sums.float().double() * scale.double()).sum(2)                  # [R, T, 16]
    return logits.reshape(rows, -1)[:, :blocks.out_features].float()


class BlockInt8Head:
    """Logits of 1..`max_rows` rows from `blocks` on the C kernel, loaded (built first, once per
    machine, into `library_dir`; kvsplice.layers.native_build) at construction, which raises
    NativeUnavailable where it cannot be had or the scales are not fp16; `extra_flags`: the
    compiler's, after kvsplice's (tests build each code path with them). `covers(x)` says whether
    `x` is rows this head takes; `__call__(x)` gives their fp32 logits `[R, V]`, or None when a row
    holds a value that is not finite (nothing ran: the caller's own head then gives what such a
    row gives). A call runs on torch's intra-op thread count of the moment and blocks until done;
    calls from several threads at once are safe (each has its own scratch)."""

    def __init__(self, blocks: Int8Blocks, dtype: torch.dtype, library_dir: Optional[Path] = None,
                 extra_flags: tuple[str, ...] = ()):
        if blocks.scales.dtype != torch.float16:
            raise NativeUnavailable("the head's scales are not fp16 numbers")
        self.blocks, self.dtype = blocks, dtype
        self._kernel = load_native("int8_tiles", library_dir, extra_flags)
        self._kernel.int8_tiles_rows.restype = ctypes.c_int
        self._kernel.int8_tiles_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                                 ctypes.c_void_p, ctypes.c_void_p]
        self._kernel.int8_tiles_path.restype = ctypes.c_char_p
        self.max_rows = int(self._kernel.int8_tiles_max_rows())
        self.code_path = self._kernel.int8_tiles_path().decode()

    def fit_rows(self, dense: Callable[[torch.Tensor], torch.Tensor], calls: int = TRIAL_CALLS) -> int:
        """Lower `max_rows` to the most rows (of 8, 4, 2; else 1) at which this head measured at
        least as fast as `dense` (the caller's head), calls alternating, medians compared; returns
        it. Why: from a few rows on the kernel's work grows with the rows while a dense bf16 head's
        stays flat, and where each crosses over depends on the model and the machine (the
        default model's 8 rows ran slower here with its weights in cache, Gemma 3's faster;
        docs/BENCHMARKS_HISTORY.md, "The lm_head of up to 8 rows on a C kernel"). Blocks for
        2 x `calls` head calls per count tried."""
        with torch.inference_mode():
            for rows in (8, 4, 2):
                x = torch.randn(rows, self.blocks.in_features).to(self.dtype)
                mine, theirs = [], []
                for _ in range(calls):
                    for head, times in ((self, mine), (dense, theirs)):
                        started = time.perf_counter()
                        head(x)
                        times.append(time.perf_counter() - started)
                if statistics.median(mine) <= statistics.median(theirs):
                    break
            else:
                rows = 1
        self.max_rows = rows
        _log.info("row head: the int8 blocks serve up to %d row(s), the dense head more (%s kernel)", rows,
                  self.code_path)
        return rows

    def covers(self, x: torch.Tensor) -> bool:
        """True for 1..max_rows rows `[R, K]` of `dtype`."""
        return x.dim() == 2 and 1 <= x.shape[0] <= self.max_rows and x.shape[1] == self.blocks.in_features \
            and x.dtype == self.dtype

    def __call__(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        rows, tiles = x.shape[0], self.blocks.values.shape[0]
        inputs = x.float().contiguous()
        logits = torch.empty(rows, tiles * TILE)
        pairs = torch.empty(rows, self.blocks.in_features // 2, dtype=torch.int32)
        row_scales = torch.empty(rows, self.blocks.in_features // BLOCK)
        status = self._kernel.int8_tiles_rows(
            self.blocks.values.data_ptr(), self.blocks.scales.data_ptr(), tiles, self.blocks.in_features,
            inputs.data_ptr(), rows, logits.data_ptr(), torch.get_num_threads(), pairs.data_ptr(),
            row_scales.data_ptr())
        if status != 0:
            return None
        return logits[:, :self.blocks.out_features]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same product in torch (for tests)."""
        return tile_product_reference(x, self.blocks)


def row_head_serves(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model in `dtype` on `device` gets a row head: bf16 / fp16 on the CPU (the kernel
    reads host memory; an fp32 model's dense head already holds the exact weights)."""
    return dtype in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu"


def build_row_head(blocks: Int8Blocks, dtype: torch.dtype, library_dir: Optional[Path] = None
                   ) -> Optional[BlockInt8Head]:
    """BlockInt8Head of `blocks`, or None (the reason logged) where its kernel cannot be had."""
    try:
        return BlockInt8Head(blocks, dtype, library_dir)
    except NativeUnavailable as reason:
        _log.warning("row head: none, the dense head serves every row: %s", reason)
        return None
