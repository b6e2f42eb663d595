"""Moving one span's stored keys to new positions, layer by layer in the KV pool's own layout: the
fast path of `kvsplice.layers.rotary.move_keys` (the reference), equal to it bit for bit.

A relocated span is `length` consecutive positions src_start.. moved to dst_start.. (one delta),
in every layer. The reference turns `[n, layers * heads, head_dim]` keys with cos/sin tables of
`[n, rotary_dim]` (both halves the same numbers), `rotate_half` and `cat` temporaries, after a
permute that copies every key. Here:

    tables   once per span and distinct RoPE, half width `[n, 1, rotary_dim/2]`: the same
             numbers as the reference's (cos/sin of the same fp32 angles), broadcast over heads
    keys     one layer at a time `[n, heads, head_dim]` (a layer's keys stay in cache), the two
             halves x1 = k[..., :h], x2 = k[..., h:rotary_dim] as views; no rotate_half, no cat

and every element goes through the reference's own fp32 operations in the same order, so the
result is the reference's bit for bit (tests/layers/test_rotary_move.py):

    float32 keys (one turn by the delta; one cos/sin row for the whole span):
        x1' = x1 cos(d) - x2 sin(d)           x2' = x2 cos(d) + x1 sin(d)
    bfloat16 / float16 keys (move_keys' exact recovery: back to the projection's grid, one
    rounding there, then the destination's own tables and one rounding, as a forward at dst):
        p1 = round((x1 cos(s) + x2 sin(s)) / a)      p2 = round((x2 cos(s) - x1 sin(s)) / a)
        x1' = round(p1 a cos(t) - p2 a sin(t))     x2' = round(p2 a cos(t) + p1 a sin(t))

with s, t, d = src, dst, dst - src angles and a the attention scaling (YaRN's; 1 otherwise). Dims
past rotary_dim (partial rotary) are not touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvsplice.layers.rotary import LayerRotaries, Rotary


@dataclass(frozen=True)
class SpanTurn:
    """The tables that move one span's keys under one RoPE (see the module docstring).

    Low-precision keys: `cos_a`/`sin_a` the source's unscaled tables, `cos_b`/`sin_b` the
    destination's with the attention scaling in, each `[n, 1, rotary_dim/2]` fp32. fp32 keys:
    `cos_a`/`sin_a` the delta's tables `[1, 1, rotary_dim/2]`, `cos_b`/`sin_b` None."""

    rotary_dim: int
    attention_scaling: float
    cos_a: torch.Tensor
    sin_a: torch.Tensor
    cos_b: torch.Tensor | None = None
    sin_b: torch.Tensor | None = None


def _half_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[n, 1, rotary_dim/2]` of positions * inv_freq: `rotary.rope_cos_sin`'s numbers
    (the same fp32 angles, the same products with the scaling), one half only."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(device=positions.device, dtype=torch.float32)
    cos, sin = angles.cos(), angles.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos[:, None, :], sin[:, None, :]


def spans_turn(rotary: Rotary, spans: Sequence[tuple[int, int, int]], dtype: torch.dtype,
               device: torch.device | str = "cpu") -> SpanTurn:
    """The tables that move several spans, `(src_start, dst_start, length)` each, whose keys lie end
    to end in that order: each span's rows are the numbers it would get alone, so turning them
    together equals turning each span alone, bit for bit. fp32: one turn by the delta (attention
    scaling not applied again), one row for a single span, else each span's row repeated over its keys."""
    lengths = torch.tensor([length for _, _, length in spans], dtype=torch.int64, device=device)
    deltas = torch.tensor([dst - src for src, dst, _ in spans], dtype=torch.int64, device=device)
    if dtype == torch.float32:
        rows = deltas if len(spans) == 1 else torch.repeat_interleave(deltas, lengths)
        return SpanTurn(rotary.rotary_dim, 1.0, *_half_tables(rows, rotary.inv_freq, 1.0))
    src = torch.cat([torch.arange(start, start + length, dtype=torch.int64, device=device)
                     for start, _, length in spans])
    cos_a, sin_a = _half_tables(src, rotary.inv_freq, 1.0)
    cos_b, sin_b = _half_tables(src + torch.repeat_interleave(deltas, lengths), rotary.inv_freq,
                                rotary.attention_scaling)
    return SpanTurn(rotary.rotary_dim, rotary.attention_scaling, cos_a, sin_a, cos_b, sin_b)


def span_turn(rotary: Rotary, src_start: int, dst_start: int, length: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> SpanTurn:
    """The tables that move `length` keys of `dtype` from positions src_start.. to dst_start..."""
    return spans_turn(rotary, [(src_start, dst_start, length)], dtype, device)


def turn_layer_keys_(keys: torch.Tensor, turn: SpanTurn) -> torch.Tensor:
    """Move one layer's keys `[n, heads, head_dim]` in place by `turn`; returns `keys`.
    Side effect: overwrites keys[..., :rotary_dim].

    Each half is converted to fp32 once and every product written into one of three buffers
    (`out=`): mixed bf16 x fp32 operations and fresh temporaries cost more than the arithmetic."""
    half = turn.rotary_dim // 2
    x1, x2 = keys[..., :half], keys[..., half:turn.rotary_dim]
    f1, f2 = x1.float(), x2.float()
    first, second, product = f1 * turn.cos_a, f2 * turn.cos_a, torch.empty_like(f1)
    if turn.cos_b is None:   # fp32: the delta's turn, x1 c - x2 s and x2 c + x1 s
        first.sub_(torch.mul(f2, turn.sin_a, out=product))
        second.add_(torch.mul(f1, turn.sin_a, out=product))
    else:                    # unrotate: x1 c + x2 s and x2 c - x1 s, then / scaling
        first.add_(torch.mul(f2, turn.sin_a, out=product))
        second.sub_(torch.mul(f1, turn.sin_a, out=product))
        if turn.attention_scaling != 1.0:
            first.div_(turn.attention_scaling)
            second.div_(turn.attention_scaling)
        raw1, raw2 = first.to(keys.dtype).float(), second.to(keys.dtype).float()   # the projection's grid
        torch.mul(raw1, turn.cos_b, out=first).sub_(torch.mul(raw2, turn.sin_b, out=product))
        torch.mul(raw2, turn.cos_b, out=second).add_(torch.mul(raw1, turn.sin_b, out=product))
    x1.copy_(first)          # low precision: the forward's one rounding at dst
    x2.copy_(second)
    return keys


def pool_layer_rotaries(rotary: Rotary | LayerRotaries, num_layers: int) -> tuple[Rotary, ...]:
    """The RoPE of each KV-pool layer: a LayerRotaries' kv_layers, or one Rotary for all."""
    if isinstance(rotary, LayerRotaries):
        if len(rotary.kv_layers) != num_layers:
            raise ValueError(f"{len(rotary.kv_layers)} RoPE layers for a pool of {num_layers}")
        return rotary.kv_layers
    return (rotary,) * num_layers
