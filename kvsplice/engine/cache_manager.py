"""CacheManager: gives requests their KV slots and takes them back (pool + radix tree).

It is the only place that moves slot ownership between the pool, the radix tree and requests.
A request's slots, by offset, once admitted:

    0                prefix_len                               num_slotted
    [ radix hit:     | this request's own slots               ]
      tree-owned,      (computed here, or relocated copies)
      locked path

On finish (`release(req, cache=True)`), with kv_len = tokens that have K/V and exact_len = the
prefix of them that is exact (all of them unless SCR relocated something):

    0           prefix_len       n_present        exact_len            kv_len
    [ tree's    | duplicates of   | handed to the  | approximate:       ]
      (unlock)    tree entries:     tree (insert)    never enters the
                  freed                              tree; handed to the
                                                     SCR session or freed

On abort or preemption (`release(req, cache=False)`) every own slot is freed and the path unlocked.

Hybrid models (a StatePool): a request also holds a working state slot and the checkpoint slots
it fills at the lengths its `CheckpointPolicy` names (message starts, every N tokens). A prefix hit
is cut back to the deepest radix node that has a checkpoint (the state must resume exactly there),
and the working state starts as a copy of it. On finish, checkpoints at lengths <= exact_len, and
the final state when the whole computed sequence is exact, become checkpoints of the matching radix
nodes; the rest is freed. The tree then keeps at most `policy.max_states` of them (the least useful
go first; see `kvsplice.cache.checkpoint_policy`). States an SCR request will load are pinned (one
extra reference each, `pin_loads`) until the request lets go of its states.

Disk tier (`kvsplice.cache.disk_tier`; not with a windowed pool): a radix leaf evicted for room is
copied out of the pool (before its slots are freed) and put into the tier as an exact prefix entry
of its namespace, on a hybrid with the leaf's state checkpoint (the state after its end); the
writer thread writes it. A finished request's exact K/V is put as well, as
it enters the tree (only the pieces the tier lacks), so that a SIGKILL or a crash loses no more than
the requests in flight and the eviction of a piece already stored copies nothing. A match first
takes the radix tree's prefix A, then asks the tier for stored entries continuing the prompt
beyond A; the K/V it loads get fresh slots and enter the radix tree as cached prefix, so the
request (and any later one) hits them:

    prompt      [ A: radix ][ loaded from the tier ][ prefilled ... ]
    req.disk_tokens          <------------------->   (counted within usage.reuse.prefix_tokens)

On a hybrid a loaded entry's checkpoint becomes its radix node's, and the match is cut back to the
deepest checkpoint as for any hit; a finished request's exact states go to the tier with its K/V
(each at the end of an entry cut there). A load that misses (a file gone bad, a namespace
flushed) stops there: the rest is prefilled. The
reads (file, checksum, verification) run on a reader thread from when the request is queued
(`plan_tier_reads`, `kvsplice.engine.tier_reads`); the request is admitted once they are done, and
only the copy into the pool (`extend_from_entries`) runs on the engine thread.

Windowed pool (`kvsplice.cache.window_pool`, models with sliding-window and full layers): a
token's sliding-layer K/V lives in a window slot its full slot carries. Window slots are taken just
before a forward writes the token (`ensure_window`, from the scheduler's chunks and `grow`) and
marked spare as the token leaves every window still to be read (`trim_window`, after each step);
spare windows stay as a cache until a chunk finds no free window slot, then the longest-spare are
given back first (never one a running request reads), before any radix leaf is evicted:

    offsets  0 .. prefix_len (tree's) | own: ... b-W [b) ..........  c - tail_keep [ c = computed ) pending
    window   as the tree keeps them   | trimmed  |kept|  trimmed     |kept: the window of c, and the
                                      |          (checkpoint b)      | tail a finished sequence keeps|

so a running request needs window slots for about tail_keep + its chunk + its checkpoints, and a
finished one enters the tree needing its windows only at message-boundary checkpoints (`WindowKeep`)
and at its end (the others stay while spare room lasts). A prefix hit is cut back to the longest length whose preceding W - 1 tokens kept their
windows (`usable_prefix`); the rest is computed again. The disk tier is not used with this pool (its
entries hold every layer of every token).

Tenant share (`kvsplice.cache.tenant_share`): room for an allocation is made first from the
namespaces over their share (their radix leaves, then their idle SCR sessions through
`release_over_share`, then their leaves again), and only then by plain LRU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Callable, Hashable, Sequence

import torch

from kvsplice.cache.checkpoint_policy import CheckpointPolicy
from kvsplice.cache.disk_tier import DiskTier, DiskTierConfig, kv_from_pool, kv_into_pool
from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.window_pool import WindowedKVPool, WindowKeep, usable_prefix
from kvsplice.cache.radix import PrefixMatch, RadixCache
from kvsplice.cache.state_pool import StatePool
from kvsplice.cache.tenant_share import TenantShare
from kvsplice.cache.tier_format import EntryKey, PrefixHasher, TierEntry, TierIdentity, namespace_name
from kvsplice.engine.request import Namespace, Req, StateReuse
from kvsplice.engine.tier_reads import ReadPlan, TierReads

logger = logging.getLogger(__name__)
WEIGHT_SAMPLE = 4096   # elements of each weight hashed into the disk tier's model identity
TIER_CHUNK_TOKENS = 128   # evicted runs go to the disk tier cut at multiples of this position


def open_disk_tier(tier_config: DiskTierConfig | None, model: torch.nn.Module, model_config,
                   dtype: torch.dtype, engine_config) -> DiskTier | None:
    """The disk tier of `tier_config` for this model (None without one). Its identity names the
    weights by a hash of every parameter's name, shape and a strided sample of its values, with the
    dtype, weight format, fast-path setting and the model config: entries written by any other
    model or setting are discarded at start, never loaded. Its per-namespace share is at most the
    engine's `tenant_kv_share`. On a hybrid model the entries also carry the linear layers' state
    checkpoints (the identity's config hash covers their shapes). None with a windowed pool.
    Raises DiskTierError when the directory cannot be used."""
    if tier_config is None:
        return None
    share = min(tier_config.namespace_share, engine_config.tenant_kv_share)
    tier_config = dataclasses.replace(tier_config, namespace_share=share)
    if uses_window_pool(model_config):
        logger.warning("the KV disk tier %s is not used: %s keeps sliding-window layers in a windowed pool, "
                       "whose layout the tier's entries do not hold", tier_config.dir, model_config.model_type)
        return None
    digest = hashlib.blake2b(digest_size=16)
    for name, param in sorted(model.state_dict().items()):
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // WEIGHT_SAMPLE)][:WEIGHT_SAMPLE].to(torch.float32).cpu()
        digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
        digest.update(sample.numpy().tobytes())
    identity = TierIdentity.of_model(f"weights:{digest.hexdigest()}", model_config, dtype, engine_config.weight_format)
    identity = dataclasses.replace(identity, extra=identity.extra + (("fast_path", str(engine_config.fast_path)),))
    return DiskTier(tier_config, identity)


def uses_window_pool(model_config) -> bool:
    """Whether the engine keeps this model's K/V in a WindowedKVPool: an attention-only model with
    both sliding-window and full layers (a model whose every layer slides keeps the plain pool)."""
    kinds = {model_config.layer_window(layer_id) is None for layer_id in model_config.kv_layers}
    return not model_config.is_hybrid and kinds == {True, False}


def owned_by(namespace: Hashable, owner: str) -> bool:
    """Whether a cache namespace (the engine's `Namespace(owner, cache_salt)`) belongs to `owner`."""
    return isinstance(namespace, Namespace) and namespace.owner == owner


def tier_prefix_of_owner(owner: str) -> str:
    """How the disk tier's name of every namespace of `owner` starts: `namespace_name` is the repr
    of the Namespace, `Namespace(owner='<owner>', cache_salt=...)` (the owner quoted, so no other
    owner's names start the same way)."""
    return namespace_name(Namespace(owner, None)).removesuffix("None)")


class CacheManager:
    """Slot ownership for requests. `prefix_cache=False` turns the radix tree into a null cache
    (nothing matched, nothing inserted) without the scheduler testing a flag. `tier`: the disk
    tier evicted prefixes go to and are loaded from (None: evicted K/V is dropped). `tenant_share`:
    the share of the pool one namespace may hold before its entries are evicted first.

    `release_over_share`: set by the owner of the SCR sessions (the ReuseManager); drops one idle
    session of a namespace over its share and says whether it did (`alloc` calls it before
    evicting anyone else's K/V)."""

    def __init__(self, pool: KVPool, prefix_cache: bool = True, states: StatePool | None = None,
                 policy: CheckpointPolicy | None = None, tier: DiskTier | None = None,
                 tenant_share: float = 1.0):
        self.pool = pool
        self.allocator = pool.allocator
        self.states = states
        self.policy = policy or CheckpointPolicy()
        self.tier = tier if prefix_cache else None
        self.radix = RadixCache(self.allocator, states.allocator if states is not None else None,
                                on_evict=self._spill if self.tier is not None else None,
                                share=TenantShare(pool.num_slots, tenant_share))
        self.prefix_cache = prefix_cache
        self.min_computed = 1   # prompt tokens a prefix hit leaves to compute (see `match`)
        # reads of queued requests, off the engine thread (kvsplice.engine.tier_reads)
        self.reads = TierReads(self.tier, self.tier.config.max_prefetches) if self.tier is not None else None
        self.release_over_share: Callable[[], bool] = lambda: False
        # the running requests (the Engine sets it): their windows are never given back for room
        self.running: Callable[[], Sequence[Req]] = lambda: ()
        self.windows = pool if isinstance(pool, WindowedKVPool) else None
        self.window_keep = (WindowKeep(pool.window, tail_keep=2 * pool.window)
                            if self.windows is not None else None)

    # ----- allocation -------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` fresh slots, evicting unlocked radix leaves if needed (over-share namespaces' first,
        their idle sessions dropped, then anyone's); None if still short."""
        slots = self.allocator.alloc(n)
        if slots is None:
            self.radix.evict_over_share(n - self.allocator.num_free)
            while self.allocator.num_free < n and self.release_over_share():
                self.radix.evict_over_share(n - self.allocator.num_free)
            if self.allocator.num_free < n:
                self.radix.evict(n - self.allocator.num_free)
            slots = self.allocator.alloc(n)
        return slots

    def match(self, req: Req):
        """Longest cached exact prefix usable by `req`: never the last `min_computed` tokens (at
        least one token must be computed to get logits; in bf16, enough that they take the path a
        cold prefill takes, so a cached prompt gives the bits a cold one gives: the Engine sets it
        from `ModelRunner.min_computed_tokens`). No match when prompt logprobs are wanted, since
        those need logits at every prompt position."""
        if not self.prefix_cache or req.wants_prompt_logprobs:
            return self.radix.match_prefix([], req.namespace)
        ids = req.seq_ids[: max(0, req.seq_len - self.min_computed)]
        cached = self._window_cut(ids, req.namespace, self.radix.match_prefix(ids, req.namespace))
        match = self._load_from_tier(req, ids, cached) if self.tier is not None else cached
        if self.states is None:
            req.disk_tokens += match.length - cached.length   # 0 once in the tree (a second match)
            return match
        node, depth = self.radix.deepest_checkpoint(match.node)
        req.state_reuse = StateReuse(radix_match=match.length, checkpoint_depth=depth)
        # a hybrid resumes only at a checkpoint: loaded K/V beyond the deepest one is prefilled again
        req.disk_tokens += max(0, depth - cached.length)
        return PrefixMatch(match.slots[:depth], node, depth)

    def admit(self, req: Req) -> bool:
        """Give `req` slots for its whole known sequence (radix hit + fresh slots for the rest).

        Side effects on success: locks the matched radix path, fills `req.seq_slots`,
        `prefix_len`, `owned_from`, `num_slotted`, `pending`. On failure nothing changes and the
        request stays waiting.
        """
        match = self.match(req)
        self.radix.lock(match.node)  # before alloc: its eviction must not take the matched path
        fresh = self.alloc(req.seq_len - match.length)
        if fresh is None:
            self.radix.unlock(match.node)
            return False
        if not self.admit_state(req, match):
            self.allocator.free(fresh)
            self.radix.unlock(match.node)
            return False
        self.install(req, match, fresh)
        req.pending = list(range(match.length, req.seq_len))
        self.alloc_checkpoints(req)
        return True

    # ----- sliding-window K/V (a windowed pool) ------------------------------------------
    def _window_cut(self, ids: Sequence[int], namespace: Hashable, match: PrefixMatch) -> PrefixMatch:
        """`match` cut back to the longest length whose sliding-layer window is held (`usable_prefix`;
        `match` itself without a windowed pool)."""
        if self.windows is None or match.length == 0:
            return match
        usable = usable_prefix(self.windows.has_window[match.slots], self.windows.window)
        if usable == match.length:
            return match
        return self.radix.match_prefix(ids[:usable], namespace)

    def ensure_window(self, req: Req, offsets: Sequence[int], keep: torch.Tensor | None = None) -> bool:
        """Window slots for `req`'s `offsets` (about to be computed); when short, spare windows are
        given back first (oldest first; never one a running request, `req` or the full slots `keep`
        still read), then unlocked radix leaves are evicted. True without a windowed pool; False
        (nothing taken) when still short."""
        if self.windows is None:
            return True
        slots = req.seq_slots[torch.as_tensor(list(offsets), dtype=torch.int64)]
        if self.windows.ensure_window(slots):
            return True
        needed = self.windows_read([*self.running(), req])
        if keep is not None:
            needed[keep] = True
        self.windows.drop_spare(int(slots.numel()) - self.windows.window_allocator.num_free, needed)
        if self.windows.ensure_window(slots):
            return True
        self.radix.evict(int(slots.numel()))
        return self.windows.ensure_window(slots)

    def windows_read(self, reqs: Sequence[Req]) -> torch.Tensor:
        """Bool per full slot: the windows some of `reqs` may still read (from W before its first
        offset still to compute to its end; prefix slots the tree shares included)."""
        needed = torch.zeros(self.windows.num_slots, dtype=torch.bool)
        for req in reqs:
            if req.seq_slots is not None:
                needed[req.seq_slots[max(0, self.computed_len(req) - self.windows.window):req.num_slotted]] = True
        return needed

    def trim_window(self, req: Req) -> int:
        """Mark spare the windows of `req`'s own tokens that left every window still to be read:
        own offsets below computed_len - tail_keep, except the windows of its checkpoints (see the
        module diagram). Spare windows stay as a cache until `ensure_window` is short of room.
        Incremental (`req.window_trimmed`). Returns how many became spare."""
        if self.windows is None or req.seq_slots is None:
            return 0
        keep = self.window_keep
        limit = self.computed_len(req) - keep.tail_keep
        start = max(req.owned_from, req.window_trimmed)
        if limit <= start:
            return 0
        if req.window_checkpoints is None:
            lengths = self.policy.lengths(len(req.prompt_ids), req.message_offsets) if self.prefix_cache else []
            req.window_checkpoints = keep.checkpoints(lengths)
        dropped = torch.ones(limit - start, dtype=torch.bool)
        for kept in keep.protected(req.window_checkpoints):
            lo, hi = max(kept.start, start), min(kept.stop, limit)
            if lo < hi:
                dropped[lo - start: hi - start] = False
        req.window_trimmed = limit
        return self.windows.mark_spare(req.seq_slots[start:limit][dropped])

    # ----- the disk tier -----------------------------------------------------------------
    def _spill(self, namespace: Hashable, token_ids: Sequence[int], start: int, slots: torch.Tensor,
               state_slot: int | None = None) -> None:
        """The radix tree's eviction hook: the evicted leaf (positions start..end of `token_ids`,
        K/V in `slots`; on a hybrid `state_slot`, its checkpoint: the state after its end) goes
        to the tier (`_put_run`) before its slots and checkpoint are freed."""
        states = {len(token_ids): state_slot} if state_slot is not None and self.states is not None else {}
        self._put_run(namespace, token_ids, start, slots, states)

    def _put_run(self, namespace: Hashable, token_ids: Sequence[int], start: int, slots: torch.Tensor,
                 states: dict[int, int], also_cut_at: int | None = None) -> None:
        """Positions start..end of `token_ids` (K/V in `slots`) as exact entries, cut at every
        multiple of TIER_CHUNK_TOKENS, at `also_cut_at` and at every length of `states` (a hybrid's
        exact states {sequence length: state slot}): the entry ending at such a length carries that
        state (`StatePool.snapshot`), the only place a hybrid can resume from. The K/V (and states)
        of the pieces the tier does not hold yet (or holds without the state this one brings) are
        copied out now (the slots may be freed right after) and written later. An entry serves a
        match only up to its end, so the cuts let a later prompt that stops inside the run (the
        same prompt without the reply it got) load all but its last partial chunk.

            ids     0 ........ start [ lo0 | lo1=128 | ... | message start m | ... | end ]
            entry   (key: hash chain of ids[:hi])  ids[:hi], kv of lo..hi, state at hi when m = hi
        """
        ids = torch.as_tensor(token_ids, dtype=torch.int64)
        name = namespace_name(namespace)
        cuts = {start, *range((start // TIER_CHUNK_TOKENS + 1) * TIER_CHUNK_TOKENS, len(ids), TIER_CHUNK_TOKENS), len(ids)}
        cuts |= {length for length in (*states, also_cut_at) if length is not None and start < length < len(ids)}
        cuts = sorted(cuts)
        hasher = PrefixHasher().update(ids[:start])
        for lo, hi in zip(cuts, cuts[1:]):
            key = EntryKey(name, hasher.update(ids[lo:hi]).hexdigest())
            state = states.get(hi)
            if self.tier.contains(key) and (state is None or self.tier.has_states(key)):
                continue
            snapshot = self.states.snapshot(state) if state is not None else {}
            self.tier.put(TierEntry(key, ids[:hi], lo, kv_from_pool(self.pool, slots[lo - start: hi - start]), snapshot))

    def _write_through(self, namespace: Hashable, ids: Sequence[int], slots: torch.Tensor, prompt_len: int,
                       states: dict[int, int]) -> None:
        """A finished request's exact K/V (`ids`, in `slots`, just inserted into the radix tree; on
        a hybrid its exact `states`, by sequence length) into the tier as well, so that a SIGKILL
        loses no more than the turns in flight: the pieces of the spill's cuts the tier does not
        hold yet (an earlier turn's are skipped by key, with no copy), with one more cut at the
        prompt's end. The next turn of a chat resends this prompt but not the reply's exact tokens
        (a client re-renders it), so that cut is where it diverges. On a hybrid the checkpoints the
        tree holds on the path (an earlier turn's, which this request resumed after) are cut at
        too: an entry running across one would shadow, in a chain, the stored entry ending there
        with its state."""
        if not len(ids):
            return
        if self.states is not None:
            path = self.radix.path_checkpoints(self.radix.match_prefix(ids, namespace).node)
            states = {**path, **states}
        self._put_run(namespace, ids, 0, slots, states, also_cut_at=prompt_len)

    def _exact_states(self, req: Req, exact_len: int) -> dict[int, int]:
        """`req`'s states at lengths 0 < p <= exact_len, {p: state slot} (its filled checkpoints
        and its working state at the computed length), still held by `req`; {} without states."""
        if self.states is None or req.state_slot is None:
            return {}
        states = {length: slot for length, slot in req.ckpt_slots.items() if 0 < length <= exact_len}
        kv_len = self.computed_len(req)
        if 0 < kv_len <= exact_len:
            states[kv_len] = req.state_slot
        return states

    def plan_tier_reads(self, req: Req, session_key: EntryKey | None = None) -> ReadPlan | None:
        """What the reader thread should read for `req` (`kvsplice.engine.tier_reads`): the tier's
        entries continuing its prompt beyond what the radix tree holds now (on a hybrid, beyond
        its deepest checkpoint there: a stored state deeper than that is worth a read even where
        the tree holds the K/V), and `session_key` (a named session to restore); None when there
        is nothing to read. Index look-ups only."""
        if self.tier is None or req.wants_prompt_logprobs:
            return None
        ids = req.seq_ids[: req.seq_len - 1]
        cached = self.radix.match_prefix(ids, req.namespace)
        start = cached.length if self.states is None else self.radix.deepest_checkpoint(cached.node)[1]
        name = namespace_name(req.namespace)
        found = self.tier.match_prefix(name, ids, start_pos=start)
        states_beyond = self.states is not None and any(
            self.tier.has_states(key) for key, end in zip(found.keys, found.ends) if end > start)
        if session_key is None and found.length <= cached.length and not states_beyond:
            return None
        # attention-only: the chain is read from the prompt's start, not from the tree's match now,
        # since until admission the tree may evict part of that match (a chain from there would
        # then not continue what is left of it, and none of it could be used)
        return ReadPlan(name, tuple(ids), 0 if self.states is None else start, session_key, req.session_id)

    def _load_from_tier(self, req: Req, ids: Sequence[int], match: PrefixMatch) -> PrefixMatch:
        """`match` extended by the entries the reader thread read for `req` (`extend_from_entries`).
        Never reads a file on this thread."""
        return self.extend_from_entries(ids, req.namespace, match, self.reads.result(req.rid).prefix)

    def extend_from_entries(self, ids: Sequence[int], namespace: Hashable, match: PrefixMatch,
                            entries: Sequence[TierEntry]) -> PrefixMatch:
        """`match` (the radix tree's match of `ids`) extended by `entries` (a chain read from the
        tier, `tier_reads.read_chain`): each entry that continues the covered run and whose token
        ids equal `ids` up to its end is copied into fresh slots, the run enters the radix tree as
        cached prefix, and `ids` is matched again. `match` itself when no entry continues it (the
        tree has grown past them, or shrunk below their start) or the pool has no room.

            ids      [ match (radix, locked) ][ e0 ........ ][ e1 ....... ][ rest: prefilled ]
            entry e   start_e ... covered ... end_e     (only covered..end_e is copied)
            slots    [ match.slots            ][ fresh = alloc(covered_end - match.length)    ]
                       kv_into_pool(fresh[covered - match.length : end_e - match.length],
                                    e.kv[:, :, covered - start_e : end_e - start_e])
            then     radix.insert(ids[:covered_end], match.slots + fresh): the tree owns them
                     (any it had already are freed: none, the path is locked), radix unlocked

        On a hybrid, each entry's state checkpoint (the state after its end) becomes the checkpoint
        of the radix node ending there (`_load_checkpoint`), also for an entry whose K/V the tree
        holds already (a checkpoint the tree thinned away comes back); a match is then cut back to
        the deepest checkpoint as for any hit, so K/V loaded without a state beyond it is prefilled.
        """
        pieces, held, covered = [], [], match.length
        for entry in entries:
            if entry.end_pos <= covered:
                held += [entry] if self.states is not None and _tokens_equal(entry, ids) else []
                continue
            # attention-only: an entry running past `ids` (the match leaves the last min_computed
            # tokens to compute) gives its K/V up to there; a hybrid's only with the state at its end
            end = entry.end_pos if self.states is not None else min(entry.end_pos, len(ids))
            if entry.start_pos > covered or end <= covered or not _tokens_equal(entry, ids, end):
                break
            pieces.append((entry, covered, end))
            covered = end
        restored = sum(self._load_checkpoint(ids, namespace, entry) for entry in held)
        if not pieces:
            return self.radix.match_prefix(ids, namespace) if restored else match
        self.radix.lock(match.node)   # the room made for the loaded K/V must not evict the match
        slots = self.alloc(covered - match.length)
        if slots is None:
            self.radix.unlock(match.node)
            return match
        for entry, start, end in pieces:
            kv = entry.kv[:, :, start - entry.start_pos: end - entry.start_pos]
            kv_into_pool(self.pool, slots[start - match.length: end - match.length], kv)
        n_present = self.radix.insert(ids[:covered], torch.cat([match.slots, slots]), namespace)
        self.allocator.free(slots[: max(0, n_present - match.length)])   # none: the path is locked
        if self.states is not None:
            for entry, _, _ in pieces:
                self._load_checkpoint(ids, namespace, entry)
        self.radix.unlock(match.node)
        return self.radix.match_prefix(ids, namespace)

    def _load_checkpoint(self, ids: Sequence[int], namespace: Hashable, entry: TierEntry) -> bool:
        """The state checkpoint `entry` carries into a fresh state slot, set on the radix node that
        ends at `entry.end_pos` (`ids[:end]` must be in the tree). False, with nothing taken, when
        the entry has none or one of another layout (`StatePool.fits`), the node has one already,
        or no state slot can be had (may drop the tree's least useful checkpoint for room)."""
        if not entry.states or not self.states.fits(entry.states):
            return False
        found = self.radix.match_prefix(ids[: entry.end_pos], namespace)
        if found.length != entry.end_pos or found.node.state_checkpoint is not None:
            return False
        slot = self.alloc_state()
        if slot is None:
            return False
        self.states.restore(slot, entry.states)
        self.radix.set_checkpoint(found.node, slot)
        return True

    # ----- flushes ------------------------------------------------------------------------
    def flush(self, owner: str | None = None) -> None:
        """Drop every unlocked radix entry and every disk tier entry; with `owner`, only those of
        that tenant's namespaces (each of its cache_salts). Locked paths (running requests, SCR
        sessions) stay; release idle sessions first to drop theirs."""
        if owner is None:
            self.radix.reset()
            if self.tier is not None:
                self.tier.flush()
            return
        self.radix.reset(lambda namespace: owned_by(namespace, owner))
        if self.tier is not None:
            prefix = tier_prefix_of_owner(owner)
            for name in self.tier.namespaces():
                if name.startswith(prefix):
                    self.tier.flush(name)

    # ----- linear-layer states (hybrid models) --------------------------------------------
    def admit_state(self, req: Req, match: PrefixMatch) -> bool:
        """Give `req` a working state slot (evicting radix checkpoints if needed) initialised from
        the checkpoint at `match.node`, or zeros. True without a StatePool; False when no slot.
        The checkpoint is pinned (one more reference) while a slot is found, so the room made
        for the slot never drops the very state it is to copy."""
        if self.states is None:
            return True
        source = match.node.state_checkpoint if match.length else None
        if source is not None:
            self.states.allocator.incref(torch.tensor([source], dtype=torch.int64))
        slot = self.alloc_state()
        if slot is not None and source is not None:
            self.states.copy(source, slot)
        elif slot is not None:
            self.states.zero(slot)
        if source is not None:
            self.states.free([source])
        if slot is None:
            return False
        req.state_slot = slot
        return True

    def alloc_state(self) -> int | None:
        """One state slot, dropping the tree's least useful checkpoint once if none is free."""
        slot = self.states.alloc_one()
        if slot is None and self.radix.evict_checkpoints(1):
            slot = self.states.alloc_one()
        return slot

    def alloc_checkpoints(self, req: Req) -> None:
        """Best effort: a slot for the state at every length p the policy names for `req`
        (`CheckpointPolicy.lengths`: message starts, the prompt's end, multiples of `every`) whose
        last token (offset p - 1) this request computes, at most `policy.max_states` of them (may
        drop the tree's least useful checkpoints to make room). None without the prefix cache:
        nothing would keep them."""
        if self.states is None or not self.prefix_cache:
            return
        computed = set(req.pending)
        lengths = [p for p in self.policy.lengths(len(req.prompt_ids), req.message_offsets) if p - 1 in computed]
        for length in lengths[: self.policy.max_states]:
            slot = self.alloc_state()
            if slot is None:
                return
            req.ckpt_slots[length] = slot

    def pin_loads(self, req: Req) -> None:
        """Add a reference to every state `req` will load (`req.splice_loads`), so that no thinning
        frees one before the request has used it; `take_states` drops them."""
        for slot in req.splice_loads.values():
            self.states.allocator.incref(torch.tensor([slot], dtype=torch.int64))

    def take_states(self, req: Req) -> dict[int, int]:
        """Hand `req`'s states over to the caller: {sequence length: state slot}, its checkpoints
        and its final working state (at the computed length). The request holds none after."""
        states = dict(req.ckpt_slots)
        if req.state_slot is not None:
            kv_len = self.computed_len(req)
            if kv_len in states:
                self.states.free([states.pop(kv_len)])
            states[kv_len] = req.state_slot
        for slot in req.splice_loads.values():   # the pins of `pin_loads`
            self.states.free([slot])
        req.state_slot, req.ckpt_slots, req.splice_loads = None, {}, {}
        return states

    def checkpoint_exact_states(self, ids: list[int], namespace, states: dict[int, int], exact_len: int) -> None:
        """Hand the states at lengths 0 < p <= exact_len to the radix tree as checkpoints of the
        nodes ending at p (`ids[:exact_len]` must be in the tree), free those it cannot take (it
        already has one there), then thin the tree to `policy.max_states`. Returns nothing; the
        states at other lengths stay the caller's."""
        for length, slot in sorted(states.items()):
            if not 0 < length <= exact_len:
                continue
            match = self.radix.match_prefix(ids[:length], namespace)
            if match.length == length and match.node.state_checkpoint is None:
                self.radix.set_checkpoint(match.node, slot)
            else:
                self.states.free([slot])
        self.radix.thin_checkpoints(self.policy.max_states)

    def _release_states(self, req: Req, cache: bool, ids: list[int], exact_len: int) -> None:
        if self.states is None or req.state_slot is None:
            return
        states = self.take_states(req)
        if cache and self.prefix_cache:
            self.checkpoint_exact_states(ids, req.namespace, states, exact_len)
            states = {length: slot for length, slot in states.items() if not 0 < length <= exact_len}
        self.states.free(list(states.values()))

    def install(self, req: Req, match, fresh: torch.Tensor) -> None:
        """Point `req` at its (already locked) radix hit followed by `fresh` slots for the rest
        of its known sequence."""
        capacity = len(req.prompt_ids) + req.params.max_tokens
        req.seq_slots = torch.empty(capacity, dtype=torch.int64)
        req.seq_slots[: match.length] = match.slots
        req.seq_slots[match.length: req.seq_len] = fresh
        req.prefix_len = req.owned_from = match.length
        req.prefix_node = match.node
        req.num_slotted = req.seq_len

    def grow(self, req: Req) -> bool:
        """Give `req` a slot for its newest token (decode); False if the pool is exhausted."""
        if req.num_slotted >= req.seq_len:
            return True
        slots = self.alloc(req.seq_len - req.num_slotted)
        if slots is None:
            return False
        req.seq_slots[req.num_slotted: req.seq_len] = slots
        if not self.ensure_window(req, range(req.num_slotted, req.seq_len)):
            self.allocator.free(slots)
            return False
        req.num_slotted = req.seq_len
        return True

    # ----- release ----------------------------------------------------------------------
    def release(self, req: Req, cache: bool, exact_len: int | None = None,
                taken_states: dict[int, int] | None = None) -> torch.Tensor:
        """Take back `req`'s slots (see the module diagram).

        With `cache`, the exact K/V (offsets < exact_len, default all computed ones) is inserted
        into the radix tree (and written through to the disk tier, on a hybrid with the exact
        states: `req`'s own, or `taken_states` when the caller took them already, `take_states`;
        they stay the caller's). Returns the slots of the approximate part [exact_len, kv_len), which
        the caller now owns (an SCR session keeps them; otherwise free them). Idempotent per
        request: clears `seq_slots` and the lock.
        """
        kv_len = self.computed_len(req)
        own = req.seq_slots[req.owned_from: req.num_slotted]
        leftover = torch.empty(0, dtype=torch.int64)
        exact_len = kv_len if exact_len is None else min(exact_len, kv_len)
        ids = req.seq_ids[:exact_len]
        if cache and self.prefix_cache and kv_len > 0:
            n_present = self.radix.insert(ids, req.seq_slots[:exact_len], req.namespace)
            if self.tier is not None:
                states = self._exact_states(req, exact_len) if taken_states is None else {
                    length: slot for length, slot in taken_states.items() if 0 < length <= exact_len}
                self._write_through(req.namespace, ids, req.seq_slots[:exact_len], len(req.prompt_ids), states)
            dup_end = max(n_present, req.owned_from)
            self.allocator.free(req.seq_slots[req.owned_from: dup_end])
            leftover = req.seq_slots[max(exact_len, req.owned_from): kv_len].clone()
            self.allocator.free(req.seq_slots[kv_len: req.num_slotted])
        else:
            self.allocator.free(own)
        self._release_states(req, cache and kv_len > 0, ids, exact_len)
        if req.prefix_node is not None:
            self.radix.unlock(req.prefix_node)
        req.seq_slots, req.prefix_node, req.num_slotted, req.pending = None, None, 0, []
        req.window_trimmed, req.window_checkpoints = 0, None
        return leftover

    @staticmethod
    def computed_len(req: Req) -> int:
        """Number of leading offsets whose K/V is valid (stops at the first pending offset)."""
        if req.seq_slots is None:
            return 0
        return req.pending[0] if req.pending else req.num_slotted

    # ----- bookkeeping ------------------------------------------------------------------
    def held_by(self, reqs: list[Req]) -> int:
        """Slots owned by these requests (not by the tree)."""
        return sum(r.num_slotted - r.owned_from for r in reqs if r.seq_slots is not None)

    def check_integrity(self, running: list[Req], private: int = 0, private_states: int = 0) -> None:
        """free + cached + in-use (requests + SCR private) == total, for KV slots and, on a
        hybrid, for state slots (requests' working and checkpoint slots + sessions' states);
        raises AssertionError."""
        in_use = self.held_by(running) + private
        self.allocator.check_integrity(cached=self.radix.cached_size(), in_use=in_use)
        if self.windows is not None:
            self.windows.check_integrity()
        if self.states is not None:
            held = sum((r.state_slot is not None) + len(r.ckpt_slots) for r in running)
            self.states.check_integrity(cached=self.radix.num_checkpoints(), in_use=held + private_states)


def _tokens_equal(entry: TierEntry, ids: Sequence[int], end: int | None = None) -> bool:
    """Whether `entry`'s token ids up to `end` (its end_pos when None) are `ids[:end]` (checked again
    on the engine thread: the entry was read for this prompt, but may be held across a preemption)."""
    end = entry.end_pos if end is None else end
    if end > len(ids):
        return False
    return bool(torch.equal(entry.token_ids[:end], torch.as_tensor(ids[:end], dtype=torch.int64)))
