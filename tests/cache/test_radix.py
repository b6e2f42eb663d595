"""Unit tests of the radix prefix cache: match, insert, split, lock, evict, namespaces, printing."""

import pytest
import torch

from kvsplice.cache.kv_pool import SlotAllocator
from kvsplice.cache.radix import PrefixMatch, RadixCache


def make_cache(num_slots: int = 64) -> tuple[SlotAllocator, RadixCache]:
    allocator = SlotAllocator(num_slots)
    return allocator, RadixCache(allocator)


def insert_fresh(tree: RadixCache, token_ids: list[int], namespace=None) -> torch.Tensor:
    """Insert like a request would: match, allocate the rest, insert, free duplicates."""
    match = tree.match_prefix(token_ids, namespace)
    new_slots = tree.allocator.alloc(len(token_ids) - match.length)
    slots = torch.cat([match.slots, new_slots])
    n_present = tree.insert(token_ids, slots, namespace)
    tree.allocator.free(slots[match.length:n_present])
    return slots


def check(tree: RadixCache, in_use: int = 0) -> None:
    tree.check_integrity()
    tree.allocator.check_integrity(cached=tree.cached_size(), in_use=in_use)
    assert tree.evictable_size() + tree.protected_size() == tree.cached_size()


# (inserted sequences, query, expected match length)
MATCH_CASES = [
    ([], [1, 2, 3], 0),
    ([[1, 2, 3]], [], 0),
    ([[1, 2, 3]], [1, 2, 3], 3),
    ([[1, 2, 3]], [1, 2, 3, 4], 3),
    ([[1, 2, 3]], [1, 2], 2),           # ends inside a node: split
    ([[1, 2, 3]], [1, 5], 1),           # diverges inside a node: split
    ([[1, 2, 3]], [2, 1], 0),
    ([[1, 2, 3], [1, 2, 4]], [1, 2, 4, 4], 3),
    ([[1, 2, 3], [1, 2, 4], [1, 7]], [1, 7, 7], 2),
    ([[5], [5, 6], [5, 6, 7]], [5, 6, 7, 8], 3),
    ([[5, 6, 7], [5, 6], [5]], [5, 6, 9], 2),
]


@pytest.mark.parametrize("inserted, query, expected_length", MATCH_CASES)
def test_match_prefix_table(inserted, query, expected_length):
    _, tree = make_cache()
    slot_of = {}
    for token_ids in inserted:
        slots = insert_fresh(tree, token_ids)
        for end in range(1, len(token_ids) + 1):
            slot_of.setdefault(tuple(token_ids[:end]), int(slots[end - 1]))
    match = tree.match_prefix(query, None)
    assert isinstance(match, PrefixMatch)
    assert match.length == expected_length
    assert match.slots.dtype == torch.int64
    assert match.slots.tolist() == [slot_of[tuple(query[:end])] for end in range(1, expected_length + 1)]
    check(tree)


# (cached sequence, inserted sequence, expected n_present)
INSERT_CASES = [
    ([], [1, 2], 0),
    ([1, 2, 3], [1, 2, 3], 3),
    ([1, 2, 3], [1, 2], 2),
    ([1, 2, 3], [1, 2, 3, 4, 5], 3),
    ([1, 2, 3], [1, 9, 9], 1),
    ([1, 2, 3], [4, 5], 0),
]


@pytest.mark.parametrize("cached, inserted, expected_present", INSERT_CASES)
def test_insert_returns_n_present_and_keeps_old_slots(cached, inserted, expected_present):
    allocator, tree = make_cache()
    old_slots = insert_fresh(tree, cached) if cached else torch.empty(0, dtype=torch.int64)
    new_slots = allocator.alloc(len(inserted))
    n_present = tree.insert(inserted, new_slots, None)
    assert n_present == expected_present
    allocator.free(new_slots[:n_present])  # duplicates: the caller's to free
    match = tree.match_prefix(inserted, None)
    assert match.length == len(inserted)
    # The tree keeps what it had for the present part and takes the new part.
    assert match.slots.tolist() == old_slots[:n_present].tolist() + new_slots[n_present:].tolist()
    check(tree)


def test_insert_empty_creates_no_root():
    _, tree = make_cache()
    assert tree.insert([], torch.empty(0, dtype=torch.int64), "ns") == 0
    assert tree.namespaces() == []


@pytest.mark.parametrize("token_ids, slots", [
    ([1, 2, 3], torch.tensor([0, 1])),
    ([1], torch.tensor([[0]])),
])
def test_insert_rejects_mismatched_slots(token_ids, slots):
    _, tree = make_cache()
    with pytest.raises(ValueError):
        tree.insert(token_ids, slots, None)


def test_split_keeps_sizes_and_locks():
    _, tree = make_cache()
    insert_fresh(tree, [1, 2, 3, 4])
    full = tree.match_prefix([1, 2, 3, 4], None)
    tree.lock(full.node)
    assert tree.protected_size() == 4
    half = tree.match_prefix([1, 2], None)   # splits the locked node
    assert half.node is not full.node and half.node.lock_ref == 1
    assert tree.protected_size() == 4 and tree.evictable_size() == 0
    check(tree)
    tree.unlock(full.node)
    assert tree.evictable_size() == 4 and tree.protected_size() == 0
    check(tree)


def test_lock_protects_path_from_eviction():
    allocator, tree = make_cache()
    insert_fresh(tree, [1, 2, 3])
    insert_fresh(tree, [1, 2, 4, 5])
    match = tree.match_prefix([1, 2, 3], None)
    tree.lock(match.node)
    assert tree.evict(100) == 2               # only the [4, 5] branch goes
    assert tree.match_prefix([1, 2, 3], None).slots.tolist() == match.slots.tolist()
    assert tree.cached_size() == tree.protected_size() == 3
    check(tree)
    tree.unlock(match.node)
    assert tree.evict(100) == 3
    assert allocator.num_free == allocator.num_slots
    check(tree)


def test_unlock_below_zero_raises_and_changes_nothing():
    _, tree = make_cache()
    insert_fresh(tree, [1, 2, 3])
    match = tree.match_prefix([1, 2, 3], None)
    with pytest.raises(RuntimeError):
        tree.unlock(match.node)
    tree.lock(match.node)
    tree.unlock(match.node)
    with pytest.raises(RuntimeError):
        tree.unlock(match.node)
    check(tree)


def test_lock_of_evicted_node_raises():
    _, tree = make_cache()
    insert_fresh(tree, [1, 2])
    match = tree.match_prefix([1, 2], None)
    tree.evict(2)
    with pytest.raises(RuntimeError):
        tree.lock(match.node)


def test_evict_is_lru_and_cascades_to_parents():
    _, tree = make_cache()
    insert_fresh(tree, [1, 2, 3])     # oldest
    insert_fresh(tree, [1, 2, 4])
    insert_fresh(tree, [7, 8])
    tree.match_prefix([1, 2, 3], None)  # [1, 2] and [3] become the most recent
    assert tree.evict(1) == 1           # [4] is the least recently used leaf
    assert tree.match_prefix([1, 2, 4], None).length == 2
    assert tree.evict(1) == 2           # then [7, 8] (a whole leaf goes)
    assert tree.match_prefix([7, 8], None).length == 0
    assert tree.evict(2) == 3           # [3], then its parent [1, 2] became a leaf
    assert tree.cached_size() == 0 and tree.namespaces() == []
    check(tree)


@pytest.mark.parametrize("num_tokens, expected_freed", [(0, 0), (1, 2), (2, 2), (3, 5), (100, 5)])
def test_evict_amounts(num_tokens, expected_freed):
    _, tree = make_cache()
    insert_fresh(tree, [1, 2])
    insert_fresh(tree, [3, 4, 5])
    assert tree.evict(num_tokens) == expected_freed
    assert tree.cached_size() == 5 - expected_freed
    check(tree)


def test_evict_negative_raises():
    _, tree = make_cache()
    with pytest.raises(ValueError):
        tree.evict(-1)


def test_namespaces_are_isolated_and_roots_do_not_leak():
    _, tree = make_cache()
    slots_a = insert_fresh(tree, [1, 2, 3], "a")
    assert tree.match_prefix([1, 2, 3], "b").length == 0
    assert tree.match_prefix([1, 2, 3], None).length == 0
    slots_b = insert_fresh(tree, [1, 2, 3], "b")
    assert set(slots_a.tolist()).isdisjoint(slots_b.tolist())
    assert tree.match_prefix([1, 2, 3], "a").slots.tolist() == slots_a.tolist()
    assert tree.match_prefix([1, 2, 3], "b").slots.tolist() == slots_b.tolist()
    assert sorted(tree.namespaces()) == ["a", "b"]
    match_b = tree.match_prefix([1, 2, 3], "b")
    tree.lock(match_b.node)
    assert tree.reset() == 3
    assert tree.namespaces() == ["b"]
    tree.unlock(match_b.node)
    tree.reset()
    assert tree.namespaces() == []
    check(tree)


def test_empty_match_returns_root_that_can_be_locked():
    _, tree = make_cache()
    missing = tree.match_prefix([1], "nowhere")
    assert missing.length == 0 and missing.node.is_root
    tree.lock(missing.node)
    tree.unlock(missing.node)
    insert_fresh(tree, [1], "x")
    root_match = tree.match_prefix([9], "x")
    assert root_match.length == 0 and root_match.node.is_root
    assert tree.namespaces() == ["x"]


def test_reset_frees_only_unlocked():
    allocator, tree = make_cache()
    insert_fresh(tree, [1, 2, 3])
    insert_fresh(tree, [1, 2, 5, 6])
    insert_fresh(tree, [9])
    kept = tree.match_prefix([1, 2, 5], None)
    tree.lock(kept.node)
    assert tree.reset() == 3          # [3], the [6] tail after the split, and [9]
    assert tree.cached_size() == tree.protected_size() == 3
    assert allocator.num_free == allocator.num_slots - 3
    check(tree)


def test_access_clock_is_deterministic_and_monotonic():
    _, first = make_cache()
    _, second = make_cache()
    for tree in (first, second):
        insert_fresh(tree, [1, 2])
        insert_fresh(tree, [3])
    assert first.pretty_print() == second.pretty_print()
    before = first.match_prefix([1, 2], None).node.last_access
    assert first.match_prefix([1, 2], None).node.last_access > before


def test_pretty_print_shows_structure():
    _, tree = make_cache()
    insert_fresh(tree, [1, 2, 3])
    insert_fresh(tree, [1, 2, 4])
    insert_fresh(tree, [5], "ns")
    tree.lock(tree.match_prefix([1, 2, 4], None).node)
    text = tree.pretty_print()
    lines = text.splitlines()
    assert lines[0] == "ns=None"
    assert lines[1].startswith("[1, 2] slots=[0, 1] lock=1")
    assert lines[2].startswith("  [3] slots=[2] lock=0")
    assert lines[3].startswith("  [4] slots=[3] lock=1")
    assert lines[4] == "ns='ns'"
    assert lines[5].startswith("[5] slots=[4] lock=0")
    assert lines[6] == "cached=5 evictable=2 protected=3"


def test_match_accepts_tensor_ids():
    _, tree = make_cache()
    insert_fresh(tree, [1, 2, 3])
    assert tree.match_prefix(torch.tensor([1, 2, 3]), None).length == 3


def test_locked_slots_are_those_of_locked_paths_only():
    _, tree = make_cache()
    shared = insert_fresh(tree, [1, 2, 3, 4, 5])
    other = insert_fresh(tree, [1, 2, 3, 9, 9, 9])
    insert_fresh(tree, [7, 7], namespace="tenant")
    assert tree.locked_slots().numel() == 0
    tree.lock(tree.match_prefix([1, 2, 3, 9, 9, 9], None).node)
    assert sorted(tree.locked_slots().tolist()) == sorted(other.tolist())
    assert not set(tree.locked_slots().tolist()) & set(shared[3:].tolist())
    check(tree)
