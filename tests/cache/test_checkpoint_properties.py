"""Property test of radix-tree state checkpoints (hypothesis state machine): inserts, checkpoints set at
matched nodes, pins (a second reference, as an SCR splice holds), thinning to a cap, and K/V eviction.

After every step: the tree's bookkeeping holds, every state slot is free, a checkpoint or pinned, no pinned
checkpoint was ever dropped, a checkpoint stays at the depth it was set at, and thinning leaves at most the
cap (plus pinned ones)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvsplice.cache.kv_pool import SlotAllocator
from kvsplice.cache.radix import RadixCache
from kvsplice.cache.state_pool import StatePool
from kvsplice.layer_configs import LinearAttnConfig

LIN = LinearAttnConfig("qwen3_5", conv_kernel=2, num_k_heads=1, num_v_heads=1, k_head_dim=2, v_head_dim=2)
TOKEN_IDS = st.lists(st.integers(0, 2), min_size=1, max_size=8)


def depth_of(node) -> int:
    depth = 0
    while node is not None:
        depth += len(node)
        node = node.parent
    return depth


class CheckpointMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = SlotAllocator(64)
        self.states = StatePool(12, 1, LIN)
        self.radix = RadixCache(self.kv, self.states.allocator)
        self.depth_of_slot: dict[int, int] = {}     # checkpoint slot -> depth it was set at
        self.pins: list[int] = []

    @rule(ids=TOKEN_IDS)
    def insert(self, ids):
        slots = self.kv.alloc(len(ids))
        if slots is None:
            self.radix.evict(len(ids))
            slots = self.kv.alloc(len(ids))
        if slots is None:
            return
        present = self.radix.insert(ids, slots, "ns")
        self.kv.free(slots[:present])

    @rule(ids=TOKEN_IDS)
    def checkpoint(self, ids):
        match = self.radix.match_prefix(ids, "ns")
        if match.length == 0 or match.node.state_checkpoint is not None:
            return
        slot = self.states.alloc_one()
        if slot is None:
            return
        self.radix.set_checkpoint(match.node, slot)
        self.depth_of_slot[slot] = match.length

    @rule(ids=TOKEN_IDS)
    def pin(self, ids):
        node = self.radix.match_prefix(ids, "ns").node
        path = self.radix.path_checkpoints(node)
        if path:
            slot = path[max(path)]
            self.states.allocator.incref(torch.tensor([slot]))
            self.pins.append(slot)

    @rule(pick=st.integers(0, 100))
    def unpin(self, pick):
        if self.pins:
            self.states.free([self.pins.pop(pick % len(self.pins))])

    def pinned_in_tree(self) -> int:
        return self.radix.num_checkpoints() - len(self.radix.checkpoint_candidates())

    @rule(cap=st.integers(0, 6))
    def thin(self, cap):
        pinned = self.pinned_in_tree()
        self.radix.thin_checkpoints(cap)
        assert self.pinned_in_tree() == pinned                  # a pinned checkpoint is never dropped
        assert self.radix.num_checkpoints() <= max(cap, pinned)

    @rule(n=st.integers(1, 10))
    def evict_kv(self, n):
        self.radix.evict(n)

    @invariant()
    def consistent(self):
        self.radix.check_integrity()
        in_use = len(set(self.pins)) - self.pinned_in_tree()   # pins whose node was evicted since
        self.states.check_integrity(cached=self.radix.num_checkpoints(), in_use=in_use)
        for candidate in self.radix.checkpoint_candidates():
            slot = candidate.handle.state_checkpoint
            assert depth_of(candidate.handle) == candidate.depth == self.depth_of_slot[slot]


CheckpointMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
TestCheckpoints = CheckpointMachine.TestCase
