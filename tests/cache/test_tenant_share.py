"""Tenant share: eviction takes the least recently used K/V of namespaces over their share first,
never anything locked, and falls back to plain LRU; a tenant's flush touches its own namespaces."""

import pytest
import torch

from kvsplice.cache.kv_pool import SlotAllocator
from kvsplice.cache.radix import RadixCache
from kvsplice.cache.tenant_share import TenantShare


def make_tree(num_slots: int = 100, share: float = 0.4) -> RadixCache:
    allocator = SlotAllocator(num_slots)
    return RadixCache(allocator, share=TenantShare(num_slots, share))


def insert(tree: RadixCache, first: int, length: int, namespace) -> None:
    """One leaf of `length` tokens starting with token `first` (distinct leaves per `first`)."""
    slots = tree.allocator.alloc(length)
    tree.insert(list(range(first, first + length)), slots, namespace)


def test_share_bounds_and_cap():
    assert TenantShare(1000, 0.4).cap == 400 and TenantShare(10, 0.01).cap == 1
    assert not TenantShare(1000, 1.0).enabled and not TenantShare(1000, 1.0).is_over(1000)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="tenant_kv_share"):
            TenantShare(100, bad)


def test_flooding_namespace_loses_its_own_history_first():
    """A holds 30 (under its cap of 40), older than B's 60 (over): evicting 20 takes B's oldest
    leaves, although A's are least recently used overall."""
    tree = make_tree()
    for i in range(3):
        insert(tree, 1000 * i, 10, "A")
    for i in range(6):
        insert(tree, 10_000 + 1000 * i, 10, "B")
    assert tree.over_share("B") and not tree.over_share("A")
    assert tree.evict(20) == 20
    assert tree.namespace_size("A") == 30 and tree.namespace_size("B") == 40
    assert tree.match_prefix(list(range(10_000, 10_010)), "B").length == 0      # B's oldest went
    assert tree.match_prefix(list(range(10_000 + 5000, 10_010 + 5000)), "B").length == 10
    tree.check_integrity()


def test_phase_one_stops_at_the_cap_then_plain_lru():
    """B is over by 20 only: evicting 40 takes 20 of B's (down to its cap), then the least recently
    used of anyone (A's oldest)."""
    tree = make_tree()
    for i in range(3):
        insert(tree, 1000 * i, 10, "A")
    for i in range(6):
        insert(tree, 10_000 + 1000 * i, 10, "B")
    assert tree.evict(40) == 40
    assert tree.namespace_size("B") == 40 and tree.namespace_size("A") == 10
    assert tree.match_prefix(list(range(2000, 2010)), "A").length == 10         # A's newest stays
    tree.check_integrity()


def test_without_a_share_eviction_is_plain_lru():
    tree = make_tree(share=1.0)
    for i in range(3):
        insert(tree, 1000 * i, 10, "A")
    for i in range(6):
        insert(tree, 10_000 + 1000 * i, 10, "B")
    tree.evict(20)
    assert tree.namespace_size("A") == 10 and tree.namespace_size("B") == 60


def test_locked_entries_of_an_over_share_namespace_are_never_evicted():
    """B's K/V is all locked (running requests): room comes from A by plain LRU; B's locked path
    stays, and counts toward its share."""
    tree = make_tree()
    insert(tree, 0, 10, "A")
    insert(tree, 1000, 10, "A")
    for i in range(5):
        insert(tree, 10_000 + 1000 * i, 10, "B")
    locked = [tree.match_prefix(list(range(10_000 + 1000 * i, 10_010 + 1000 * i)), "B").node for i in range(5)]
    for node in locked:
        tree.lock(node)
    assert tree.over_share("B") and tree.evict_over_share(10) == 0
    assert tree.evict(10) == 10 and tree.namespace_size("B") == 50 and tree.namespace_size("A") == 10
    for node in locked:
        tree.unlock(node)
    tree.check_integrity()


def test_reset_of_one_namespace_keeps_the_others():
    tree = make_tree(share=1.0)
    insert(tree, 0, 10, ("t1", None))
    insert(tree, 100, 10, ("t1", "salt"))
    insert(tree, 200, 10, ("t2", None))
    assert tree.reset(lambda namespace: namespace[0] == "t1") == 20
    assert tree.namespaces() == [("t2", None)] and tree.namespace_size(("t2", None)) == 10
    tree.check_integrity()


def test_namespace_sizes_follow_splits_and_evictions():
    tree = make_tree(share=0.5)
    insert(tree, 0, 10, "A")
    slots = tree.allocator.alloc(6)
    present = tree.insert([0, 1, 2, 99, 98, 97], slots, "A")     # splits the first leaf at 3
    tree.allocator.free(slots[:present])
    assert tree.namespace_size("A") == 13
    tree.evict(13)
    assert tree.namespace_size("A") == 0 and tree.namespaces() == []
    tree.check_integrity()
    assert torch.equal(tree.allocator.refcount, torch.zeros(100, dtype=torch.int32))
