"""Property test of the slot allocator and radix cache together (hypothesis state machine).

A model of what each actor holds is kept next to the real objects:

    tree        slots the radix tree holds (it reports `cached_size()`)
    pending     requests between match and insert: they lock their matched node and own the
                slots they allocated for the rest of their tokens
    private     slots owned by a request or SCR session outside the tree
    locks       matched paths locked by an in-flight user

After every step: pool conservation, tree bookkeeping, evictable + protected == cached, locked
paths still matchable with the same slots, and every match is a prefix of its query whose slots
are exactly the ones inserted for those tokens in that namespace (never another namespace's).
"""

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvsplice.cache.kv_pool import SlotAllocator
from kvsplice.cache.radix import PrefixMatch, RadixCache, TreeNode

NUM_SLOTS = 40
NAMESPACES = st.sampled_from(["a", "b", None])
# A vocabulary of two tokens so that prefixes collide often (splits, shared paths, duplicates).
TOKEN_IDS = st.lists(st.integers(0, 1), min_size=1, max_size=6)
PICK = st.integers(0, 1_000)


@dataclass
class LockedPath:
    namespace: str | None
    token_ids: tuple[int, ...]
    slots: list[int]
    node: TreeNode


@dataclass
class PendingRequest:
    path: LockedPath
    token_ids: tuple[int, ...]
    new_slots: torch.Tensor


class RadixPoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.allocator = SlotAllocator(NUM_SLOTS)
        self.tree = RadixCache(self.allocator)
        # namespace -> token prefix -> slot of its last token, as last inserted into the tree.
        self.inserted: dict[str | None, dict[tuple[int, ...], int]] = {"a": {}, "b": {}, None: {}}
        # slot -> namespace it was last inserted under (the tree's slots are always current).
        self.slot_namespace: dict[int, str | None] = {}
        self.pending: list[PendingRequest] = []
        self.private: list[torch.Tensor] = []
        self.locks: list[LockedPath] = []

    # ---------------------------------------------------------------- helpers

    def checked_match(self, token_ids, namespace) -> PrefixMatch:
        match = self.tree.match_prefix(token_ids, namespace)
        assert 0 <= match.length <= len(token_ids)
        assert match.slots.numel() == match.length
        expected = self.inserted[namespace]
        for end in range(1, match.length + 1):
            assert expected.get(tuple(token_ids[:end])) == int(match.slots[end - 1]), (
                f"slot of {token_ids[:end]} in {namespace!r} is not what was inserted there")
        for slot in match.slots.tolist():
            assert self.slot_namespace[slot] == namespace, f"slot {slot} was inserted elsewhere"
        return match

    def alloc_evicting(self, n: int) -> torch.Tensor | None:
        slots = self.allocator.alloc(n)
        if slots is None:
            self.tree.evict(n - self.allocator.num_free)
            slots = self.allocator.alloc(n)
        return slots

    def start(self, namespace, token_ids) -> PendingRequest | None:
        token_ids = tuple(token_ids)
        match = self.checked_match(token_ids, namespace)
        self.tree.lock(match.node)
        path = LockedPath(namespace, token_ids[:match.length], match.slots.tolist(), match.node)
        new_slots = self.alloc_evicting(len(token_ids) - match.length)
        if new_slots is None:
            self.tree.unlock(match.node)
            return None
        return PendingRequest(path, token_ids, new_slots)

    def finish(self, request: PendingRequest) -> None:
        path, token_ids = request.path, request.token_ids
        cached_len = len(path.token_ids)
        slots = torch.cat([torch.tensor(path.slots, dtype=torch.int64), request.new_slots])
        n_present = self.tree.insert(token_ids, slots, path.namespace)
        assert cached_len <= n_present <= len(token_ids)
        self.allocator.free(slots[cached_len:n_present])
        for end in range(n_present + 1, len(token_ids) + 1):
            self.inserted[path.namespace][token_ids[:end]] = int(slots[end - 1])
            self.slot_namespace[int(slots[end - 1])] = path.namespace
        self.tree.unlock(path.node)
        assert self.checked_match(token_ids, path.namespace).length == len(token_ids)

    # ---------------------------------------------------------------- rules

    @rule(namespace=NAMESPACES, token_ids=TOKEN_IDS)
    def insert(self, namespace, token_ids):
        request = self.start(namespace, token_ids)
        if request is not None:
            self.finish(request)

    @rule(namespace=NAMESPACES, token_ids=TOKEN_IDS)
    def start_request(self, namespace, token_ids):
        request = self.start(namespace, token_ids)
        if request is not None:
            self.pending.append(request)

    @precondition(lambda self: self.pending)
    @rule(pick=PICK)
    def finish_request(self, pick):
        self.finish(self.pending.pop(pick % len(self.pending)))

    @rule(namespace=NAMESPACES, token_ids=TOKEN_IDS)
    def match(self, namespace, token_ids):
        self.checked_match(token_ids, namespace)

    @rule(namespace=NAMESPACES, token_ids=TOKEN_IDS)
    def lock(self, namespace, token_ids):
        match = self.checked_match(token_ids, namespace)
        self.tree.lock(match.node)
        self.locks.append(LockedPath(namespace, tuple(token_ids[:match.length]),
                                     match.slots.tolist(), match.node))

    @precondition(lambda self: self.locks)
    @rule(pick=PICK)
    def unlock(self, pick):
        self.tree.unlock(self.locks.pop(pick % len(self.locks)).node)

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens):
        cached, evictable, free = (self.tree.cached_size(), self.tree.evictable_size(),
                                   self.allocator.num_free)
        freed = self.tree.evict(num_tokens)
        assert self.tree.cached_size() == cached - freed
        assert self.allocator.num_free == free + freed
        assert freed >= min(num_tokens, evictable)
        if freed < num_tokens:
            assert self.tree.evictable_size() == 0

    @rule()
    def reset(self):
        protected = self.tree.protected_size()
        self.tree.reset()
        assert self.tree.cached_size() == self.tree.protected_size() == protected

    @rule(n=st.integers(1, 6))
    def alloc_private(self, n):
        slots = self.allocator.alloc(n)
        if slots is not None:
            self.private.append(slots)

    @precondition(lambda self: self.private)
    @rule(pick=PICK)
    def free_private(self, pick):
        self.allocator.free(self.private.pop(pick % len(self.private)))

    # ---------------------------------------------------------------- invariants

    @invariant()
    def pool_is_conserved(self):
        in_use = sum(slots.numel() for slots in self.private)
        in_use += sum(request.new_slots.numel() for request in self.pending)
        self.allocator.check_integrity(cached=self.tree.cached_size(), in_use=in_use)

    @invariant()
    def tree_bookkeeping_holds(self):
        self.tree.check_integrity()
        assert self.tree.evictable_size() + self.tree.protected_size() == self.tree.cached_size()
        locked_tokens = {(path.namespace, path.token_ids) for path in self.all_locked_paths()}
        assert self.tree.protected_size() <= sum(len(ids) for _, ids in locked_tokens)

    @invariant()
    def locked_paths_stay_matchable(self):
        for path in self.all_locked_paths():
            match = self.tree.match_prefix(path.token_ids, path.namespace)
            assert match.length == len(path.token_ids)
            assert match.slots.tolist() == path.slots

    @invariant()
    def no_empty_namespace_root(self):
        for namespace in self.tree.namespaces():
            assert self.tree.match_prefix([], namespace).node.children

    def all_locked_paths(self) -> list[LockedPath]:
        return self.locks + [request.path for request in self.pending]


RadixPoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestRadixPool = RadixPoolMachine.TestCase
