"""Radix prefix cache: a radix tree over token ids whose values are KV slots (page size 1).

Modelled on SGLang's `mem_cache/radix_cache.py` (lock refs on the matched path, LRU eviction of
unlocked leaves, incremental evictable/protected sizes) and mini-sglang's `check_integrity`.

Each namespace (any hashable key: the engine uses a request's (owner, cache_salt); `None` is a namespace too) has its own root, so two
namespaces never share a node: a request can only ever match K/V that were inserted under its own
namespace. A namespace's root is dropped as soon as its last child goes, so roots do not leak.

Ownership: the tree holds one allocator reference on every slot stored in a node. It takes that
reference over from the caller at `insert` (no incref) and gives it back with `allocator.free`
when the node is evicted. A matched prefix is *borrowed*: the caller locks the matched node
instead of taking references, and the lock keeps eviction away from the whole path.

Time is a per-cache monotonic counter, not the wall clock, so LRU order is deterministic in tests.

Spilling: a tree built with `on_evict` hands every leaf that `evict` takes (pool pressure) to it
before the leaf's slots (and its checkpoint) are freed, as (namespace, token ids from position 0 to
the leaf's end, the leaf's first position, the leaf's slots, the leaf's state checkpoint or None):
the engine copies that K/V and state out to the disk tier (`kvsplice.cache.disk_tier`). A
checkpoint always sits at its node's end, so a leaf holds at most that one. `reset` (a flush) drops
leaves without handing them over.

Tenant share: a tree built with a `TenantShare` evicts the least recently used leaves of namespaces
holding more than their cap first, then plain LRU (`kvsplice.cache.tenant_share`).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Optional, Sequence

import torch

from kvsplice.cache.checkpoint_policy import CheckpointCandidate, least_useful
from kvsplice.cache.tenant_share import TenantShare

TokenKey = tuple[int, ...]
# on_evict(namespace, token ids from position 0 to the leaf's end, the leaf's start, its slots,
#          its state checkpoint: the StatePool slot of the state after its last token, or None)
EvictionHook = Callable[[Hashable, TokenKey, int, torch.Tensor, Optional[int]], None]


class TreeNode:
    """One edge of the radix tree: a run of tokens (`key`) and the KV slot of each (`slots`).

    `children` is keyed by the first token id of each child's key. `lock_ref` counts the in-flight
    users whose matched path passes through this node (a node with `lock_ref > 0` is protected from
    eviction). `last_access` is the cache's monotonic clock at the last match/insert through it.

    A root has `parent is None`, an empty key and no slots; it is never evicted and never counted
    in the sizes.

    `state_checkpoint` is for hybrid (linear-attention) models: the StatePool slot holding the
    conv and recurrent states after this node's last token (exact: computed on this very prefix),
    so a match ending here can resume the recurrence. Set it with `RadixCache.set_checkpoint`; the
    tree then holds that state slot and frees it when the node is evicted. Splitting a node keeps
    it on the deeper part (it is the state after the deeper part's last token); the new prefix
    node starts with `None`. A checkpoint can also be dropped alone (`drop_checkpoint`, the thinning
    of `kvsplice.cache.checkpoint_policy`): the node's K/V stays.
    """

    __slots__ = ("node_id", "key", "slots", "parent", "children", "lock_ref", "last_access",
                 "namespace", "state_checkpoint")

    def __init__(self, node_id: int, key: TokenKey, slots: torch.Tensor, parent: Optional["TreeNode"],
                 namespace: Hashable, last_access: float):
        self.node_id = node_id
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.namespace = namespace
        self.state_checkpoint: Optional[object] = None

    @property
    def is_root(self) -> bool:
        """True for a namespace root (an evicted node also has no parent, but keeps its key)."""
        return self.parent is None and not self.key

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.node_id}, ns={self.namespace!r}, key={list(self.key)}, "
                f"lock_ref={self.lock_ref}, last_access={self.last_access})")


@dataclass(frozen=True)
class PrefixMatch:
    """Result of `RadixCache.match_prefix`.

    `slots`: int64 slots of the matched tokens, in order (borrowed from the tree: lock `node` to
    keep them, never free them). `node`: the deepest matched node (the namespace root when
    `length == 0`); pass it to `lock`/`unlock`. `length`: number of leading query tokens matched.
    """

    slots: torch.Tensor
    node: TreeNode
    length: int


def _common_prefix_len(key: TokenKey, token_ids: TokenKey, start: int) -> int:
    """Number of leading tokens of `key` equal to `token_ids[start:]`."""
    limit = min(len(key), len(token_ids) - start)
    for offset in range(limit):
        if key[offset] != token_ids[start + offset]:
            return offset
    return limit


def _as_key(token_ids: Sequence[int] | torch.Tensor) -> TokenKey:
    """Token ids as a tuple of Python ints (accepts lists, tuples and 1-D tensors)."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        return tuple(token_ids.tolist())
    return tuple(int(token) for token in token_ids)


class RadixCache:
    """Prefix cache over token ids, namespaced, with lock refs and LRU eviction of unlocked leaves.

    Sizes are kept incrementally: `evictable_size()` counts slots in nodes with `lock_ref == 0`,
    `protected_size()` those in locked nodes, and `cached_size()` is their sum. The set of
    evictable leaves (unlocked non-root nodes without children) is kept up to date by every
    operation, so `evict` never walks the whole tree.
    """

    def __init__(self, allocator, state_allocator=None, on_evict: EvictionHook | None = None,
                 share: TenantShare | None = None):
        """`allocator` is a `SlotAllocator`; the tree frees evicted slots through it.
        `state_allocator` (hybrid models) is the StatePool's; evicted checkpoints go back to it.
        `on_evict`: sees each leaf `evict` takes, before its slots are freed (see the module doc).
        `share`: the most one namespace holds before its leaves are evicted first (None: plain LRU)."""
        self.allocator = allocator
        self.share = share
        self._namespace_sizes: dict[Hashable, int] = {}
        self.on_evict = on_evict
        self.state_allocator = state_allocator
        self._checkpoint_nodes: set[TreeNode] = set()
        self._clock = itertools.count(1)
        self._node_ids = itertools.count()
        self._roots: dict[Hashable, TreeNode] = {}
        self._evictable_leaves: set[TreeNode] = set()
        self._evictable_size = 0
        self._protected_size = 0

    # ------------------------------------------------------------------ public API

    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor,
                     namespace: Hashable) -> PrefixMatch:
        """Longest cached prefix of `token_ids` in `namespace`.

        Side effects: if the match ends inside a node, that node is split at the match end (the
        tree's content and sizes do not change, only its shape); every node on the matched path
        gets a fresh `last_access`. Nothing is locked: call `lock(result.node)` to keep the slots.
        An empty match returns the namespace's root (a detached, empty root if the namespace holds
        nothing; locking it is harmless) with `length == 0`.
        """
        key = _as_key(token_ids)
        root = self._roots.get(namespace)
        if root is None:
            return PrefixMatch(self._empty_slots(), self._new_root(namespace), 0)
        node, length, matched = self._walk(root, key)
        slots = torch.cat(matched) if matched else self._empty_slots()
        return PrefixMatch(slots, node, length)

    def insert(self, token_ids: Sequence[int] | torch.Tensor, slots: torch.Tensor,
               namespace: Hashable) -> int:
        """Insert `token_ids` with their `slots` under `namespace`; return `n_present`.

        `n_present` is the number of leading tokens that were already cached. The tree takes over
        the caller's reference on `slots[n_present:]` (the new part); it does not touch
        `slots[:n_present]`. A caller that matched `cached_len` tokens earlier, then computed the
        rest, releases what it still owns:

            token offset   0            cached_len          n_present              len
                           |-- matched --|---- duplicates ----|------ new part ------|
            who owns it     tree (borrowed   caller: the tree      tree (ownership taken
                            by the caller's  already holds equal   over by this insert)
                            lock)            K/V (another request
                                             inserted it first)
            caller does     nothing          allocator.free(       nothing
                                             slots[cached_len:n_present])

        Side effects: may split the node where the insert diverges from or ends inside the tree;
        touches `last_access` along the path. Raises `ValueError` if the lengths differ or slots
        is not 1-D.
        """
        key = _as_key(token_ids)
        slots = torch.as_tensor(slots, dtype=torch.int64)
        if slots.dim() != 1 or slots.numel() != len(key):
            raise ValueError(f"insert needs one slot per token: {len(key)} tokens, slots of shape "
                             f"{tuple(slots.shape)}")
        if not key:
            return 0
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._new_root(namespace)
        node, n_present, _ = self._walk(root, key)
        if n_present < len(key):
            self._add_leaf(node, key[n_present:], slots[n_present:].clone())
        return n_present

    def lock(self, node: TreeNode) -> None:
        """Add one lock on `node` and each ancestor: none of them can be evicted until `unlock`.

        Raises `RuntimeError` if `node` has been evicted (a caller must lock a match before anything
        can evict it).
        """
        self._check_attached(node)
        for path_node in self._path_to_root(node):
            if path_node.lock_ref == 0 and not path_node.is_root:
                self._evictable_size -= len(path_node)
                self._protected_size += len(path_node)
                self._evictable_leaves.discard(path_node)
            path_node.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        """Drop one lock from `node` and each ancestor (the inverse of `lock`).

        Raises `RuntimeError`, without changing anything, if a lock_ref on the path would go below
        zero (an unlock without its lock is a bug).
        """
        path = list(self._path_to_root(node))
        if any(path_node.lock_ref <= 0 for path_node in path):
            raise RuntimeError(f"unlock without a matching lock on {node!r}")
        for path_node in path:
            path_node.lock_ref -= 1
            if path_node.lock_ref == 0 and not path_node.is_root:
                self._protected_size -= len(path_node)
                self._evictable_size += len(path_node)
                if not path_node.children:
                    self._evictable_leaves.add(path_node)

    def set_checkpoint(self, node: TreeNode, state_slot: int) -> None:
        """Store `state_slot` (the state after `node`'s last token) at `node`; the tree takes over
        the caller's reference. Raises ValueError for a root, a node that already has one, or a
        tree without a state allocator."""
        if self.state_allocator is None or node.is_root or node.state_checkpoint is not None:
            raise ValueError(f"cannot set a checkpoint at {node!r}")
        self._check_attached(node)
        node.state_checkpoint = state_slot
        self._checkpoint_nodes.add(node)

    def drop_checkpoint(self, node: TreeNode) -> None:
        """Free `node`'s checkpoint (one reference on its state slot); the node and its K/V stay.
        Raises ValueError if it has none."""
        if node.state_checkpoint is None:
            raise ValueError(f"no checkpoint at {node!r}")
        self.state_allocator.free(torch.tensor([node.state_checkpoint], dtype=torch.int64))
        node.state_checkpoint = None
        self._checkpoint_nodes.discard(node)

    @staticmethod
    def deepest_checkpoint(node: TreeNode) -> tuple[TreeNode, int]:
        """The deepest node at or above `node` that has a checkpoint (the namespace root when none
        has), and its depth in tokens."""
        path = list(RadixCache._path_to_root(node))
        depth = sum(len(path_node) for path_node in path)
        for path_node in path:
            if path_node.state_checkpoint is not None or path_node.is_root or path_node.parent is None:
                return path_node, depth
            depth -= len(path_node)
        return path[-1], 0

    @staticmethod
    def path_checkpoints(node: TreeNode) -> dict[int, int]:
        """{depth in tokens: state slot} of every checkpoint on the path from the root to `node`
        (exact states of that path's prefixes). Reads only; the slots stay the tree's."""
        path = list(RadixCache._path_to_root(node))
        depth = sum(len(path_node) for path_node in path)
        found = {}
        for path_node in path:
            if path_node.state_checkpoint is not None:
                found[depth] = path_node.state_checkpoint
            depth -= len(path_node)
        return found

    def num_checkpoints(self) -> int:
        """State slots held by the tree as checkpoints."""
        return len(self._checkpoint_nodes)

    def checkpoint_candidates(self) -> list[CheckpointCandidate]:
        """Every checkpoint that may be dropped (its state slot has no reference besides the tree's:
        one an SCR request is about to load is pinned by a second reference), with its depth and the
        depths of its nearest checkpoint neighbours on its path (see `CheckpointCandidate`).

            root ── [..p] ckpt ── [..c] ckpt ── [..n] ckpt          prev of c = p, next of c = n
                                             └─ [..m] ckpt          (next = the nearest below: min(n, m))
        """
        depth_of, above_of = {}, {}
        for node in self._checkpoint_nodes:
            path = list(self._path_to_root(node))
            depth = sum(len(path_node) for path_node in path)
            depth_of[node] = depth
            above_of[node] = next((a for a in path[1:] if a.state_checkpoint is not None), None)
        below: dict[TreeNode, int] = {}
        for node, above in above_of.items():
            if above is not None:
                below[above] = min(below.get(above, depth_of[node]), depth_of[node])
        refcount = self.state_allocator.refcount
        return [CheckpointCandidate(depth_of[node], depth_of[above_of[node]] if above_of[node] else 0,
                                    below.get(node), node.last_access, node)
                for node in self._checkpoint_nodes if int(refcount[node.state_checkpoint]) == 1]

    def evict_checkpoints(self, num_states: int) -> int:
        """Drop the least useful unpinned checkpoints (`checkpoint_policy.eviction_key`) until
        `num_states` are freed or none is left; nodes and their K/V stay. Returns the number freed."""
        freed = 0
        while freed < num_states:
            victim = least_useful(self.checkpoint_candidates())
            if victim is None:
                break
            self.drop_checkpoint(victim.handle)
            freed += 1
        return freed

    def thin_checkpoints(self, max_states: int) -> int:
        """Drop the least useful checkpoints until at most `max_states` remain (pinned ones are never
        dropped, so more may remain). Returns the number dropped."""
        return self.evict_checkpoints(max(0, self.num_checkpoints() - max_states))

    def evict(self, num_tokens: int, spill: bool = True) -> int:
        """Evict least-recently-used unlocked leaves until `num_tokens` slots are freed.

        With a `share`, leaves of namespaces over their cap go first (`evict_over_share`), then
        anyone's. A whole leaf goes at a time, so more than `num_tokens` may be freed; a parent that
        becomes an unlocked leaf is a candidate in the same call. Stops early when nothing is
        evictable. Side effects: hands each leaf to `on_evict` first (with `spill`, when there is
        one); frees the evicted slots through `allocator.free`; drops emptied namespace roots.
        Returns the number of slots freed. Raises `ValueError` if `num_tokens < 0`.
        """
        if num_tokens < 0:
            raise ValueError(f"cannot evict {num_tokens} tokens")
        freed = self.evict_over_share(num_tokens, spill)
        return freed + self._evict_lru(num_tokens - freed, spill, lambda namespace: True)

    def evict_over_share(self, num_tokens: int, spill: bool = True) -> int:
        """Phase 1 of `evict` alone: least recently used unlocked leaves of namespaces holding more
        than the share's cap, re-checked after each leaf, until `num_tokens` slots are freed or no
        such leaf is left. Returns the number freed (0 without a share)."""
        if self.share is None or not self.share.enabled or num_tokens <= 0:
            return 0
        return self._evict_lru(num_tokens, spill, self.over_share)

    def over_share(self, namespace: Hashable) -> bool:
        """Whether `namespace` holds more slots than the share's cap (False without a share)."""
        return self.share is not None and self.share.is_over(self.namespace_size(namespace))

    def namespace_size(self, namespace: Hashable) -> int:
        """Slots held by `namespace`'s nodes, locked or not."""
        return self._namespace_sizes.get(namespace, 0)

    def _evict_lru(self, num_tokens: int, spill: bool, eligible: Callable[[Hashable], bool]) -> int:
        """Evict least recently used unlocked leaves whose namespace is `eligible` (asked again as
        each leaf comes up) until `num_tokens` slots are freed; returns the number freed."""
        heap = [(leaf.last_access, leaf.node_id, leaf) for leaf in self._evictable_leaves
                if eligible(leaf.namespace)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            if not eligible(leaf.namespace):
                continue
            parent = leaf.parent
            if spill and self.on_evict is not None:
                path_ids = self.path_ids(leaf)
                self.on_evict(leaf.namespace, path_ids, len(path_ids) - len(leaf), leaf.slots,
                              leaf.state_checkpoint)
            freed += self._remove_leaf(leaf)
            if not parent.is_root and parent in self._evictable_leaves:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def reset(self, namespaces: Callable[[Hashable], bool] | None = None) -> int:
        """Free every unlocked node (for /flush_cache), or only those of the namespaces for which
        `namespaces(namespace)` is true (a tenant's own flush); locked paths stay. Nothing is
        handed to `on_evict`. Returns slots freed.

        Every unlocked node eventually becomes an unlocked leaf (a lock covers all ancestors, so no
        unlocked node has a locked descendant), hence this empties all but the locked paths.
        """
        return self._evict_lru(self._evictable_size, False, namespaces or (lambda namespace: True))

    def locked_slots(self) -> torch.Tensor:
        """The slots of every node an in-flight user has locked (a lock covers a node's whole path
        to the root, so only locked nodes are walked)."""
        parts, stack = [], [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            if node.lock_ref > 0:
                parts.append(node.slots)
                stack.extend(node.children.values())
        return torch.cat(parts) if parts else self._empty_slots()

    @staticmethod
    def path_ids(node: TreeNode) -> TokenKey:
        """The token ids from position 0 to the end of `node` (its path's keys, in order)."""
        keys = [path_node.key for path_node in RadixCache._path_to_root(node)]
        return tuple(token for key in reversed(keys) for token in key)

    def cached_size(self) -> int:
        """Slots held by the tree (all namespaces)."""
        return self._evictable_size + self._protected_size

    def evictable_size(self) -> int:
        """Slots held by unlocked nodes (what `evict` could free)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Slots held by locked nodes."""
        return self._protected_size

    def namespaces(self) -> list[Hashable]:
        """Namespaces that currently hold at least one node."""
        return list(self._roots)

    def pretty_print(self) -> str:
        """The tree as text, one node a line, children sorted by first token (deterministic).

        Format: `ns=<namespace>` per root, then `<indent>[tokens] slots=[...] lock=<n> t=<time>`.
        """
        lines = []
        for namespace in sorted(self._roots, key=lambda ns: (ns is not None, ns or "")):
            lines.append(f"ns={namespace!r}")
            for depth, node in self._iter_subtree(self._roots[namespace]):
                lines.append(f"{'  ' * depth}{list(node.key)} slots={node.slots.tolist()} "
                             f"lock={node.lock_ref} t={node.last_access:g}")
        lines.append(f"cached={self.cached_size()} evictable={self._evictable_size} "
                     f"protected={self._protected_size}")
        return "\n".join(lines)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the tree agrees with its incremental bookkeeping.

        Checks: parent/child links and child keys, one slot per token, no slot held twice, every
        held slot allocated, no empty registered root, a child never more locked than its parent,
        evictable/protected sizes, per-namespace sizes and the evictable-leaf set equal to a full
        recount.
        """
        evictable, protected, leaves, seen_slots, checkpoints = 0, 0, set(), set(), set()
        sizes: dict[Hashable, int] = {}
        for namespace, root in self._roots.items():
            assert root.is_root and root.namespace == namespace and root.children, "bad root"
            for _, node in self._iter_subtree(root):
                sizes[namespace] = sizes.get(namespace, 0) + len(node)
                self._check_node(node, namespace)
                node_slots = node.slots.tolist()
                assert seen_slots.isdisjoint(node_slots), f"a slot is held twice ({node!r})"
                seen_slots.update(node_slots)
                if node.state_checkpoint is not None:
                    checkpoints.add(node)
                if node.lock_ref == 0:
                    evictable += len(node)
                    if not node.children:
                        leaves.add(node)
                else:
                    protected += len(node)
        if seen_slots:
            refcounts = self.allocator.refcount[torch.tensor(sorted(seen_slots))]
            assert bool((refcounts > 0).all()), "the tree holds a free slot"
        assert evictable == self._evictable_size, f"evictable {self._evictable_size} != {evictable}"
        assert protected == self._protected_size, f"protected {self._protected_size} != {protected}"
        assert leaves == self._evictable_leaves, "evictable-leaf set out of date"
        assert sizes == self._namespace_sizes, f"namespace sizes {self._namespace_sizes} != {sizes}"
        assert checkpoints == self._checkpoint_nodes, (
            f"checkpoints {len(self._checkpoint_nodes)} != {len(checkpoints)} found in the tree")

    # ------------------------------------------------------------------ internals

    def _tick(self) -> float:
        return float(next(self._clock))

    @staticmethod
    def _empty_slots() -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    def _new_root(self, namespace: Hashable) -> TreeNode:
        return TreeNode(next(self._node_ids), (), self._empty_slots(), None, namespace, self._tick())

    def _walk(self, root: TreeNode, key: TokenKey) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow `key` from `root`, splitting the last node if the key ends or diverges inside it.

        Returns (deepest fully matched node, matched length, slot tensors of the path). Touches
        every node on the path.
        """
        now = self._tick()
        root.last_access = now
        node, length, matched = root, 0, []
        while length < len(key):
            child = node.children.get(key[length])
            if child is None:
                break
            common = _common_prefix_len(child.key, key, length)
            if common < len(child):
                child = self._split(child, common)
            child.last_access = now
            matched.append(child.slots)
            node, length = child, length + common
        return node, length, matched

    def _split(self, node: TreeNode, offset: int) -> TreeNode:
        """Cut `node` at `offset`: a new parent takes `key[:offset]`; return that new parent.

            before:  parent -> node[key 0..len)
            after:   parent -> prefix[key 0..offset) -> node[key offset..len)

        The prefix inherits `lock_ref` (every lock through `node` also passed through it) and
        `last_access`; `node` stays the same object, so sizes and the evictable-leaf set hold.
        """
        parent = node.parent
        prefix = TreeNode(next(self._node_ids), node.key[:offset], node.slots[:offset],
                          parent, node.namespace, node.last_access)
        prefix.lock_ref = node.lock_ref
        node.key, node.slots, node.parent = node.key[offset:], node.slots[offset:], prefix
        prefix.children[node.key[0]] = node
        parent.children[prefix.key[0]] = prefix
        return prefix

    def _add_leaf(self, parent: TreeNode, key: TokenKey, slots: torch.Tensor) -> None:
        leaf = TreeNode(next(self._node_ids), key, slots, parent, parent.namespace, self._tick())
        parent.children[key[0]] = leaf
        self._evictable_leaves.discard(parent)
        self._evictable_leaves.add(leaf)
        self._evictable_size += len(leaf)
        self._namespace_sizes[leaf.namespace] = self.namespace_size(leaf.namespace) + len(leaf)

    def _remove_leaf(self, leaf: TreeNode) -> int:
        """Detach an unlocked leaf and free its slots; return how many were freed.

        Side effects: the parent becomes an evictable leaf if it is unlocked and now childless; a
        root left without children is dropped from the namespace table.
        """
        parent = leaf.parent
        self.allocator.free(leaf.slots)
        if leaf.state_checkpoint is not None:
            self.drop_checkpoint(leaf)
        del parent.children[leaf.key[0]]
        self._evictable_leaves.discard(leaf)
        self._evictable_size -= len(leaf)
        remaining = self._namespace_sizes.pop(leaf.namespace) - len(leaf)
        if remaining:
            self._namespace_sizes[leaf.namespace] = remaining
        leaf.parent = None  # detached: `_check_attached` rejects it from now on
        if parent.is_root:
            if not parent.children and self._roots.get(parent.namespace) is parent:
                del self._roots[parent.namespace]
        elif not parent.children and parent.lock_ref == 0:
            self._evictable_leaves.add(parent)
        return len(leaf)

    def _check_attached(self, node: TreeNode) -> None:
        """Raise `RuntimeError` unless every link from `node` up to a root is still in the tree."""
        for path_node in self._path_to_root(node):
            parent = path_node.parent
            if parent is None and not path_node.is_root:
                raise RuntimeError(f"{node!r} has been evicted")
            if parent is not None and parent.children.get(path_node.key[0]) is not path_node:
                raise RuntimeError(f"{node!r} is no longer in the tree")

    @staticmethod
    def _path_to_root(node: TreeNode) -> Iterator[TreeNode]:
        while node is not None:
            yield node
            node = node.parent

    @staticmethod
    def _iter_subtree(root: TreeNode) -> Iterator[tuple[int, TreeNode]]:
        """(depth, node) for every non-root node below `root`, depth-first, sorted by first token."""
        stack = [(0, child) for _, child in sorted(root.children.items(), reverse=True)]
        while stack:
            depth, node = stack.pop()
            yield depth, node
            stack.extend((depth + 1, child) for _, child in sorted(node.children.items(), reverse=True))

    def _check_node(self, node: TreeNode, namespace: Hashable) -> None:
        parent = node.parent
        assert node.key and parent is not None, f"empty or orphan node {node!r}"
        assert parent.children.get(node.key[0]) is node, f"child key mismatch at {node!r}"
        assert node.namespace == namespace, f"node {node!r} in namespace {namespace!r}"
        assert node.slots.dtype == torch.int64 and node.slots.numel() == len(node), "slots != key"
        assert node.lock_ref >= 0 and (parent.is_root or parent.lock_ref >= node.lock_ref), (
            f"lock_ref of {node!r} exceeds its parent's")
