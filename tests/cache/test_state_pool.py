"""StatePool slots and radix-tree checkpoints: allocated, counted, evicted and freed like KV
slots, with the same integrity check."""

from __future__ import annotations

import pytest
import torch

from kvsplice.cache.kv_pool import SlotAllocator
from kvsplice.cache.radix import RadixCache
from kvsplice.cache.state_pool import StatePool
from kvsplice.models.config import LinearAttnConfig

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
    # locked: not evictable; unlocked: evicted with its node, the state slot freed
    radix.lock(found)
    assert radix.evict_checkpoints(1) == 0
    radix.unlock(found)
    assert radix.evict_checkpoints(1) == 1
    assert radix.num_checkpoints() == 0 and states.allocator.num_free == 4
    radix.check_integrity()
