"""Paged, position-masked attention over the token-granular KV pool: the pure-torch reference path.

A query at position p attends to every context slot whose position is <= p (and, for a sliding
window layer of width w, > p - w, as transformers' `sliding_window_overlay`). The mask is built
from positions, never from the order of `context_slots`, so relocated K/V and freshly computed
tokens may be listed in any order.

    pool (one layer):   slot 0   1   2   3   4   5   6 ...
    req.context_slots:  [5, 0, 3, 6]  with context_pos [2, 0, 1, 3]
    query at pos 1  ->  attends to slots 0 (pos 0) and 3 (pos 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn import functional as F

from kvsplice.cache.kv_pool import KVPool
from kvsplice.layers.forward_batch import ForwardBatch, PaddedContexts
from kvsplice.layers.shape_bucket import PADDED_DTYPES, bucket


def store_kv(k: torch.Tensor, v: torch.Tensor, layer_id: int, out_slots: torch.Tensor, pool: KVPool) -> None:
    """Write `k`, `v [T, num_kv_heads, head_dim]` into `pool` layer `layer_id` at `out_slots [T]`
    (cast to the pool's dtype). Side effect: overwrites those slots in place."""
    pool.k_layer(layer_id).index_copy_(0, out_slots, k.to(pool.k.dtype))
    pool.v_layer(layer_id).index_copy_(0, out_slots, v.to(pool.v.dtype))


def position_mask(query_pos: torch.Tensor, context_pos: torch.Tensor,
                  sliding_window: Optional[int] = None) -> torch.Tensor:
    """Boolean `[Q, C]`: True where query q may attend to context entry c."""
    mask = context_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        mask &= context_pos[None, :] > query_pos[:, None] - sliding_window
    return mask


def _is_plain_causal(query_pos: torch.Tensor, context_pos: torch.Tensor) -> bool:
    """True when the position mask is exactly SDPA's `is_causal` (top-left aligned) mask: the
    queries are the whole context, listed in the same, strictly increasing position order (a
    prefill from position 0 or of a fresh span). Then entry j is visible to row i iff j <= i."""
    if query_pos.numel() != context_pos.numel() or not torch.equal(query_pos, context_pos):
        return False
    return query_pos.numel() < 2 or bool((query_pos[1:] > query_pos[:-1]).all())


def paged_attention(q: torch.Tensor, layer_id: int, batch: ForwardBatch, pool: KVPool, scale: float,
                    sliding_window: Optional[int] = None) -> torch.Tensor:
    """Attention of `q [T, Hq, D]` (already rotated) over each request's context in `pool`.

    Contract: the K/V of this forward's tokens are already in the pool (`store_kv` first), and each
    request's `context_slots` include its own query tokens' slots (else a query row may have
    nothing to attend to). Returns `[T, Hq, D]` in q.dtype. Reads the pool only.

    A pure decode step of several requests takes one batched SDPA call over padded contexts
    (`decode_attention`); everything else, and the reference for both, is
    `paged_attention_reference`.
    """
    padded = batch.padded_decode if sliding_window is None else None
    if padded is not None:
        return decode_attention(q, layer_id, padded, pool, scale)
    return paged_attention_reference(q, layer_id, batch, pool, scale, sliding_window)


def decode_attention(q: torch.Tensor, layer_id: int, padded: PaddedContexts, pool: KVPool,
                     scale: float) -> torch.Tensor:
    """One query per request, all requests in one SDPA call: `q [B, Hq, D]` against the padded
    contexts `[B, C]` (masked by position and padding). Same result as the reference path."""
    flat, shape = padded.slots.flatten(), (*padded.slots.shape, *pool.k.shape[2:])
    k = pool.k_layer(layer_id).index_select(0, flat).view(shape).to(q.dtype)   # [B, C, Hkv, D]
    v = pool.v_layer(layer_id).index_select(0, flat).view(shape).to(q.dtype)
    attended = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=padded.mask, scale=scale, enable_gqa=True)
    return attended[:, :, 0, :]


def length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """`[B, 1, 1, width]` bool: entry c of request b is visible iff c < lengths[b]."""
    return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


def contiguous_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """One query per request over contiguous contexts (a `DecodeArena` view): `q [B, Hq, D]`,
    `k`, `v [B, Hkv, C, D]` in q.dtype holding positions 0..C-1 in order; `mask` is
    `length_mask(lengths, C)`, or None when every request's length is C. Each request's own
    token is the last of its positions, so the position mask is the length mask.
    Returns `[B, Hq, D]`."""
    attended = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return attended[:, :, 0, :]


def paged_attention_reference(q: torch.Tensor, layer_id: int, batch: ForwardBatch, pool: KVPool, scale: float,
                    sliding_window: Optional[int] = None,
                    plans: Optional[Sequence["SequencePlan"]] = None) -> torch.Tensor:
    """The readable path: each request on its own, gather its context slots, position mask, SDPA.

    Contract: the K/V of this forward's tokens are already in the pool (`store_kv` first), and each
    request's `context_slots` include its own query tokens' slots (else a query row may have
    nothing to attend to). Returns `[T, Hq, D]` in q.dtype. Reads the pool only. `plans`: each
    request's `plan_sequences` (the same in every layer; made here when not given).
    """
    out = torch.empty_like(q)
    k_layer, v_layer = pool.k_layer(layer_id), pool.v_layer(layer_id)
    if plans is None:
        plans = plan_sequences(batch, k_layer.shape[0], q.dtype, sliding_window, group=q.shape[1] // k_layer.shape[1])
    for seq, plan in zip(batch.seqs, plans):
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        out[rows] = planned_attention(q[rows], plan, k_layer, v_layer, scale)
    return out


@dataclass(frozen=True)
class SequencePlan:
    """What one request's attention needs besides q and the layer's pool tensors, the same in
    every layer (so a caller may make it once per forward):

        queries:  [ q_0 ... q_{Q-1} | pad_q zero rows ], with `fold` q heads of each kv head
                  stacked as rows of one head (1: SDPA's enable_gqa pairs the heads)
        keys:     slots `run_start .. run_start + C' - 1` of the pool (a view, when the context is
                  one ascending run of slots), else the gathered `slots`
        mask:     additive [fold * (Q + pad_q), C'] in the compute dtype (0 / -inf), or None with
                  `causal`
    """

    pad_q: int
    run_start: Optional[int]
    slots: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    causal: bool
    fold: int = 1


# Query rows (after padding) up to which a masked attention stacks the q heads of each kv head as
# rows of one head (the same bits): in bf16 CPU flash attention's cost is mostly per pass over the
# keys, and stacking makes one pass per kv head instead of one per q head; measured faster up to
# this many rows, and no faster in fp32 (figures in docs/BENCHMARKS_HISTORY.md, "Figures formerly
# quoted in code").
FOLD_MAX_QUERY_ROWS = 32


def plan_sequences(batch: ForwardBatch, num_slots: int, dtype: torch.dtype, sliding_window: Optional[int] = None,
                   group: int = 1) -> tuple[SequencePlan, ...]:
    """`plan_sequence` of every request of `batch` over a layer of `num_slots` rows; `group`: q heads
    per kv head."""
    return tuple(plan_sequence(batch.positions[seq.query_start:seq.query_start + seq.query_len], seq.context_slots,
                               seq.context_pos, num_slots, dtype, sliding_window, group) for seq in batch.seqs)


def plan_sequence(query_pos: torch.Tensor, context_slots: torch.Tensor, context_pos: torch.Tensor, num_slots: int,
                  dtype: torch.dtype, sliding_window: Optional[int] = None, group: int = 1) -> SequencePlan:
    """The SequencePlan of queries at `query_pos` over the pool entries `context_slots` at
    `context_pos`, computed in `dtype`. In bf16 / fp16, Q and C are padded to `bucket` sizes (see
    kvsplice.layers.shape_bucket); the padding is invisible to the real rows:

        keys:     [ c_0 ... c_{C-1} | padding ]   masked out for every real row (padding: the pool's
                                                  next slots after a run, else copies of c_0)
        queries:  [ q_0 ... q_{Q-1} | zeros ]     see every real key, sliced off after

    With the plain causal mask Q == C pads to the same size, and a real row i sees only j <= i.
    Why: every bf16 attention shape keeps kernel code for good, and random prefill shapes grew a
    process by hundreds of MiB unbucketed (docs/BENCHMARKS_HISTORY.md, "Soak: hostile and ordinary
    traffic against one server"). A context that is one ascending run of slots (a fresh prefill, as
    the allocator hands slots out) is read as a view instead of gathered: at long contexts the
    gathers were a measurable share of a mixed step. The padding slots are
    other requests' entries or zeros; masked out, they weigh exactly 0.
    """
    query_len, context_len = query_pos.numel(), context_slots.numel()
    causal = sliding_window is None and _is_plain_causal(query_pos, context_pos)
    mask = None if causal else position_mask(query_pos, context_pos, sliding_window)
    pad_q = pad_c = 0
    if dtype in PADDED_DTYPES:
        pad_q, pad_c = bucket(query_len) - query_len, bucket(context_len) - context_len
        if mask is not None:
            mask = F.pad(F.pad(mask, (0, pad_c), value=False), (0, 0, 0, pad_q), value=True)
            mask[query_len:, context_len:] = False
    run_start = _slot_run(context_slots, context_len + pad_c, num_slots)
    slots = None
    if run_start is None:
        slots = F.pad(context_slots, (0, pad_c), value=int(context_slots[0])) if pad_c else context_slots
    fold = 1
    if mask is not None:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        if group > 1 and query_len + pad_q <= FOLD_MAX_QUERY_ROWS:
            fold, mask = group, mask.repeat(group, 1)
    return SequencePlan(pad_q, run_start, slots, mask, causal, fold)


def _slot_run(context_slots: torch.Tensor, width: int, num_slots: int) -> Optional[int]:
    """The first slot when `context_slots` are `first, first + 1, ...` and `width` slots from it lie
    in the pool; else None."""
    first = int(context_slots[0])
    if first + width > num_slots:
        return None
    if context_slots.numel() > 1 and not bool((context_slots[1:] - context_slots[:-1] == 1).all()):
        return None
    return first


def planned_attention(q: torch.Tensor, plan: SequencePlan, k_layer: torch.Tensor, v_layer: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One request's attention: `q [Q, Hq, D]` over its context as `plan` says; `[Q, Hq, D]`."""
    query_len = q.shape[0]
    if plan.pad_q:
        q = F.pad(q, (0, 0, 0, 0, 0, plan.pad_q))
    if plan.run_start is not None:
        width = plan.mask.shape[1] if plan.mask is not None else q.shape[0]   # (causal: Q' == C')
        k = k_layer[plan.run_start:plan.run_start + width].to(q.dtype)   # [C', Hkv, D] (a view)
        v = v_layer[plan.run_start:plan.run_start + width].to(q.dtype)
    else:
        # index_select copies whole rows; indexing with a tensor (k_layer[slots]) goes element by
        # element and is several times slower (docs/BENCHMARKS_HISTORY.md, "Gathering K/V with index_select")
        k = k_layer.index_select(0, plan.slots).to(q.dtype)
        v = v_layer.index_select(0, plan.slots).to(q.dtype)
    # SDPA wants [batch, heads, rows, dim]: 4-D inputs let torch pick its fused CPU kernel
    # (3-D ones fall back to the slower unfused math path); the mask broadcasts over heads.
    # enable_gqa expands the kv heads inside SDPA, q head h reading kv head h // (Hq / Hkv)
    # exactly as transformers' repeat_kv, without copying K/V once per q head. Folded, q heads
    # kv * fold .. kv * fold + fold - 1 become rows of head kv (the mask repeats per folded head).
    heads, rows, dim = q.shape[1], q.shape[0], q.shape[2]
    queries = q.transpose(0, 1)
    if plan.fold > 1:
        queries = queries.reshape(heads // plan.fold, plan.fold * rows, dim)
    attended = F.scaled_dot_product_attention(
        queries[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=None if plan.mask is None else plan.mask[None, None], is_causal=plan.causal, scale=scale,
        enable_gqa=True)[0]
    if plan.fold > 1:
        attended = attended.reshape(heads, rows, dim)
    return attended.transpose(0, 1)[:query_len]
