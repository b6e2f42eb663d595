"""Unit tests of the slot allocator and the KV pool."""

import pytest
import torch

from kvsplice.cache.kv_pool import KVPool, SlotAllocator


@pytest.mark.parametrize("num_slots", [0, -3])
def test_allocator_rejects_non_positive_size(num_slots):
    with pytest.raises(ValueError):
        SlotAllocator(num_slots)


@pytest.mark.parametrize("n", [0, 1, 5, 8])
def test_alloc_returns_distinct_slots_with_refcount_one(n):
    allocator = SlotAllocator(8)
    slots = allocator.alloc(n)
    assert slots.dtype == torch.int64 and slots.numel() == n
    assert len(set(slots.tolist())) == n
    assert allocator.refcount[slots].tolist() == [1] * n
    assert allocator.num_free == 8 - n and allocator.num_used == n
    allocator.check_integrity(cached=0, in_use=n)


def test_alloc_starts_at_slot_zero_and_reuses_freed_slots_first():
    allocator = SlotAllocator(8)
    assert allocator.alloc(3).tolist() == [0, 1, 2]
    allocator.free(torch.tensor([1]))
    assert allocator.alloc(1).tolist() == [1]


def test_a_freed_run_of_slots_comes_back_as_the_same_ascending_run():
    """Relocation and attention read ascending runs as slices: slots freed together are handed out
    again in their order, not reversed."""
    allocator = SlotAllocator(16)
    allocator.alloc(2)
    run = allocator.alloc(6)
    allocator.free(run)
    assert allocator.alloc(6).tolist() == run.tolist() == [2, 3, 4, 5, 6, 7]


def test_alloc_too_many_returns_none_and_changes_nothing():
    allocator = SlotAllocator(4)
    allocator.alloc(3)
    assert allocator.alloc(2) is None
    assert allocator.num_free == 1
    allocator.check_integrity(cached=0, in_use=3)


def test_alloc_negative_raises():
    with pytest.raises(ValueError):
        SlotAllocator(4).alloc(-1)


def test_free_returns_slots_and_double_free_raises():
    allocator = SlotAllocator(4)
    slots = allocator.alloc(2)
    allocator.free(slots)
    assert allocator.num_free == 4
    allocator.check_integrity(cached=0, in_use=0)
    with pytest.raises(RuntimeError):
        allocator.free(slots)
    assert allocator.num_free == 4
    allocator.check_integrity(cached=0, in_use=0)


def test_free_of_never_allocated_slot_raises():
    with pytest.raises(RuntimeError):
        SlotAllocator(4).free(torch.tensor([2]))


def test_free_with_repeated_slot_raises_without_change():
    allocator = SlotAllocator(4)
    slots = allocator.alloc(2)
    with pytest.raises(RuntimeError):
        allocator.free(torch.tensor([int(slots[0]), int(slots[0])]))
    assert allocator.refcount[slots].tolist() == [1, 1]


def test_free_empty_is_a_no_op():
    allocator = SlotAllocator(4)
    allocator.free(torch.empty(0, dtype=torch.int64))
    assert allocator.num_free == 4


def test_incref_keeps_slot_until_last_free():
    allocator = SlotAllocator(4)
    slots = allocator.alloc(2)
    allocator.incref(slots[:1])
    allocator.incref(slots[:1])
    assert allocator.refcount[slots].tolist() == [3, 1]
    allocator.free(slots)
    assert allocator.num_free == 3          # slots[1] is back, slots[0] still held twice
    allocator.free(slots[:1])
    allocator.free(slots[:1])
    assert allocator.num_free == 4
    allocator.check_integrity(cached=0, in_use=0)


def test_incref_with_repeated_slot_counts_each():
    allocator = SlotAllocator(4)
    slot = allocator.alloc(1)
    allocator.incref(torch.cat([slot, slot]))
    assert int(allocator.refcount[slot]) == 3


def test_incref_on_free_slot_raises():
    allocator = SlotAllocator(4)
    with pytest.raises(RuntimeError):
        allocator.incref(torch.tensor([0]))


@pytest.mark.parametrize("cached, in_use", [(0, 0), (1, 1), (3, 0), (0, 3)])
def test_check_integrity_detects_wrong_totals(cached, in_use):
    allocator = SlotAllocator(6)
    allocator.alloc(2)
    if cached + in_use == 2:
        allocator.check_integrity(cached=cached, in_use=in_use)
    else:
        with pytest.raises(AssertionError):
            allocator.check_integrity(cached=cached, in_use=in_use)


def test_check_integrity_detects_corrupted_free_list():
    allocator = SlotAllocator(4)
    allocator.alloc(1)
    allocator.refcount[3] = 1                  # a slot on the free list with a reference
    with pytest.raises(AssertionError):
        allocator.check_integrity(cached=0, in_use=1)


def test_kv_pool_shapes_and_bytes_per_slot():
    pool = KVPool(num_slots=10, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16)
    assert pool.num_slots == 10 and pool.allocator.num_free == 10
    assert pool.k_layer(1).shape == (10, 2, 4) and pool.v_layer(2).shape == (10, 2, 4)
    assert pool.bytes_per_slot() == 2 * 3 * 2 * 4 * 2
    pool.k_layer(1)[5] = 1.0                   # a view: writes land in the pool
    assert float(pool.k[1, 5].sum()) == 8.0


# `free`/`incref` range-check slots: a negative slot would otherwise index from the end and
# put -1 on the free list.
@pytest.mark.parametrize("bad_slot", [-1, 4])
def test_free_of_out_of_range_slot_raises_value_error(bad_slot):
    allocator = SlotAllocator(4)
    allocator.alloc(4)
    with pytest.raises(ValueError):
        allocator.free(torch.tensor([bad_slot]))
    assert allocator.num_free == 0
