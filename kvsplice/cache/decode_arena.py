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

With a windowed pool (kvsplice.cache.window_pool) the sliding layers of width W keep a ring of W
columns per row instead of `capacity` (`ring_layers`): position p lives in column p % W, so a row of
length L holds exactly its window, positions max(0, L - W) .. L - 1, in columns 0 .. min(L, W) - 1
(attention is order-free once the keys are rotated; the length mask is min(L, W)):

    W = 4, L = 7:   ring columns  0    1    2    3        full-layer row  0 1 2 3 4 5 6 | . .
                    positions     4    5    6    3
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
                 max_tokens: int, device: str | torch.device = "cpu", min_rows: int = 1,
                 ring_layers: tuple[int, ...] = (), ring_width: int | None = None):
        """`ring_layers`: layers kept as rings of `ring_width` columns (a windowed pool's sliding
        layers); `k` / `v` then hold the other layers only."""
        if min_rows < 1:
            raise ValueError(f"min_rows must be at least 1, got {min_rows}")
        if bool(ring_layers) != (ring_width is not None):
            raise ValueError("ring_layers and ring_width go together")
        self.ring_layers, self.ring_width = tuple(ring_layers), ring_width
        self.column_layers = tuple(i for i in range(num_layers) if i not in self.ring_layers)
        # layer -> (its tensor is the ring, index in that tensor)
        self._where = {layer: (False, index) for index, layer in enumerate(self.column_layers)}
        self._where.update({layer: (True, index) for index, layer in enumerate(self.ring_layers)})
        self.ring_k: torch.Tensor | None = None
        self.ring_v: torch.Tensor | None = None
        self.shape = (len(self.column_layers), num_kv_heads, head_dim)
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
            if self.ring_layers:
                self._allocate_rings(rows)

    def _allocate_rings(self, rows: int) -> None:
        """(Re)allocate the ring layers for `rows` rows of `ring_width` columns, keeping the rows in use."""
        _, heads, dim = self.shape
        ring_k = torch.zeros(len(self.ring_layers), rows, heads, self.ring_width, dim, dtype=self.dtype,
                             device=self.device)
        ring_v = torch.zeros_like(ring_k)
        if self.ring_k is not None and self.reqs:
            used = min(len(self.reqs), rows, self.ring_k.shape[1])
            ring_k[:, :used], ring_v[:, :used] = self.ring_k[:, :used], self.ring_v[:, :used]
        self.ring_k, self.ring_v = ring_k, ring_v
        self.ring_k_by_pos = tuple(by_position(ring_k[index]) for index in range(len(self.ring_layers)))
        self.ring_v_by_pos = tuple(by_position(ring_v[index]) for index in range(len(self.ring_layers)))

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage held now (grows with use, up to `max_tokens` tokens' worth)."""
        rings = self.ring_k.nbytes + self.ring_v.nbytes if self.ring_k is not None else 0
        return self.k.nbytes + self.v.nbytes + rings

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
        once per step: slicing in every layer costs a dispatch each); a ring layer's is
        `[count, kv_heads, min(width, ring_width), head_dim]`, its columns in ring order."""
        keys = self.k[:, :count, :, :width].unbind(0)
        values = self.v[:, :count, :, :width].unbind(0)
        if not self.ring_layers:
            return keys, values
        ring = min(width, self.ring_width)
        ring_keys = self.ring_k[:, :count, :, :ring].unbind(0)
        ring_values = self.ring_v[:, :count, :, :ring].unbind(0)
        return self._by_layer(ring_keys, keys), self._by_layer(ring_values, values)

    def _by_layer(self, ring_views: tuple, column_views: tuple) -> tuple:
        """One view per layer, in layer order, from the ring layers' and the other layers' views."""
        return tuple((ring_views if is_ring else column_views)[index]
                     for _, (is_ring, index) in sorted(self._where.items()))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Store `k`, `v [n, kv_heads, head_dim]` (in the arena's dtype) of `rows [n]` at `positions [n]`
        (a ring layer: at columns positions % ring_width)."""
        is_ring, index = self._where[layer]
        if is_ring:
            columns = positions % self.ring_width
            self.ring_k_by_pos[index].index_put_((rows, columns), k)
            self.ring_v_by_pos[index].index_put_((rows, columns), v)
            return
        self.k_by_pos[index].index_put_((rows, positions), k)
        self.v_by_pos[index].index_put_((rows, positions), v)

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
        self.k[:, row, :, :filled] = self._columns(keys).transpose(1, 2)
        self.v[:, row, :, :filled] = self._columns(values).transpose(1, 2)
        if self.ring_layers:   # the W - 1 positions before this step's token, at their ring columns
            first = max(0, filled - (self.ring_width - 1))
            ring_columns = torch.arange(first, filled) % self.ring_width
            for index, layer in enumerate(self.ring_layers):
                self.ring_k_by_pos[index][row, ring_columns] = keys[layer, first:filled]
                self.ring_v_by_pos[index][row, ring_columns] = values[layer, first:filled]
        self.reqs.append(req)
        self.lengths.append(filled)
        return True

    def _columns(self, per_layer: torch.Tensor) -> torch.Tensor:
        """The column layers of `per_layer [layers, ...]`: itself when every layer is one (a pool
        without sliding layers; indexing would copy it once more), else a copy of those layers."""
        if len(self.column_layers) == per_layer.shape[0]:
            return per_layer
        return per_layer.index_select(0, torch.tensor(self.column_layers, dtype=torch.long))

    def _drop(self, row: int) -> None:
        last = len(self.reqs) - 1
        if row != last:
            self.k[:, row] = self.k[:, last]
            self.v[:, row] = self.v[:, last]
            if self.ring_layers:
                self.ring_k[:, row] = self.ring_k[:, last]
                self.ring_v[:, row] = self.ring_v[:, last]
            self.reqs[row], self.lengths[row] = self.reqs[last], self.lengths[last]
        self.reqs.pop()
        self.lengths.pop()
