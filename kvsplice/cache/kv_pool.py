"""Token-granular KV pool: one slot holds the K and V of one token in every layer.

Page size is 1 (as SGLang's default) because relocation moves spans that start anywhere.
Keys are stored *after* RoPE, so a relocated key must be re-rotated by the position delta
(see `kvsplice.layers.rotary.rerotate`).

Ownership model (who holds a reference on a slot):

    free      refcount 0, on the free list
    cached    held by the radix tree (exact K/V that other requests may match)
    in use    held by a running request, or privately by an SCR session

`SlotAllocator` is the bookkeeping alone (no tensors), so property tests can drive it fast;
`KVPool` pairs it with the K/V tensors.
"""

from __future__ import annotations

from typing import Callable

import torch


class SlotAllocator:
    """Free list plus a refcount per slot.

    Contract: `alloc` returns distinct slots with refcount 1 or None when too few are free
    (it never evicts; eviction is the caller's policy). `free` drops one reference per slot and
    returns a slot to the free list when its count reaches 0; freeing a slot that is already free
    raises `RuntimeError` (a double free is a bug, never ignored). `on_release`, when given, sees
    the slots of each `free` that went back to the free list (the windowed pool frees their
    window slots: `kvsplice.cache.window_pool`).
    """

    def __init__(self, num_slots: int, on_release: Callable[[torch.Tensor], None] | None = None):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.on_release = on_release
        self.refcount = torch.zeros(num_slots, dtype=torch.int32)
        # LIFO free list: recently freed slots are reused first (warm in caches).
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` free slots (int64 tensor) with refcount 1, or None if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        slots = torch.tensor(taken[::-1], dtype=torch.int64)
        self.refcount[slots] = 1
        return slots

    def _check_range(self, slots: torch.Tensor) -> None:
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            raise ValueError(f"slot out of range [0, {self.num_slots}): {slots.min()}..{slots.max()}")

    def incref(self, slots: torch.Tensor) -> None:
        """Add one reference to each (already allocated) slot."""
        self._check_range(slots)
        if slots.numel() and bool((self.refcount[slots] <= 0).any()):
            raise RuntimeError("incref on a free slot")
        self.refcount.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))

    def free(self, slots: torch.Tensor) -> None:
        """Drop one reference per slot; slots whose count reaches 0 return to the free list."""
        if slots.numel() == 0:
            return
        self._check_range(slots)
        if slots.unique().numel() != slots.numel():
            raise RuntimeError("the same slot appears twice in one free()")
        if bool((self.refcount[slots] <= 0).any()):
            raise RuntimeError("double free of a KV slot")
        self.refcount[slots] -= 1
        released = slots[self.refcount[slots] == 0]
        # last in, first out, and in reverse: `alloc` takes the list's tail backwards, so slots
        # freed as an ascending run come back as that run (relocation and attention read a run as
        # a slice, scattered slots row by row)
        self._free.extend(released.tolist()[::-1])
        if self.on_release is not None and released.numel():
            self.on_release(released)

    def check_integrity(self, cached: int, in_use: int) -> None:
        """Raise AssertionError unless free + cached + in_use == total and the free list is sane.

        `cached` is the number of slots the radix tree holds, `in_use` the number held by running
        requests and SCR sessions; the caller (the engine) knows both.
        """
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a slot is on the free list twice"
        held = int((self.refcount > 0).sum())
        assert held + len(free_set) == self.num_slots, (
            f"refcounts disagree with the free list: held={held} free={len(free_set)} total={self.num_slots}")
        if free_set:
            assert int(self.refcount[list(free_set)].abs().sum()) == 0, "a free slot has a reference"
        assert len(self._free) + cached + in_use == self.num_slots, (
            f"pool conservation broken: free={len(self._free)} + cached={cached} + in_use={in_use} "
            f"!= total={self.num_slots}")


class KVPool:
    """K/V tensors of every layer, indexed by slot, plus their `SlotAllocator`.

    Layout: `k[layer]` and `v[layer]` are `[num_slots, num_kv_heads, head_dim]`.
    """

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.allocator = SlotAllocator(num_slots)
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # per-layer views made once: indexing k[layer] costs a dispatch in every layer of every step
        self._k_layers, self._v_layers = self.k.unbind(0), self.v.unbind(0)

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def k_layer(self, layer_id: int) -> torch.Tensor:
        """`k[layer_id]` (a view)."""
        return self._k_layers[layer_id]

    def v_layer(self, layer_id: int) -> torch.Tensor:
        """`v[layer_id]` (a view)."""
        return self._v_layers[layer_id]

    def gather_layers(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer at `slots`, `[layers, n, kv_heads, head_dim]` (copies)."""
        return self.k.index_select(1, slots), self.v.index_select(1, slots)   # row copies: see planned_attention

    def bytes_per_slot(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def bytes_held(self) -> int:
        """Bytes of K/V the slots in use hold now."""
        return self.allocator.num_used * self.bytes_per_slot()

    def nbytes(self) -> int:
        """Bytes of the pool's tensors."""
        return self.k.nbytes + self.v.nbytes
