"""The lm_head of one decode row from the checkpoint's own int8 blocks (a GGUF Q8_0 head), summed in
fp32 by a compiled loop (`kvsplice serve --compile-decode`).

Why: fidelity, not speed. The bf16 head rounds the weights to 8 significant bits and its logits
to bf16, a measurable KL from the exact head; this head computes the exact one. It runs at the bf16
head's speed, not faster: the default model's 28 MB of int8 and 3.5 MB of scales are half the
bytes of its 57 MB of bf16, but the loop streams them slower than oneDNN's kernel
(benchmarks/row_head.py; docs/BENCHMARKS_HISTORY.md, "One decode row's lm_head from the GGUF's
Q8_0 blocks"). It serves one-row products only: a loop that reads the weights once per row loses to the
bf16 matmul from two rows on.

Numerics. GGUF's Q8_0 stores w = d q per block of 32 inputs (q int8 with max |q| = 127, d fp16).
The converter dequantizes that to fp32 exactly (an 11-bit d times a 7-bit q fits in fp32's 24 bits),
and `int8_blocks` recovers (q, d) from the fp32 values bit for bit before the model is cast to bf16.
So this head computes the checkpoint's own weights, and its logits are closer to the fp32
reference than those of the bf16 copy, which keeps 8 significant bits of each d q. It never
requantizes: from bf16 copies, rounding d q to 8 bits moves some of the default model's q by one
step. A head that is not exactly int8 blocks (`int8_blocks` returns None) has no row head.

    values  [K/32, 32, V] int8     block b, input i of the block, output v: contiguous in v, so
    scales  [K/32, V]     fp16     the loop over the vocabulary is one vector FMA per input
                          (fp32 where a scale is no fp16 number; GGUF's Q8_0 stores d in fp16)

    y[v] = sum_b scales[b, v] * sum_i x[32 b + i] * values[b, i, v]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from kvsplice.layers.compiled_call import INDUCTOR_OPTIONS, GraphRefused, call_compiled
from kvsplice.utils.thread_policy import intra_op_threads

_log = logging.getLogger(__name__)
BLOCK = 32          # inputs per scale, as GGUF's Q8_0
_INT8_MAX = 127
_PROBE_ROWS = 64    # rows checked first, so that a weight that is not int8 blocks is rejected fast


@dataclass(frozen=True)
class Int8Blocks:
    """A `[V, K]` weight as int8 `values [K/32, 32, V]` and fp16 (or fp32) `scales [K/32, V]`
    (layout in the module docstring): w[v, 32 b + i] = scales[b, v] * values[b, i, v] exactly."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.values.shape[0] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The fp32 `[V, K]` weight these blocks hold."""
        weight = self.values.float() * self.scales.unsqueeze(1)   # [K/32, 32, V]
        return weight.reshape(self.in_features, -1).t().contiguous()


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
    # loop is memory-bound, and multiplying by an fp16 scale widens it to fp32 exactly
    halves = scales.half()
    if torch.equal(halves.float(), scales):
        scales = halves
    return Int8Blocks(values.permute(1, 2, 0).contiguous(), scales.t().contiguous())


def block_int8_product(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 `[1, V]` = x `[K]` (one row) times the blocks: the reference, and the function compiled."""
    blocks, block, _ = values.shape
    per_block = (values.float() * x.float().reshape(blocks, block, 1)).sum(1)   # [K/32, V]
    return (per_block * scales).sum(0, keepdim=True)


class BlockInt8Head:
    """One row's logits from `blocks`. Construction compiles the loop for one row of `dtype` made
    in inference mode, as the engine's steps make theirs, at each of `thread_counts` (torch's
    intra-op counts it will run at; default: the present one), blocking for seconds. `covers(x)`
    says whether `x` is such a row; `__call__(x)` gives its fp32 logits `[1, V]`, or None when the
    compiled loop's guards refuse it (counted in `fallbacks`; nothing ran): the caller then uses
    its own head."""

    def __init__(self, blocks: Int8Blocks, dtype: torch.dtype, thread_counts: tuple[int, ...] = ()):
        self.blocks, self.dtype = blocks, dtype
        self.fallbacks = 0
        self._compiled = torch.compile(block_int8_product, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
        for count in thread_counts or (torch.get_num_threads(),):   # the count is guarded: one loop each
            with intra_op_threads(count), torch.inference_mode():
                self._compiled(torch.zeros(blocks.in_features, dtype=dtype), blocks.values, blocks.scales)

    def covers(self, x: torch.Tensor) -> bool:
        """True for one row `[1, K]` of `dtype` whose inputs are adjacent (any row stride: the loop
        takes the row as a vector)."""
        return x.shape == (1, self.blocks.in_features) and x.dtype == self.dtype and x.stride(1) == 1

    def __call__(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        try:
            return call_compiled(self._compiled, x[0], self.blocks.values, self.blocks.scales)
        except GraphRefused as refused:
            if not self.fallbacks:
                _log.warning("row head: a call the compiled loop does not cover uses the dense head "
                             "(counted in fallbacks): %s", refused)
            self.fallbacks += 1
            return None

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same product of a row `[1, K]`, eager (for tests)."""
        return block_int8_product(x[0], self.blocks.values, self.blocks.scales)
