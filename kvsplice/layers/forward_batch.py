"""ForwardBatch: everything the model needs to know about one forward pass, and nothing of policy.

The model does not know about the radix tree, sessions or relocation. It receives, per token,
its id, its RoPE position and the slot its K/V is written to; and per request, the slots that
hold its context and the position of each. A query at position p attends to every context slot
whose position is <= p (a position mask, not an order mask): this is what lets Suffix Cache Reuse
compute B', span tails and appended text in one pass next to relocated K/V.

    flat token rows:   [ req0 q0 q1 q2 | req1 q0 | req2 q0 q1 ]   (input_ids, positions, out_slots)
    req0.context:      slots of everything req0 may attend to, including q0..q2's own out_slots
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SeqSlice:
    """One request's share of a forward pass.

    `query_start`/`query_len` select its rows of the flat token tensors. `context_slots` lists
    every KV slot it attends to (cached, relocated, and the ones written in this very forward),
    `context_pos` the RoPE position of each; both int64 tensors of the same length.
    """

    query_start: int
    query_len: int
    context_slots: torch.Tensor
    context_pos: torch.Tensor


@dataclass(frozen=True)
class Segment:
    """A run of one request's rows (`start`/`end` relative to its `query_start`) that the linear
    layers process as one consecutive stretch of the sequence. Before it, when `load_from` is set,
    the request's working state is replaced by that state slot's (an SCR splice: the tokens in
    between were relocated, not computed); after it, when `save_to` is set, the working state is
    copied into that slot (a checkpoint)."""

    start: int
    end: int
    load_from: Optional[int] = None
    save_to: Optional[int] = None


@dataclass(frozen=True)
class LinearSeq:
    """One request's share of a forward in the linear-attention layers of a hybrid model: its
    working state slot (read at the first segment, updated in place) and its segments, in order,
    covering its rows exactly."""

    state_slot: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class PaddedContexts:
    """Every request's context as one padded block, for batched single-query (decode) attention:
    `slots [B, C]` (padding points at any valid slot and is masked out), `mask [B, 1, 1, C]` (True
    where the entry is real and its position <= the query's)."""

    slots: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class ForwardBatch:
    """A flat batch of tokens from one or more requests (prefill chunks and decode steps mixed).

    `logit_rows` are the flat row offsets whose next-token logits the caller wants (usually the
    last row of each request; every row for prompt logprobs). `linear` is empty for models
    without linear-attention layers.

    `window` (a model with a windowed KV pool, `kvsplice.cache.window_pool`): this batch as the
    sliding-window layers see it, in window slots (`WindowedKVPool.translate`); None otherwise.

    `arena_rows` (fast path only, `kvsplice.models.fast_decode`): rows [0, arena_rows) are
    single-token decode rows whose contexts are rows 0..arena_rows-1 of the DecodeArena, in the
    same order; they have no entry in `seqs`. The reference Decoder never gets such a batch.
    """

    input_ids: torch.Tensor    # [T] int64
    positions: torch.Tensor    # [T] int64, RoPE position of each token
    out_slots: torch.Tensor    # [T] int64, slot where each token's K/V is written
    seqs: tuple[SeqSlice, ...]
    logit_rows: torch.Tensor   # [R] int64
    linear: tuple[LinearSeq, ...] = ()   # hybrid models only: one per entry of `seqs`
    arena_rows: int = 0
    window: Optional["ForwardBatch"] = None

    def for_layer(self, sliding: bool) -> "ForwardBatch":
        """The batch a layer reads: `window` for a sliding layer of a windowed pool, else this one."""
        return self.window if sliding and self.window is not None else self

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @functools.cached_property
    def padded_decode(self) -> Optional[PaddedContexts]:
        """The padded view of a batch whose requests each have exactly one query row, in row order
        (a pure decode step of two or more requests); None otherwise. Built once per forward and
        shared by every layer."""
        if len(self.seqs) < 2 or any(seq.query_len != 1 or seq.query_start != row
                                     for row, seq in enumerate(self.seqs)):
            return None
        width = max(int(seq.context_slots.numel()) for seq in self.seqs)
        slots = torch.zeros(len(self.seqs), width, dtype=torch.int64)
        pos = torch.full((len(self.seqs), width), torch.iinfo(torch.int64).max, dtype=torch.int64)
        for row, seq in enumerate(self.seqs):
            n = int(seq.context_slots.numel())
            slots[row, :n] = seq.context_slots
            pos[row, :n] = seq.context_pos
        mask = pos <= self.positions[: len(self.seqs), None]   # padding sits at an unreachable position
        return PaddedContexts(slots, mask[:, None, None, :])

    @staticmethod
    def single(input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
               context_slots: torch.Tensor, context_pos: torch.Tensor,
               all_logits: bool = False) -> "ForwardBatch":
        """A batch of one request; logits for its last row, or for every row with `all_logits`."""
        n = int(input_ids.numel())
        rows = torch.arange(n) if all_logits else torch.tensor([n - 1])
        seq = SeqSlice(0, n, context_slots, context_pos)
        return ForwardBatch(input_ids, positions, out_slots, (seq,), rows)
