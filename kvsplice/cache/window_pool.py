"""WindowedKVPool: the KV pool of a model with sliding-window layers (Gemma 3: 5 sliding layers of
window W = 512 for every full one). Full layers keep K/V for every token of a live request; sliding
layers only for the tokens some query still to be computed can see (its last W positions), so a
32K-token request holds sliding K/V for a few windows instead of 32K tokens.

Two slot spaces (as SGLang's SWAKVPool, `mem_cache/swa_memory_pool.py`):

    full slots   (SlotAllocator, N)    k, v          [full layers,    N, kv_heads, head_dim]
    window slots (SlotAllocator, M)    window_k, _v  [sliding layers, M, kv_heads, head_dim]
    window_of[full slot] -> window slot, valid where has_window[full slot]

Every owner (requests, the radix tree, SCR sessions) holds full slots only; a full slot carries at
most one window slot, taken by `ensure_window` just before a forward writes the token and given
back by `drop_window` (its token left every window still to be computed) or when the full slot is
freed (the full allocator's release hook). So ownership, refcounts, eviction and flushes stay those
of the full slots; the window slots follow them.

`k` / `v` are the full layers only: what SCR relocation (`kvsplice.reuse.relocate`, with a RoPE of
the full layers, `full_rotary`) and every other all-layer reader sees. `k_layer(i)` / `v_layer(i)`
give layer i's tensor in its own slot space; a forward writes and reads sliding layers through
`translate(batch)`, the same batch in window slots.

Which tokens need their window (`WindowKeep`, the CacheManager trims by it):

    offsets   0 ......... b-W [ b: checkpoint ) ......... c-W [ computed_len = c ) ... pending
    window    spare       |kept |  spare                      |kept (the next query's window)|
    finished  spare ..... |kept at checkpoints b| ........ |kept: the last tail_keep of the sequence|

A spare window (`mark_spare`) is one no query still to be computed reads: it stays as a cache while
window slots are free (SCR relocates it instead of computing its token again, a prefix hit reads
it) and is given back, the longest-spare first, when a chunk finds no free window slot
(`drop_spare`, never a window a running request still reads). So a request needs only its windows
(the memory of a 32K-token request), while the spare room keeps edited transcripts cheap to reuse.

A prefix is usable only up to a length m whose preceding W - 1 tokens all have their window
(`usable_prefix`): a query at position m attends to (m - W, m] on sliding layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvsplice.cache.kv_pool import SlotAllocator


@dataclass(frozen=True)
class WindowKeep:
    """Which of a request's tokens keep their sliding-layer K/V once computed. `window`: W.
    `tail_keep`: tokens kept at the end of a finished sequence (2 W: the next turn of a chat
    re-renders the reply and diverges a few tokens before the end, and a cut point d is usable when
    the W - 1 tokens before it are kept, so any d in [end - W - 1, end] stays usable).
    `checkpoint_spacing`: message-boundary checkpoints (`CheckpointPolicy.lengths`) kept at least
    this many tokens apart, so that a transcript of many short messages does not keep every window."""

    window: int
    tail_keep: int
    checkpoint_spacing: int = 4096

    def checkpoints(self, lengths: Sequence[int]) -> tuple[int, ...]:
        """The boundaries of `lengths` (ascending) whose windows are kept: the first, then each at
        least `checkpoint_spacing` after the last kept one."""
        kept: list[int] = []
        for length in lengths:
            if length > 0 and (not kept or length - kept[-1] >= self.checkpoint_spacing):
                kept.append(length)
        return tuple(kept)

    def protected(self, checkpoints: Sequence[int]) -> list[range]:
        """The offset ranges [b - W, b) kept for the checkpoints `b`."""
        return [range(max(0, b - self.window), b) for b in checkpoints]


def usable_prefix(has_window: torch.Tensor, window: int) -> int:
    """The longest m <= len(has_window) such that a query at position m finds the sliding K/V it
    needs: every token in [m - W + 1, m) has its window (`has_window [n]` bool, per prefix token).

        has_window   1 1 1 0 0 0 0 1 1 1 1        W = 3: m = 11 (tokens 9, 10 held)
        m = 3: tokens 1, 2 held  ->  usable; m = 5: token 3 missing -> not
    """
    n = int(has_window.numel())
    need = window - 1
    if n == 0 or need <= 0:
        return n
    missing = torch.cumsum((~has_window).to(torch.int64), 0)
    missing = torch.cat([torch.zeros(1, dtype=torch.int64), missing])   # missing[m]: holes in [0, m)
    lengths = torch.arange(n + 1)
    lo = (lengths - need).clamp(min=0)
    ok = (missing[lengths] - missing[lo]) == 0
    return int(torch.nonzero(ok).max())


class WindowedKVPool:
    """Full layers per full slot, sliding layers per window slot (see the module docstring).

    `layer_windows`: per KV layer, its window (None: full attention); at least one of each kind.
    `window_slots`: M, the window slot space (enough for the running requests' windows and chunks,
    plus what the radix tree keeps at checkpoints; `CacheManager.ensure_window` evicts for room).
    """

    def __init__(self, num_slots: int, layer_windows: Sequence[Optional[int]], num_kv_heads: int, head_dim: int,
                 window_slots: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        windows = {w for w in layer_windows if w is not None}
        if len(windows) != 1 or all(w is not None for w in layer_windows):
            raise ValueError(f"a windowed pool needs one window width and some full layers, got {layer_windows}")
        self.window = windows.pop()
        self.full_layers = tuple(i for i, w in enumerate(layer_windows) if w is None)
        self.sliding_layers = tuple(i for i, w in enumerate(layer_windows) if w is not None)
        self.allocator = SlotAllocator(num_slots, on_release=self._release_windows)
        self.window_allocator = SlotAllocator(window_slots)
        self.k = torch.zeros(len(self.full_layers), num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.window_k = torch.zeros(len(self.sliding_layers), window_slots, num_kv_heads, head_dim,
                                    dtype=dtype, device=device)
        self.window_v = torch.zeros_like(self.window_k)
        self.window_of = torch.zeros(num_slots, dtype=torch.int64)
        self.has_window = torch.zeros(num_slots, dtype=torch.bool)
        # when a kept window became spare (`mark_spare`), by a counter; -1: not spare
        self.spare_since = torch.full((num_slots,), -1, dtype=torch.int64)
        self._spare_count = 0
        full_k, full_v = self.k.unbind(0), self.v.unbind(0)
        win_k, win_v = self.window_k.unbind(0), self.window_v.unbind(0)
        self._k_layers = [None] * len(layer_windows)
        self._v_layers = [None] * len(layer_windows)
        for index, layer in enumerate(self.full_layers):
            self._k_layers[layer], self._v_layers[layer] = full_k[index], full_v[index]
        for index, layer in enumerate(self.sliding_layers):
            self._k_layers[layer], self._v_layers[layer] = win_k[index], win_v[index]

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    @property
    def window_slots(self) -> int:
        return self.window_allocator.num_slots

    def is_sliding(self, layer_id: int) -> bool:
        return layer_id in self.sliding_layers

    def k_layer(self, layer_id: int) -> torch.Tensor:
        """Layer `layer_id`'s K, indexed by full slots (full layers) or window slots (sliding)."""
        return self._k_layers[layer_id]

    def v_layer(self, layer_id: int) -> torch.Tensor:
        return self._v_layers[layer_id]

    # ----- window slots ------------------------------------------------------------------
    def ensure_window(self, slots: torch.Tensor) -> bool:
        """Give every full slot of `slots` that has none a window slot; False (nothing taken) when
        the window space is short."""
        lacking = slots[~self.has_window[slots]].unique()
        if lacking.numel() == 0:
            return True
        taken = self.window_allocator.alloc(int(lacking.numel()))
        if taken is None:
            return False
        self.window_of[lacking] = taken
        self.has_window[lacking] = True
        return True

    def drop_window(self, slots: torch.Tensor) -> int:
        """Give back the window slots of those of `slots` that have one (their tokens left every
        window still to be read); the full slots stay. Returns how many were freed."""
        held = slots[self.has_window[slots]].unique()
        if held.numel():
            self.window_allocator.free(self.window_of[held])
            self.has_window[held] = False
            self.spare_since[held] = -1
        return int(held.numel())

    def mark_spare(self, slots: torch.Tensor) -> int:
        """Keep the windows of those of `slots` that have one although no query still to be computed
        reads them: a cache (SCR relocates them, a later prefix hit reads them), given back by
        `drop_spare` when window slots run short. Returns how many became spare."""
        fresh = slots[self.has_window[slots] & (self.spare_since[slots] < 0)].unique()
        self._spare_count += 1
        self.spare_since[fresh] = self._spare_count
        return int(fresh.numel())

    def drop_spare(self, count: int, keep: torch.Tensor) -> int:
        """Give back up to `count` spare windows, those marked spare longest ago first, except the
        full slots `keep` marks (`[num_slots]` bool: windows a running request still reads).
        Returns how many were freed."""
        spare = (self.spare_since >= 0) & ~keep
        candidates = torch.nonzero(spare).flatten()
        if count <= 0 or candidates.numel() == 0:
            return 0
        oldest = candidates[torch.argsort(self.spare_since[candidates], stable=True)[:count]]
        return self.drop_window(oldest)

    def spare_windows(self) -> int:
        """How many window slots hold spare windows (`mark_spare`)."""
        return int((self.spare_since >= 0).sum())

    def _release_windows(self, released: torch.Tensor) -> None:
        """The full allocator's hook: slots back on the free list lose their window too."""
        self.drop_window(released)

    # ----- forward ------------------------------------------------------------------------
    def translate(self, batch):
        """`batch` (a ForwardBatch in full slots) as the sliding layers read it: out_slots in window
        slots, and each request's context cut to the entries that have a window. Raises
        RuntimeError when a query's window needs an entry without one (a trimming bug: never a
        silently wrong attention)."""
        if not bool(self.has_window[batch.out_slots].all()):
            raise RuntimeError("a token computed in this forward has no window slot (ensure_window first)")
        seqs = []
        for seq in batch.seqs:
            held = self.has_window[seq.context_slots]
            query_pos = batch.positions[seq.query_start:seq.query_start + seq.query_len]
            self._check_windows(query_pos, seq.context_pos[~held])
            seqs.append(dataclasses.replace(seq, context_slots=self.window_of[seq.context_slots[held]],
                                            context_pos=seq.context_pos[held]))
        return dataclasses.replace(batch, out_slots=self.window_of[batch.out_slots], seqs=tuple(seqs))

    def _check_windows(self, query_pos: torch.Tensor, missing_pos: torch.Tensor) -> None:
        """Raise unless no position of `missing_pos` lies in some query's window (q - W, q]."""
        if missing_pos.numel() == 0:
            return
        queries = query_pos.sort().values
        at = torch.searchsorted(queries, missing_pos)
        inside = at < queries.numel()
        if bool(inside.any()):
            nearest = queries[at[inside]]
            if bool((nearest < missing_pos[inside] + self.window).any()):
                raise RuntimeError("a sliding-window query needs K/V that the pool no longer holds")

    def relocate_window(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, src_pos: torch.Tensor,
                        dst_pos: torch.Tensor, rotary) -> None:
        """SCR on the sliding layers: copy the window K/V of full `src_slots` (all carrying one) into
        the window slots of `dst_slots` (all carrying one), keys turned from `src_pos` to `dst_pos`
        by `rotary` (the sliding layers' RoPE, its `move_keys` over `[n, sliding layers * heads,
        head_dim]`; None: not turned, the NO_REROTATE control). Side effect: writes window_k / _v.

            src (old sequence)   full slot s --window_of--> window slot a   K rotated at src_pos
            dst (new sequence)   full slot d --window_of--> window slot b   <- K turned to dst_pos, V
        """
        src, dst = self.window_of[src_slots], self.window_of[dst_slots]
        keys = self.window_k[:, src]                                   # [sliding, n, heads, dim]
        if rotary is not None and src.numel():
            layers, n, heads, dim = keys.shape
            flat = keys.permute(1, 0, 2, 3).reshape(n, layers * heads, dim)
            keys = rotary.move_keys(flat, src_pos, dst_pos).reshape(n, layers, heads, dim).permute(1, 0, 2, 3)
        self.window_k[:, dst] = keys
        self.window_v[:, dst] = self.window_v[:, src]

    def move_window(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, src_pos: torch.Tensor,
                    dst_pos: torch.Tensor, rotary) -> None:
        """`relocate_window` without a copy: each window slot of `src_slots` (all carrying one, read
        by no running request) has its keys turned in place and passes to `dst_slots` (none carrying
        one); the sources lose their windows. So relocating a long transcript needs no second set of
        window slots. Side effect: writes window_k, window_of, has_window, spare_since.

            src   full slot s --window_of--> a  (K at src_pos)     after: s has no window
            dst   full slot d                                      after: d --window_of--> a (K at dst_pos)
        """
        if not bool(self.has_window[src_slots].all()) or bool(self.has_window[dst_slots].any()):
            raise ValueError("move_window: every source needs a window and no destination may have one")
        held = self.window_of[src_slots]
        if rotary is not None and held.numel():
            keys = self.window_k[:, held]
            layers, n, heads, dim = keys.shape
            flat = keys.permute(1, 0, 2, 3).reshape(n, layers * heads, dim)
            self.window_k[:, held] = rotary.move_keys(flat, src_pos, dst_pos).reshape(
                n, layers, heads, dim).permute(1, 0, 2, 3)
        self.has_window[src_slots] = False
        self.spare_since[src_slots] = -1
        self.window_of[dst_slots] = held
        self.has_window[dst_slots] = True
        self.spare_since[dst_slots] = -1

    def gather_layers(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every KV layer at full `slots` `[layers, n, kv_heads, head_dim]` (sliding layers:
        zeros where a token has no window; the DecodeArena reads only the window)."""
        layers = len(self.full_layers) + len(self.sliding_layers)
        shape = (layers, slots.numel(), *self.k.shape[2:])
        k, v = torch.zeros(shape, dtype=self.k.dtype), torch.zeros(shape, dtype=self.k.dtype)
        full = torch.tensor(self.full_layers, dtype=torch.long)
        k.index_copy_(0, full, self.k.index_select(1, slots))
        v.index_copy_(0, full, self.v.index_select(1, slots))
        held = self.has_window[slots]
        rows = torch.nonzero(held).flatten()
        window = self.window_of[slots[held]]
        sliding = torch.tensor(self.sliding_layers)
        k[sliding[:, None], rows[None, :]] = self.window_k.index_select(1, window)
        v[sliding[:, None], rows[None, :]] = self.window_v.index_select(1, window)
        return k, v

    # ----- accounting ----------------------------------------------------------------------
    def full_bytes_per_slot(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def window_bytes_per_slot(self) -> int:
        return 2 * self.window_k[:, 0].numel() * self.window_k.element_size()

    def bytes_per_slot(self) -> int:
        """Bytes of one token with every layer held (full + window slot)."""
        return self.full_bytes_per_slot() + self.window_bytes_per_slot()

    def bytes_held(self) -> int:
        """Bytes of K/V the slots in use hold now: full slots x full layers + window slots x sliding."""
        return (self.allocator.num_used * self.full_bytes_per_slot()
                + self.window_allocator.num_used * self.window_bytes_per_slot())

    def nbytes(self) -> int:
        """Bytes of the pool's tensors (what the process holds for K/V, used or not)."""
        return sum(t.nbytes for t in (self.k, self.v, self.window_k, self.window_v))

    def check_integrity(self) -> None:
        """Raise AssertionError unless window slots in use == full slots carrying one, every carrier
        is allocated, and no window slot is carried twice."""
        carriers = torch.nonzero(self.has_window).flatten()
        assert self.window_allocator.num_used == carriers.numel(), (
            f"window slots in use {self.window_allocator.num_used} != carriers {carriers.numel()}")
        if carriers.numel():
            assert bool((self.allocator.refcount[carriers] > 0).all()), "a free full slot carries a window"
            assert self.window_of[carriers].unique().numel() == carriers.numel(), "a window slot carried twice"


def default_window_slots(num_slots: int, window: int, max_batch_tokens: int, max_running: int,
                         longest: int = 0) -> int:
    """M for a pool of `num_slots` full slots: the tail, window and chunk of two running requests
    (3 W + a chunk each), plus an eighth of the pool for checkpoint windows (the radix tree's and the
    running requests': one W per 4096 tokens of `WindowKeep.checkpoint_spacing`); never more than
    `num_slots`. More requests at once share it: a chunk that finds no window slot (after evicting
    the tree's) waits a step.

    At least `longest` (the longest sequence, `max_model_len`) plus one request's tail, window and
    chunk: an edited turn of a chat that long relocates its sliding-layer K/V wherever a computed
    token's window reaches (message openings put one every few hundred tokens), so the windows of
    the whole previous turn must still be there, as spare windows, while the new turn's chunks take
    their own. With fewer, a 32K-token edited turn of Gemma 3 found no window slot for its first
    chunk (the pool held 15,360 for 65,536 full slots). At the server's 65,536 full slots and
    Gemma 3's 32K context that is 36,352 (0.55 of the full slots; SGLang's default
    `--swa-full-tokens-ratio` is 0.8)."""
    per_request = 3 * window + max_batch_tokens
    return min(num_slots, max(num_slots // 8 + min(max_running, 2) * per_request, longest + per_request))
