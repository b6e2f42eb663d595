"""Relocate: copy a span's K/V to new slots and turn its keys to the new positions.

The only tensor code of the reuse package. For one kept span (see `plan.Keep`):

    old sequence   ... [ src_pos ........ src_pos+length ) ...      K rotated at src positions
                              | copy every layer's K and V
                              v
    new sequence   ........ [ dst_pos ........ dst_pos+length ) ... K turned to dst positions

Keys are stored after RoPE, and rotations in the same planes compose
(R(src + delta) = R(delta) R(src), RoFormer, Su et al. 2021, eq. 13-16), so turning a stored key
gives the key a fresh forward at dst would have stored - for the token's own projection. In fp32
that is one turn by delta. In bf16 / fp16 the stored key is already rounded, and a turn by delta
would round it a second time; `kvsplice.layers.rotary.move_keys` turns it back to the projection's
grid first and rounds once at dst, as the forward does. What relocation cannot fix is that the K/V
were computed while attending to the old context: that is SCR's approximation, bounded by
recomputing each span's tail. V is position-free and is copied as is.

`relocate` (one span) and `relocate_spans` (all of an edit's spans in one pass per layer) work one
layer at a time with `kvsplice.layers.rotary_move` (the fast path);
`relocate_reference` is the same copy through `move_keys` on every layer at once, kept as the
reference it is tested against bit for bit (tests/reuse/test_relocate_precision.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.layers.rotary import LayerRotaries, Rotary
from kvsplice.layers.fused_turn import FusedTurn, KeyTurner
from kvsplice.layers.rotary_move import SpanTurn, pool_layer_rotaries, spans_turn, turn_layer_keys_
from kvsplice.reuse.plan import Keep


def relocate(pool: KVPool, src_slots: torch.Tensor, dst_slots: torch.Tensor, keep: Keep,
             rotary: Rotary | LayerRotaries | None, turner: KeyTurner = turn_layer_keys_) -> None:
    """Copy K/V of `src_slots` (the old sequence's positions keep.src_pos ...) into `dst_slots`
    (positions keep.dst_pos ...) in every layer, keys turned to the new positions (skipped when
    `rotary` is None: the NO_REROTATE control, ReuseConfig.no_rerotate, set only in code).
    `relocate_spans` of this one span; bit for bit `relocate_reference`. Side effect: writes
    pool.k / pool.v at dst_slots. src and dst must not overlap."""
    relocate_spans(pool, [(src_slots, dst_slots, keep)], rotary, turner)


def relocate_spans(pool: KVPool, spans: Sequence[tuple[torch.Tensor, torch.Tensor, Keep]],
                   rotary: Rotary | LayerRotaries | None, turner: KeyTurner = turn_layer_keys_) -> None:
    """Every span of `spans` ((src_slots, dst_slots, keep) each) relocated as `relocate` moves one,
    the turned ones together and the unturned ones (delta 0, or no rotary) together:

        spans     [ a: src -> dst, delta 12 ][ b: delta 0 ][ c: delta 40 ]
        turned    a + c end to end: one gather, one turn (each key with its own span's tables,
                  `rotary_move.spans_turn`), one scatter per layer
        copied    b: one gather and one scatter per layer

    one layer at a time, so an edit that leaves many spans (stripped reasoning blocks) costs a few
    ops per layer instead of a few per span and layer. Bit for bit `relocate` of each span in turn.
    `turner` turns one layer's keys in place: `turn_layer_keys_` (eager) or a
    `kvsplice.layers.fused_turn.FusedTurn` (compiled, the same bits). Side effect: writes pool.k /
    pool.v at every dst_slots. No source may overlap a destination."""
    for src_slots, dst_slots, keep in spans:
        _check_lengths(src_slots, dst_slots, keep)
    turned = [rotary is not None and keep.delta != 0 for _, _, keep in spans]
    moved = [span for span, turn in zip(spans, turned) if turn]
    copied = [span for span, turn in zip(spans, turned) if not turn]
    for group, turns in ((moved, _spans_turns(pool, [keep for _, _, keep in moved], rotary)), (copied, None)):
        if group:
            _move(pool, torch.cat([src for src, _, _ in group]), torch.cat([dst for _, dst, _ in group]), turns, turner)


def _move(pool: KVPool, src_slots: torch.Tensor, dst_slots: torch.Tensor, turns: list[SpanTurn] | None,
          turner: KeyTurner) -> None:
    """Every layer's K/V of `src_slots` into `dst_slots`, keys turned by that layer's SpanTurn (rows
    in slot order) when `turns` is given."""
    src, dst = _as_run(src_slots), _as_run(dst_slots)
    # pool.k's own layers (a windowed pool's k holds only its full layers; its k_layer() is indexed
    # by model layer and would hand back sliding layers' window storage)
    for layer, (k_layer, v_layer) in enumerate(zip(pool.k, pool.v)):
        if turns is not None and isinstance(turner, FusedTurn):   # reads the source, writes a new tensor
            keys = turner.turned(_read(k_layer, src), turns[layer])
        else:
            keys = _gather(k_layer, src)                               # [n, kv_heads, head_dim], a copy
            if turns is not None:
                turner(keys, turns[layer])
        _scatter(k_layer, dst, keys)
        # src and dst never overlap, so a slice is copied straight across (index_copy_ refuses a
        # source that shares the destination's storage: a gathered copy there)
        _scatter(v_layer, dst, _read(v_layer, src) if isinstance(dst, slice) else _gather(v_layer, src))


def _as_run(slots: torch.Tensor) -> slice | torch.Tensor:
    """`slots` as a slice when they are consecutive ascending slot numbers (a fresh allocation
    usually is: slices copy several times faster than index_select / index_copy_), else as given."""
    if not slots.numel():
        return slots
    first, last = int(slots[0]), int(slots[-1])
    if last - first + 1 == slots.numel() and bool(torch.all(slots[1:] - slots[:-1] == 1)):
        return slice(first, last + 1)
    return slots


def _read(layer: torch.Tensor, slots: slice | torch.Tensor) -> torch.Tensor:
    """The rows `slots` of `layer`: a view for a slice (not to be written), else a copy."""
    return layer[slots] if isinstance(slots, slice) else layer.index_select(0, slots)


def _gather(layer: torch.Tensor, slots: slice | torch.Tensor) -> torch.Tensor:
    return layer[slots].clone() if isinstance(slots, slice) else layer.index_select(0, slots)


def _scatter(layer: torch.Tensor, slots: slice | torch.Tensor, values: torch.Tensor) -> None:
    if isinstance(slots, slice):
        layer[slots].copy_(values)
    else:
        layer.index_copy_(0, slots, values)


def _spans_turns(pool: KVPool, keeps: Sequence[Keep], rotary: Rotary | LayerRotaries | None) -> list[SpanTurn] | None:
    """Each pool layer's SpanTurn for `keeps` end to end (one per distinct RoPE, shared), or None:
    nothing to turn."""
    if rotary is None or not keeps:
        return None
    spans = [(keep.src_pos, keep.dst_pos, keep.length) for keep in keeps]
    by_rotary: dict[int, SpanTurn] = {}
    turns = []
    for layer_rotary in pool_layer_rotaries(rotary, pool.k.shape[0]):
        if id(layer_rotary) not in by_rotary:
            by_rotary[id(layer_rotary)] = spans_turn(layer_rotary, spans, pool.k.dtype, pool.k.device)
        turns.append(by_rotary[id(layer_rotary)])
    return turns


def _check_lengths(src_slots: torch.Tensor, dst_slots: torch.Tensor, keep: Keep) -> None:
    if not src_slots.numel() == dst_slots.numel() == keep.length:
        raise ValueError(f"{src_slots.numel()} source slots and {dst_slots.numel()} destinations "
                         f"for a span of {keep.length}")


def relocate_reference(pool: KVPool, src_slots: torch.Tensor, dst_slots: torch.Tensor, keep: Keep,
                       rotary: Rotary | LayerRotaries | None) -> None:
    """`relocate` through `Rotary.move_keys` on all layers side by side (the reference path: plain
    RoPE formulas, full-width tables, one `[n, layers * heads, head_dim]` call). Same contract."""
    _check_lengths(src_slots, dst_slots, keep)
    keys = pool.k[:, src_slots]                                   # [layers, n, kv_heads, head_dim]
    if rotary is not None and keep.delta != 0:
        layers, n, heads, dim = keys.shape
        # one [n, layers*heads, dim] call: cos/sin are computed once per token
        flat = keys.permute(1, 0, 2, 3).reshape(n, layers * heads, dim)
        src_pos = torch.arange(keep.src_pos, keep.src_end, dtype=torch.int64, device=keys.device)
        flat = rotary.move_keys(flat, src_pos, src_pos + keep.delta)
        keys = flat.reshape(n, layers, heads, dim).permute(1, 0, 2, 3)
    pool.k[:, dst_slots] = keys
    pool.v[:, dst_slots] = pool.v[:, src_slots]
