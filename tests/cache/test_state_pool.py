"""StatePool slots and radix-tree checkpoints: allocated, counted, evicted and freed like KV
slots, with the same integrity check."""

from __future__ import annotations

import pytest
import torch

from kvsplice.cache.kv_pool import SlotAllocator
from kvsplice.cache.radix import RadixCache
from kvsplice.cache.state_pool import StatePool, pack_states, unpack_states
from kvsplice.layer_configs import LinearAttnConfig

LIN = LinearAttnConfig("qwen3_5", conv_kernel=4, num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=6)


def test_alloc_copy_zero_free_and_integrity():
    pool = StatePool(3, 2, LIN)
    assert pool.conv.shape == (2, 3, LIN.conv_dim, 3) and pool.rec.shape == (2, 3, 4, 8, 6)
    a, b = pool.alloc_one(), pool.alloc_one()
    pool.rec[:, a].normal_()
    pool.conv[:, a].normal_()
    pool.copy(a, b)
    assert torch.equal(pool.rec[:, a], pool.rec[:, b]) and torch.equal(pool.conv[:, a], pool.conv[:, b])
    pool.zero(a)
    assert pool.rec[:, a].abs().sum() == 0 and pool.conv[:, a].abs().sum() == 0
    pool.check_integrity(cached=0, in_use=2)
    with pytest.raises(AssertionError):
        pool.check_integrity(cached=0, in_use=1)
    assert pool.alloc_one() is not None and pool.alloc_one() is None
    pool.free([a, b])
    with pytest.raises(RuntimeError):
        pool.free([a])
    assert pool.bytes_per_slot() == 2 * (LIN.conv_dim * 3 + 4 * 8 * 6) * 4


def test_snapshot_and_restore_round_trip_and_refuse_another_layout():
    pool = StatePool(3, 2, LIN)
    a, b = pool.alloc_one(), pool.alloc_one()
    pool.rec[:, a].normal_()
    pool.conv[:, a].normal_()
    saved = pool.snapshot(a)
    assert set(saved) == {"conv", "rec"} and saved["rec"].shape == (2, 4, 8, 6)
    pool.zero(a)                                  # a snapshot is a copy: the slot may be reused
    assert saved["rec"].abs().sum() > 0
    assert pool.fits(saved)
    pool.restore(b, saved)
    assert torch.equal(pool.rec[:, b], saved["rec"]) and torch.equal(pool.conv[:, b], saved["conv"])
    other = StatePool(3, 1, LIN)                  # another model: one linear layer
    assert not other.fits(saved) and not pool.fits({"rec": saved["rec"]})
    assert not pool.fits({**saved, "rec": saved["rec"].to(torch.float64)})
    with pytest.raises(ValueError):
        other.restore(0, saved)


def test_packed_states_unpack_by_length():
    pool = StatePool(3, 2, LIN)
    snapshots = {12: pool.snapshot(0), 40: pool.snapshot(1)}
    packed = pack_states(snapshots)
    assert sorted(packed) == ["12.conv", "12.rec", "40.conv", "40.rec"]
    unpacked = unpack_states(packed)
    assert sorted(unpacked) == [12, 40] and all(pool.fits(snapshot) for snapshot in unpacked.values())
    for bad in ("conv", "0.conv", "x.rec", "12."):
        with pytest.raises(ValueError):
            unpack_states({bad: torch.zeros(1)})


def test_an_evicted_leaf_is_handed_over_with_its_checkpoint():
    """The spill hook (the disk tier's) sees each evicted leaf's checkpoint before it is freed."""
    kv, states = SlotAllocator(32), StatePool(4, 1, LIN)
    seen = []
    radix = RadixCache(kv, states.allocator,
                       on_evict=lambda ns, ids, start, slots, state: seen.append((len(ids), start, state)))
    radix.insert(list(range(10)), kv.alloc(10), None)
    slot = states.alloc_one()
    radix.set_checkpoint(radix.match_prefix(list(range(6)), None).node, slot)
    assert radix.evict(10) == 10
    assert seen == [(10, 6, None), (6, 0, slot)]
    assert states.allocator.num_free == 4
    radix.check_integrity()


def test_radix_checkpoints_split_evict_and_count():
    kv, states = SlotAllocator(32), StatePool(4, 1, LIN)
    radix = RadixCache(kv, states.allocator)
    radix.insert(list(range(10)), kv.alloc(10), None)
    node = radix.match_prefix(list(range(10)), None).node
    slot = states.alloc_one()
    radix.set_checkpoint(node, slot)
    with pytest.raises(ValueError):
        radix.set_checkpoint(node, slot)
    # a match inside the node splits it: the checkpoint stays with the deeper part (depth 10)
    short = radix.match_prefix(list(range(6)), None)
    assert short.length == 6 and short.node.state_checkpoint is None
    assert radix.deepest_checkpoint(short.node)[1] == 0
    deep = radix.match_prefix(list(range(10)) + [99], None)
    found, depth = radix.deepest_checkpoint(deep.node)
    assert (found.state_checkpoint, depth) == (slot, 10)
    radix.check_integrity()
    states.check_integrity(cached=radix.num_checkpoints(), in_use=0)
    # a lock does not protect a checkpoint (a running request copied it at admission), a pin does
    radix.lock(found)
    states.allocator.incref(torch.tensor([slot]))
    assert radix.evict_checkpoints(1) == 0
    states.free([slot])
    assert radix.evict_checkpoints(1) == 1
    radix.unlock(found)
    assert radix.num_checkpoints() == 0 and states.allocator.num_free == 4
    assert radix.match_prefix(list(range(10)), None).length == 10      # the K/V stays
    radix.check_integrity()
    # a node evicted for its K/V takes its checkpoint with it
    radix.set_checkpoint(found, states.alloc_one())
    assert radix.evict(10) == 10 and radix.num_checkpoints() == 0 and states.allocator.num_free == 4
    radix.check_integrity()


def tree_with_checkpoints(depths, tokens=40, states_slots=16):
    """One path of `tokens` tokens with a checkpoint at each depth; (radix, states, {depth: node})."""
    kv, states = SlotAllocator(64), StatePool(states_slots, 1, LIN)
    radix = RadixCache(kv, states.allocator)
    radix.insert(list(range(tokens)), kv.alloc(tokens), "ns")
    nodes = {}
    for depth in depths:
        node = radix.match_prefix(list(range(depth)), "ns").node
        radix.set_checkpoint(node, states.alloc_one())
        nodes[depth] = node
    return radix, states, nodes


def remaining(radix):
    return sorted(c.depth for c in radix.checkpoint_candidates())


def test_candidates_know_their_neighbours():
    radix, states, _ = tree_with_checkpoints([4, 10, 12, 30])
    radix.insert(list(range(10)) + [99] * 6, radix.allocator.alloc(16), "ns")   # a branch below 10
    radix.set_checkpoint(radix.match_prefix(list(range(10)) + [99] * 6, "ns").node, states.alloc_one())
    by_depth = {(c.depth, c.next_depth): c.prev_depth for c in radix.checkpoint_candidates()}
    assert by_depth == {(4, 10): 0, (10, 12): 4, (12, 30): 10, (30, None): 12, (16, None): 10}


def test_thinning_keeps_the_path_even_and_its_end_last():
    radix, states, _ = tree_with_checkpoints([5, 10, 12, 20, 30, 40])
    assert radix.thin_checkpoints(4) == 2
    # costs (c - p) * (n - c): 5: 5*5, 10: 5*2, 12: 2*8, 20: 8*10, 30: 10*10 -> 10 goes, then 5 (5*7 < 12's 7*8)
    assert remaining(radix) == [12, 20, 30, 40]
    assert radix.thin_checkpoints(1) == 3
    assert remaining(radix) == [40]                 # the path's end (appends land after it) stays last
    states.check_integrity(cached=radix.num_checkpoints(), in_use=0)
    radix.check_integrity()


def test_thinning_takes_least_recently_used_paths_first():
    radix, states, _ = tree_with_checkpoints([8, 16])
    radix.insert([7] * 20, radix.allocator.alloc(20), "ns")
    for depth in (10, 20):
        radix.set_checkpoint(radix.match_prefix([7] * depth, "ns").node, states.alloc_one())
    radix.match_prefix(list(range(40)), "ns")       # the first path is used again
    radix.thin_checkpoints(2)
    assert remaining(radix) == [8, 16]
    radix.check_integrity()
