"""DecodeArena: contiguous copies of the decoding requests' K/V, one row per request, so that a
decode step reads each context as one block instead of gathering scattered pool slots in every
layer (an O(context) copy per layer per step).

    pool, token-granular (the truth)          arena k / v [layers, rows, kv_heads, capacity, head_dim]
    req A: slots [7, 2, 90, 91, 93] --fill-->  row 0: pos 0 1 2 3 4 | . . .
    req B: slots [5, 6, 92, 94]     --fill-->  row 1: pos 0 1 2 3   | . . .
    each decode step writes every row's new token at its position (and into the pool as well)

The pool stays authoritative (the radix tree, SCR and preemption use it); a row is a cache of a
request's context while it decodes. A row is filled from the pool once, when its request starts
decoding (one gather over all layers), and dropped as soon as a step does not decode its request
(finished, preempted, aborted, or computing more than one token). Rows are compact: dropping
row r moves the last row into it.

    rows before: [A B C D]   C leaves   rows after: [A B D]  (D's row copied into slot 2)

Memory is bounded by `max_tokens` (rows x capacity); requests that do not fit stay on the
gathering path.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvsplice.cache.kv_pool import KVPool

_CAPACITY_STEP = 256


class DecodingRequest(Protocol):
    """What the arena reads of a request (the engine's Req): the length of its sequence, and the
    KV slot of each of its offsets (set once the request is admitted)."""

    @property
    def seq_len(self) -> int: ...

    @property
    def seq_slots(self) -> torch.Tensor | None: ...


def by_position(layer_kv: torch.Tensor) -> torch.Tensor:
    """A layer's `[rows, kv_heads, capacity, head_dim]` K or V as a `[rows, capacity, kv_heads,
    head_dim]` view, in which one (row, position) pair indexes a token's K/V."""
    return layer_kv.permute(0, 2, 1, 3)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class DecodeArena:
    """Rows of contiguous K/V for decoding requests (see the module docstring).

    `lengths[r]` counts the positions of row r that hold K/V once the current step has run.
    `min_rows`: once allocated, k / v hold at least this many rows (2 for the compiled decode step,
    whose graphs take an arena of 2 rows or more; see kvsplice.models.compiled_decode).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_tokens: int, device: str | torch.device = "cpu", min_rows: int = 1):
        if min_rows < 1:
            raise ValueError(f"min_rows must be at least 1, got {min_rows}")
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device, self.max_tokens = dtype, device, max_tokens
        self.min_rows = min_rows
        self.reqs: list[DecodingRequest] = []
        self.lengths: list[int] = []
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._allocate(0, 0)

    # ----- storage ----------------------------------------------------------------------
    def _allocate(self, rows: int, capacity: int) -> None:
        """(Re)allocate k/v for `rows` x `capacity`, keeping the rows in use."""
        layers, heads, dim = self.shape
        # normal tensors and views, as the pool's, even when a step grows it (the compiled decode
        # step's guards check which kind its inputs are)
        with torch.inference_mode(False):
            k = torch.zeros(layers, rows, heads, capacity, dim, dtype=self.dtype, device=self.device)
            v = torch.zeros_like(k)
            if self.k is not None and self.reqs:
                used, old_cap = len(self.reqs), self.k.shape[3]
                keep = min(old_cap, capacity)
                k[:, :used, :, :keep] = self.k[:, :used, :, :keep]
                v[:, :used, :, :keep] = self.v[:, :used, :, :keep]
            self.k, self.v = k, v
            self.k_by_pos = tuple(by_position(k[layer]) for layer in range(layers))
            self.v_by_pos = tuple(by_position(v[layer]) for layer in range(layers))

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage held now (grows with use, up to `max_tokens` tokens' worth)."""
        return self.k.nbytes + self.v.nbytes

    def clear(self) -> None:
        """Drop every row and free the storage."""
        self.reqs, self.lengths = [], []
        self._allocate(0, 0)

    # ----- rows -------------------------------------------------------------------------
    def assign(self, reqs: list[DecodingRequest], pool: KVPool) -> list[DecodingRequest]:
        """Prepare one decode step for `reqs` (each computes its position seq_len - 1).

        Drops the rows of requests not in `reqs` (or out of step), fills new rows from `pool`
        while memory allows, and returns the requests that have a row, in row order (rows 0..n-1).
        Side effect: `lengths` already count this step's token for every returned request.
        """
        wanted = {id(req) for req in reqs}
        for row in reversed(range(len(self.reqs))):
            req = self.reqs[row]
            if id(req) not in wanted or self.lengths[row] != req.seq_len - 1:
                self._drop(row)
        held = {id(req) for req in self.reqs}
        for req in reqs:
            if id(req) not in held and not self._add(req, pool):
                break
        self._fit_capacity()
        self.lengths = [req.seq_len for req in self.reqs]
        return list(self.reqs)

    def _fit_capacity(self) -> None:
        """Grow the capacity to the longest row's new length, dropping the longest rows while
        that would break the memory bound."""
        while self.reqs:
            need = max(r.seq_len for r in self.reqs)
            if self._fits(len(self.reqs), _round_up(need, _CAPACITY_STEP)):
                if need > self.capacity:
                    self._grow(len(self.reqs), need)
                return
            self._drop(max(range(len(self.reqs)), key=lambda row: self.reqs[row].seq_len))

    def step_views(self, count: int, width: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """K and V of rows 0..count-1, one `[count, kv_heads, width, head_dim]` view per layer (made
        once per step: slicing in every layer costs a dispatch each)."""
        return self.k[:, :count, :, :width].unbind(0), self.v[:, :count, :, :width].unbind(0)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Store `k`, `v [n, kv_heads, head_dim]` (in the arena's dtype) of `rows [n]` at `positions [n]`."""
        self.k_by_pos[layer].index_put_((rows, positions), k)
        self.v_by_pos[layer].index_put_((rows, positions), v)

    def _fits(self, rows: int, capacity: int) -> bool:
        """True when `rows` rows (at least min_rows are allocated) of `capacity` stay in max_tokens."""
        return max(rows, self.min_rows) * capacity <= self.max_tokens

    def _grow(self, rows: int, capacity: int) -> None:
        """Make room for `rows` rows of `capacity` positions, growing geometrically."""
        rows = max(rows, self.min_rows)
        new_rows = max(self.rows, 1)
        while new_rows < rows:
            new_rows *= 2
        new_cap = self.capacity
        if capacity > new_cap:
            new_cap = _round_up(max(capacity, new_cap + new_cap // 2), _CAPACITY_STEP)
        if not self._fits(new_rows, new_cap):
            new_rows, new_cap = rows, _round_up(capacity, _CAPACITY_STEP)
        if (new_rows, new_cap) != (self.rows, self.capacity):
            self._allocate(new_rows, new_cap)

    def _add(self, req: DecodingRequest, pool: KVPool) -> bool:
        """Give `req` the next row, filled with the K/V of its positions [0, seq_len - 1)."""
        rows, capacity = len(self.reqs) + 1, max([req.seq_len] + [r.seq_len for r in self.reqs])
        if not self._fits(rows, _round_up(capacity, _CAPACITY_STEP)):
            return False
        self._grow(rows, capacity)
        row, filled = len(self.reqs), req.seq_len - 1
        slots = req.seq_slots[:filled]
        # [layers, filled, heads, dim] (a windowed pool: sliding layers hold only the window, the
        # rest zeros that no sliding layer reads); a row is [layers, heads, filled, dim]
        keys, values = pool.gather_layers(slots)
        self.k[:, row, :, :filled] = keys.transpose(1, 2)
        self.v[:, row, :, :filled] = values.transpose(1, 2)
        self.reqs.append(req)
        self.lengths.append(filled)
        return True

    def _drop(self, row: int) -> None:
        last = len(self.reqs) - 1
        if row != last:
            self.k[:, row] = self.k[:, last]
            self.v[:, row] = self.v[:, last]
            self.reqs[row], self.lengths[row] = self.reqs[last], self.lengths[last]
        self.reqs.pop()
        self.lengths.pop()
