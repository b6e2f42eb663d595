"""ReuseManager: where a request's prompt K/V comes from, and what is kept when it finishes.

Plain prefix caching: the radix tree serves the longest exact prefix A; the rest is prefilled.
Suffix Cache Reuse (SCR), for requests whose reuse config enables it:

    previous sequence  [ A ][ B  ][ C1 ][ x ][ C2 ][ old completion ]      (session.token_ids)
    new prompt         [ A ][ B' ][ C1 ][ C2 ][ D ]
                         |          |     |
                       radix     relocated spans (copied from the session's slots, keys
                       (exact)   re-rotated by delta), minus each span's last `tail` tokens
    computed in one forward: B', span tails, unchosen spans, D

A session keeps its previous sequence's K/V without a second copy: the exact part
[0, exact_len) stays in the radix tree under a lock the session holds; the approximate part
[exact_len, kv_len) (relocated, or computed after a relocated entry) lives in slots private to
the session and never enters the tree. On finish only the exact part of the new sequence is
inserted into the tree; the session then swaps its old K/V for the new.

Any failure (no session, no plan, no slots after eviction) falls back to plain prefix caching,
with the reason recorded in the request's ReuseStats. So does an exception while planning
(session match, prefix match, diff, plan, validation: fallback "error", logged with its
traceback), since planning takes no slot and prefix caching serves the prompt exactly. An
exception once slots are taken (allocation, relocation) propagates: the engine fails the request
and frees what it holds. A request for
prompt logprobs computes every position (fallback "prompt_logprobs") but still updates its session.

Disk tier (when the engine has one): a session that a client named puts its own K/V (private, or
its last completion's when all is exact) into the tier (an approximate entry only its id loads)
after every turn, and when it is dropped for room if the tier holds none of it; a request naming a
session that is gone (dropped, or lost with a restart) restores it before matching
(`_restore_session`) from what the reader thread read of it while the request was queued
(`start_tier_reads`, `kvsplice.engine.tier_reads`). On a hybrid the entry carries the session's
states after its split too (the state at its end always), and they come back with it.

Selective recompute (attention-only models; see kvsplice.reuse.recompute): after relocation the
first `seam_tokens` of every span and the message openings inside the edited spans are added to the
offsets to compute, chosen at admission, so the counters are final from there on.

Hybrid models: full-attention layers relocate as above; linear layers cannot (their state is not
per token), so they compute the same offsets in order, segment by segment, and before each
segment that follows relocated tokens their state is replaced according to `state_mode`:

    new prompt   [ A: radix, from a checkpoint ][ B' ][ relocated span ][ tail, C2 .. ][ relocated ][ D ]
    linear state   copy of the checkpoint  ->  run  ->  load  ->  run    ->  load  ->  run
    fork:        load = the previous sequence's final state
    checkpoint:  load = the saved state nearest before the span's old end (the session's own, or
                 an exact checkpoint on the session's locked radix path)
    none:        no load (the relocated tokens are simply skipped)

The exact states of a finished sequence (lengths <= exact_len: message starts, every N tokens, the
final state when nothing was relocated) become radix checkpoints, which the session finds on its
locked path; only the approximate ones (after the first relocated token) are the session's own. A
state a request will load is pinned until the request ends, so thinning never frees it under it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable, Hashable, NamedTuple

import torch

from kvsplice.cache.checkpoint_policy import least_useful, sequence_candidates
from kvsplice.cache.disk_tier import kv_from_pool, kv_into_pool
from kvsplice.cache.state_pool import pack_states, unpack_states
from kvsplice.cache.tier_format import EntryKey, TierEntry, namespace_name
from kvsplice.cache.radix import PrefixMatch
from kvsplice.engine.cache_manager import CacheManager
from kvsplice.engine.request import Req, StateReuse
from kvsplice.engine.tier_reads import common_prefix_len
from kvsplice.layers.fused_turn import KeyTurner
from kvsplice.layers.rotary_move import turn_layer_keys_
from kvsplice.models.config import ModelConfig
from kvsplice.reuse.accounting import FlopsModel, ReuseStats, SessionKind
from kvsplice.reuse.config import ReuseConfig, SettingError, parse_request_override
from kvsplice.reuse.diff import diff_tokens
from kvsplice.reuse.plan import (Keep, PlanResult, SpanPlan, make_plan, prefill_breakdown, removed_before,
                                 removed_spans)
from kvsplice.message_offsets import MessageStarts
from kvsplice.reuse.recompute import in_edited_keeps, seam_offsets
from kvsplice.reuse.relocate import relocate_spans
from kvsplice.reuse.scr_request import ScrRequest
from kvsplice.reuse.session import Session, SessionStore

logger = logging.getLogger(__name__)


# A content match keeping less than this share of the session's sequence forks (see _attach_session).
FORK_BELOW_COVERAGE = 0.5


class WindowMoves(NamedTuple):
    """What `_relocate_windows` did in a windowed pool's sliding layers: offsets it added to the
    computed ones (their old window was gone) and offsets whose K/V it relocated there."""

    recomputed: int
    relocated: int


@dataclass
class SessionKV:
    """The pool resources behind a session's previous sequence: `exact_slots` on a radix path
    locked by the session (`exact_node`), then `private_slots` it owns outright."""

    exact_node: object
    exact_slots: torch.Tensor
    private_slots: torch.Tensor
    states: dict[int, int] = field(default_factory=dict)   # hybrids: {old length: state slot}

    def slots(self) -> torch.Tensor:
        return torch.cat([self.exact_slots, self.private_slots])


class ReuseManager:
    def __init__(self, cache: CacheManager, model_config: ModelConfig, config: ReuseConfig,
                 rotary=None, failpoints=None, message_starts: MessageStarts | None = None,
                 window_rotary=None, key_turner: KeyTurner = turn_layer_keys_):
        self.cache = cache
        self.key_turner = key_turner   # turns relocated keys: eager, or kvsplice.layers.fused_turn
        self.window_rotary = window_rotary   # a windowed pool: the sliding layers' RoPE
        self.message_starts = message_starts   # finds message openings for selective recompute
        self.failpoints = failpoints   # tests: kvsplice.engine.failpoints.Failpoints, or None
        self.model_config = model_config
        self.config = config
        self.rotary = rotary
        self.sessions = SessionStore(config)
        self.flops = FlopsModel(model_config.num_layers, model_config.hidden_size, model_config.num_heads,
                                model_config.head_dim, model_config.num_params_non_embedding,
                                model_config.vocab_size, attention_layers=model_config.num_kv_layers)
        self.fallbacks: dict[str, int] = {}
        self.sessions_evicted_for_memory = 0
        self.sessions_restored = 0   # sessions whose private K/V came back from the disk tier
        cache.release_over_share = self._drop_one_over_share_session

    def request_config(self, scr: str | dict | None, cache_salt: str | None) -> ScrRequest | None:
        """The request's SCR state, or None when SCR is off for it (globally, by its `scr`
        field, by a "kvreuse:off" salt, or because the prefix cache is off). Raises ValueError
        for a malformed `scr` field."""
        cfg = parse_request_override(scr, cache_salt, self.config)
        asked = [key for key in ("seam_tokens", "removed_seam_tokens", "message_start_tokens")
                 if isinstance(scr, dict) and scr.get(key, 0)]
        if asked and self.cache.states is not None:
            raise SettingError(f"scr.{asked[0]}: selective recompute needs a model whose every layer is "
                               "attention, and this one is a hybrid", f"scr.{asked[0]}")
        if not cfg.enabled or not self.cache.prefix_cache:
            return None
        return ScrRequest(cfg)

    # ----- admission --------------------------------------------------------------------
    def admit(self, req: Req, update_stats: bool) -> bool:
        """Give `req` its slots (SCR plan + relocation when possible, else prefix caching);
        with `update_stats`, record where its prompt came from. False: no slots now (the request
        keeps waiting; nothing changed except session bookkeeping)."""
        admitted = self._admit(req, update_stats)
        if admitted:
            self.end_tier_reads(req)   # what they read is in the pool now (or not wanted)
        if admitted and update_stats:
            req.reuse = dataclasses.replace(self._with_flops(req),
                                            disk_tokens=min(req.disk_tokens, req.reuse.prefix_tokens))
        return admitted

    # ----- disk tier reads (kvsplice.engine.tier_reads) ------------------------------------
    def start_tier_reads(self, req: Req) -> None:
        """Start reading, off the engine thread, what `req` may load from the disk tier: its
        prompt's continuation beyond the radix tree and, when it names a session the engine no
        longer holds but the tier does, that session. Nothing without a tier; retried by
        `tier_ready` when too many requests hold reads (a request with nothing to read never
        waits for that)."""
        reads = self.cache.reads
        if reads is None or req.tier_reads_started:
            return
        session_key = None
        if req.scr is not None and req.session_id is not None and self.sessions.get(req.namespace, req.session_id) is None:
            key = EntryKey.for_session(namespace_name(req.namespace), req.session_id)
            session_key = key if self.cache.tier.contains(key) else None
        req.tier_reads_started = reads.start(req.rid, self.cache.plan_tier_reads(req, session_key))

    def tier_ready(self, req: Req) -> bool:
        """Whether waiting `req` may be admitted now: its tier reads (started now if they could
        not be before) are done. True without a tier."""
        if self.cache.reads is None:
            return True
        if req.tier_reads_started and not self.cache.reads.holds(req.rid):
            # queued with nothing to read (the tree held its prefix then): the tree may have evicted
            # part of it since, into the tier, so look again (index look-ups only)
            req.tier_reads_started = False
        self.start_tier_reads(req)
        return req.tier_reads_started and self.cache.reads.ready(req.rid)

    def end_tier_reads(self, req: Req) -> None:
        """Drop `req`'s tier reads (admitted or gone); a re-admission (after a preemption) reads anew."""
        if self.cache.reads is not None:
            self.cache.reads.drop(req.rid)
        req.tier_reads_started = False

    def _admit(self, req: Req, update_stats: bool) -> bool:
        scr = req.scr
        if scr is None:
            return self._admit_plain(req, update_stats, "off", PlanResult(None, None, None))
        try:
            match, result = self._plan(req, scr)
        except Exception:  # noqa: BLE001 -- planning holds no slot: prefix caching is exact and safe
            logger.exception("request %s: SCR planning failed; served by prefix caching", req.rid)
            self._count_fallback("error")
            return self._admit_plain(req, update_stats, scr.kind, PlanResult(None, "error", None))
        if result.plan is None:
            return self._admit_plain(req, update_stats, scr.kind, result)
        return self._admit_scr(req, scr, match, result, update_stats)

    def _plan(self, req: Req, scr: ScrRequest) -> tuple[PrefixMatch | None, PlanResult]:
        """The request's session (attached once), its exact prefix, the diff and the validated
        plan; a PlanResult without a plan (and its reason) when SCR cannot serve it. Takes no slot
        and no lock (only the session's in-flight mark, which `forget` ends)."""
        self._failpoint("match", req)
        if scr.session is None:
            self._attach_session(req, scr)
        if req.wants_prompt_logprobs:
            # the logprob of prompt token o + 1 needs the logits at offset o, for every o: each
            # position is computed, so none can come from the radix tree or be relocated. The turn
            # still belongs to its session (all its K/V is exact), so the next turn can relocate.
            return None, PlanResult(None, "prompt_logprobs", None)
        session = scr.session
        if session.payload is None:
            # a new session says why nothing matched; a matched one whose K/V is not there yet
            # (its previous turn still running) says so
            reason = scr.miss if scr.kind == "new" else "session_has_no_kv"
            return None, PlanResult(None, reason, None)
        old_ids = session.token_ids
        match = self.cache.match(req)
        self._failpoint("diff", req)
        # the match's own diff when the session still holds the sequence it was computed against
        runs = scr.runs if scr.runs is not None and scr.runs_of is old_ids else diff_tokens(
            old_ids, req.prompt_ids, fastdiff_min=scr.cfg.fastdiff_min, cdc_target=scr.cfg.cdc_target)
        self._failpoint("plan", req)
        result = make_plan(old_ids, req.prompt_ids, runs, prefix_len=match.length,
                           old_kv_len=len(old_ids), cfg=scr.cfg)
        if result.plan is not None and self.cache.states is not None:
            result = self._hybrid_plan(result, old_ids, req.prompt_ids, runs, scr.cfg, req.state_reuse.radix_match)
        if result.plan is not None:
            result.plan.validate(old_ids, req.prompt_ids, len(old_ids))
        return match, result

    def _failpoint(self, stage: str, req: Req) -> None:
        if self.failpoints is not None:
            self.failpoints.check(stage, [req.rid])

    def _with_flops(self, req: Req) -> ReuseStats:
        """req.reuse with the prefill FLOPs spent on the offsets it computes, and saved."""
        prompt_len = len(req.prompt_ids)
        pending = [o for o in req.pending if o < prompt_len]
        ranges, start = [], None
        for prev, offset in zip([None] + pending, pending):
            if prev is None or offset != prev + 1:
                if start is not None:
                    ranges.append((start, prev + 1))
                start = offset
        if start is not None:
            ranges.append((start, pending[-1] + 1))
        spent = self.flops.prefill_flops(prompt_len, ranges)
        saved = self.flops.prefill_flops(prompt_len, [(0, prompt_len)]) - spent
        return dataclasses.replace(req.reuse, prefill_flops=spent, saved_flops=saved)

    def _attach_session(self, req: Req, scr: ScrRequest) -> None:
        """Attach the session the request verifiably continues (explicit id or content match),
        else a new one; only an attached session is ever updated with the request's K/V.

        A content match that does not continue the session's previous prompt forks when the
        session holds no private K/V (its previous turn was all exact: typically a conversation's
        first turn) or the prompt keeps less than FORK_BELOW_COVERAGE of its sequence: the request
        relocates from it, but its K/V go to a new session and the matched one keeps its own.
        Those are the matches content cannot attribute for sure: a young session is mostly what
        it shares with every conversation of its application (a system prompt that may vary in
        its first tokens, not yet known to be common while few sessions hold it), and a prompt
        keeping little of a session may be another conversation that shares a document with it.
        Forking costs at most a stale session until eviction; taking over would cost the other
        conversation its K/V."""
        cfg = scr.cfg
        if req.session_id is not None and self.sessions.get(req.namespace, req.session_id) is None:
            self._restore_session(req)
        found = self.sessions.match(
            req.prompt_ids, req.namespace, req.session_id,
            diff=lambda old, new: diff_tokens(old, new, fastdiff_min=cfg.fastdiff_min, cdc_target=cfg.cdc_target))
        if found.session is not None:
            scr.session, scr.kind = found.session, "matched"
            scr.runs, scr.runs_of = found.runs, found.session.token_ids
            scr.fork = found.reason == "matched" and not found.continues and (
                found.session.private_tokens == 0 or found.coverage < FORK_BELOW_COVERAGE)
        else:
            scr.session, scr.kind, scr.miss = self.sessions.create(req.namespace), "new", found.reason
            self._count_fallback(found.reason)
        self.sessions.begin(scr.session)   # in flight: never evicted from here on
        self._free_sessions(self.sessions.evict_over_limits())

    def _admit_plain(self, req: Req, update_stats: bool, kind: SessionKind,
                     why: PlanResult) -> bool:
        if not self._with_room(lambda: self.cache.admit(req)):
            return False
        if update_stats:
            prompt_len = len(req.prompt_ids)
            changed = prompt_len - req.prefix_len
            req.reuse = ReuseStats(req.prefix_len, 0, changed, 0, kind, fallback=why.reason,
                                   changed=changed)
            if why.breakdown is not None:
                req.reuse = ReuseStats.from_plan_result(why, prompt_len=prompt_len,
                                                        prefix_len=req.prefix_len, session=kind)
        return True

    def _admit_scr(self, req: Req, scr: ScrRequest, match: PrefixMatch, result: PlanResult,
                   update_stats: bool) -> bool:
        """Slots for `result.plan`: the locked prefix, fresh slots for the rest, the kept spans
        relocated into them. No room: prefix caching ("alloc_failed")."""
        kv = scr.session.payload
        self.cache.radix.lock(match.node)
        fresh = self._with_room(lambda: self.cache.alloc(len(req.prompt_ids) - match.length))
        if fresh is None or not self.cache.admit_state(req, match):
            if fresh is not None:
                self.cache.allocator.free(fresh)
            self.cache.radix.unlock(match.node)
            self._count_fallback("alloc_failed")
            # no breakdown: the eviction that failed to make room may have shortened the prefix the
            # plain admission now matches, so the plan's breakdown would not add up
            return self._admit_plain(req, update_stats, "matched", PlanResult(None, "alloc_failed", None))
        self.cache.install(req, match, fresh)
        self._relocate(req, result.plan, kv.slots(), scr.cfg)
        req.pending = [o for start, end in result.plan.computed_ranges for o in range(start, end)]
        scr.plan = result.plan
        recomputed = self._plan_recompute(req, scr)
        windows = self._relocate_windows(req, scr, kv.slots())
        recomputed += windows.recomputed
        if self.cache.states is not None:
            # the session's own (approximate) states, and the exact checkpoints on its locked radix
            # path (its previous sequence's exact states, and those of earlier turns still kept)
            candidates = {**self.cache.radix.path_checkpoints(kv.exact_node), **kv.states}
            self._plan_state_loads(req, result.plan, candidates, scr.cfg.state_mode, match.length)
            self.cache.pin_loads(req)
            self.cache.alloc_checkpoints(req)
        if update_stats:
            req.reuse = ReuseStats.from_plan_result(result, prompt_len=len(req.prompt_ids),
                                                    prefix_len=match.length, session="matched")
            if recomputed:
                req.reuse = req.reuse.with_recompute(recomputed)
            req.reuse = dataclasses.replace(req.reuse, window_relocated=windows.relocated,
                                            window_recomputed=windows.recomputed)
        return True

    # ----- selective recompute ----------------------------------------------------------
    def _plan_recompute(self, req: Req, scr: ScrRequest) -> int:
        """Selective recompute for `req`'s fresh plan: the first `seam_tokens` of every span
        (`removed_seam_tokens` right after removed text) and the message openings (role, line break
        and the first `message_start_tokens` content tokens; kvsplice.message_offsets) in the
        spans from the first edit on (none in a turn that only appends). Returns how many tokens
        it recomputes (0 on hybrids)."""
        cfg = scr.cfg
        if self.cache.states is not None:
            return 0
        offsets = set(seam_offsets(scr.plan, cfg.seam_tokens, cfg.removed_seam_tokens))
        if cfg.message_start_tokens and self.message_starts is not None:
            openings = self.message_starts.openings(req.prompt_ids, cfg.message_start_tokens,
                                                    range(len(req.prompt_ids)))
            offsets.update(in_edited_keeps(scr.plan, openings))
        if offsets:
            self._apply_recompute(req, scr, sorted(offsets))
        return len(offsets)

    @staticmethod
    def _apply_recompute(req: Req, scr: ScrRequest, offsets: list[int]) -> None:
        """Recompute `offsets` (relocated offsets of the plan): amend the plan and the pending offsets."""
        scr.plan = scr.plan.with_recomputed(offsets)
        req.pending = sorted(set(req.pending) | set(offsets))

    @staticmethod
    def _hybrid_plan(result: PlanResult, old_ids, new_ids, runs, cfg: ReuseConfig, radix_match: int) -> PlanResult:
        """On a hybrid the prefix hit stops at a state checkpoint, below the radix match. A first
        keep that merely continues it in place (delta 0 right at prefix_len) would leave the linear
        layers without the exact state of the cached tokens it covers: compute those, [prefix_len,
        radix_match), instead (exact, as a prefix hit would be). Its part beyond the radix match
        (K/V the session holds privately, approximate from an earlier relocation) stays relocated
        in place when at least `min_span` long, as on a dense model; else it is computed too.

            new prompt   [ prefix (checkpoint) ][ cached, no state ][ session's own K/V ][ tail ]
            keep                               |<-------- delta 0 keep ---------------->|
            becomes      computed ------------> |                  |<-- keep ---------->|

        No keep left: no plan ("no_spans")."""
        plan = result.plan
        keeps = plan.keeps
        if not (keeps and keeps[0].delta == 0 and keeps[0].dst_pos == plan.prefix_len):
            return result
        first, start = keeps[0], max(radix_match, plan.prefix_len)
        rest = Keep(start, start, first.dst_end - start)
        keeps = ((rest,) if rest.length >= cfg.min_span else ()) + keeps[1:]
        tail = cfg.tail
        breakdown = prefill_breakdown(old_ids, new_ids, runs, prefix_len=plan.prefix_len, keeps=keeps, tail=tail)
        if not keeps:
            return PlanResult(None, "no_spans", breakdown)
        return PlanResult(dataclasses.replace(plan, keeps=keeps, removed=removed_before(keeps, runs),
                                              removed_spans=removed_spans(keeps, runs)), None, breakdown)

    @staticmethod
    def _plan_state_loads(req: Req, plan: SpanPlan, old_states: dict[int, int], mode: str,
                          prefix_len: int) -> None:
        """Fill `req.splice_loads` ({offset: state slot} before each computed range that follows
        relocated tokens) by `mode`, and record it in `req.state_reuse`."""
        final_len = max(old_states) if old_states else None
        ends = {keep.dst_end: keep for keep in plan.keeps}
        loaded_from, prev_end = [], prefix_len
        for start, end in plan.computed_ranges:
            if start > prev_end:
                source = None
                if mode == "fork":
                    source = final_len
                elif mode == "checkpoint":
                    src_end = ends[start].src_end
                    source = max((length for length in old_states if length <= src_end), default=None)
                if source is not None:
                    req.splice_loads[start] = old_states[source]
                loaded_from.append(source)
            prev_end = end
        base = req.state_reuse or StateReuse(prefix_len, prefix_len)
        req.state_reuse = dataclasses.replace(base, mode=mode, splices=len(loaded_from),
                                              loaded_from=tuple(loaded_from))

    def _relocate(self, req: Req, plan: SpanPlan, old_slots: torch.Tensor, cfg: ReuseConfig) -> None:
        rotary = None if cfg.no_rerotate else self.rotary
        for _ in plan.keeps:
            self._failpoint("relocate", req)
        relocate_spans(self.cache.pool, [(old_slots[keep.src_pos: keep.src_end],
                                          req.seq_slots[keep.dst_pos: keep.dst_end], keep) for keep in plan.keeps],
                       rotary, self.key_turner)

    def _relocate_windows(self, req: Req, scr: ScrRequest, old_slots: torch.Tensor) -> WindowMoves:
        """A windowed pool (sliding-window layers, kvsplice.cache.window_pool): the sliding layers
        need K/V only inside the window of a computed token. Relocated offsets there whose source
        kept its window are relocated in those layers too; the others are computed instead, which
        may put further relocated offsets inside a window, until none is missing:

            new prompt   [ prefix ][ relocated ......................... ][ B' ][ relocated ][ D ]
            window of B'                     |<-- W -->|                        |<-W->|
            sliding K/V                      copied, or computed where the old one is gone

        Returns how many offsets it added to those computed and how many it relocated in the sliding
        layers (both 0 without a windowed pool)."""
        pool = self.cache.windows
        if pool is None or not scr.plan.keeps:
            return WindowMoves(0, 0)
        length = len(req.prompt_ids)
        relocated = torch.zeros(length, dtype=torch.bool)
        src_slot = torch.zeros(length, dtype=torch.int64)
        src_pos = torch.zeros(length, dtype=torch.int64)
        for keep in scr.plan.keeps:
            relocated[keep.dst_pos: keep.dst_end] = True
            src_slot[keep.dst_pos: keep.dst_end] = old_slots[keep.src_pos: keep.src_end]
            src_pos[keep.dst_pos: keep.dst_end] = torch.arange(keep.src_pos, keep.src_end)
        added: list[int] = []
        while True:
            computed = torch.zeros(length, dtype=torch.bool)
            computed[torch.tensor(req.pending, dtype=torch.int64)] = True
            needed = self._in_a_window(relocated & ~computed, torch.nonzero(computed).flatten(), pool.window)
            missing = needed & ~pool.has_window[src_slot]
            if not bool(missing.any()):
                break
            offsets = torch.nonzero(missing).flatten().tolist()
            added += offsets
            self._apply_recompute(req, scr, offsets)
        offsets = torch.nonzero(needed).flatten()
        rotary = None if scr.cfg.no_rerotate else self.window_rotary
        # A source a running request reads is copied (it must stay); one on a locked radix path is
        # copied where there is room, so the path keeps its window; any other gives its window to the
        # new sequence, turned in place (no second window slot needed)
        read = self.cache.windows_read(self.cache.running())[src_slot[offsets]]
        locked = torch.zeros(pool.num_slots, dtype=torch.bool)
        locked[self.cache.radix.locked_slots()] = True
        kept = locked[src_slot[offsets]] & ~read
        sources = src_slot[offsets]   # every source keeps its window while room is made for copies
        if kept.any() and not self._copy_windows(req, offsets[kept], src_slot, src_pos, rotary, sources):
            kept[:] = False
        moved = offsets[~read & ~kept]
        pool.move_window(src_slot[moved], req.seq_slots[moved], src_pos[moved], moved, rotary)
        if read.any() and not self._copy_windows(req, offsets[read], src_slot, src_pos, rotary, sources):
            raise RuntimeError("the window pool has no room for the relocated sliding-layer K/V")
        return WindowMoves(recomputed=len(added), relocated=int(offsets.numel()))

    def _copy_windows(self, req: Req, offsets: torch.Tensor, src_slot: torch.Tensor, src_pos: torch.Tensor,
                      rotary, sources: torch.Tensor) -> bool:
        """The windows of `req`'s relocated `offsets` copied from their sources into window slots of
        their own (no spare window of the full slots `sources` is given back to make room); False
        (nothing copied) when there is no room."""
        if not self.cache.ensure_window(req, offsets.tolist(), keep=sources):
            return False
        self.cache.windows.relocate_window(src_slot[offsets], req.seq_slots[offsets], src_pos[offsets], offsets,
                                           rotary)
        return True

    @staticmethod
    def _in_a_window(candidates: torch.Tensor, computed: torch.Tensor, window: int) -> torch.Tensor:
        """Bool per offset: a candidate that some computed offset p (sorted `computed`) reads on a
        sliding layer, p - window < offset < p."""
        found = torch.zeros_like(candidates)
        offsets = torch.nonzero(candidates).flatten()
        if offsets.numel() and computed.numel():
            after = torch.searchsorted(computed, offsets, right=True)
            inside = after < computed.numel()
            hit = offsets[inside][computed[after[inside]] < offsets[inside] + window]
            found[hit] = True
        return found

    def _with_room(self, attempt):
        """Run `attempt` (which allocates); when the pool is short, drop idle sessions one at a
        time (least recently used first) and retry. Returns the last attempt's result."""
        result = attempt()
        while (result is None or result is False) and self._drop_one_idle_session():
            result = attempt()
        return result

    # ----- the end of a request ---------------------------------------------------------
    def finish(self, req: Req, cache: bool) -> None:
        """Return `req`'s slots; with `cache`, its exact K/V enters the radix tree and its SCR
        session (if any; a new one when the match forks) takes over the new sequence's K/V."""
        scr = req.scr
        if scr is None or scr.session is None or not cache:
            self.cache.allocator.free(self.cache.release(req, cache=cache))
            self.forget(req)
            self._cap_states()
            return
        kv_len = self.cache.computed_len(req)
        ids = req.seq_ids[:kv_len]
        exact_len = min(scr.plan.exact_len if scr.plan is not None else kv_len, kv_len)
        states = self.cache.take_states(req) if self.cache.states is not None else {}
        private = self.cache.release(req, cache=True, exact_len=exact_len, taken_states=states)
        if states:
            # exact states become radix checkpoints (the session finds them on its locked path);
            # the approximate ones, after the first relocated token, stay the session's own
            self.cache.checkpoint_exact_states(ids, req.namespace, states, exact_len)
            states = {length: slot for length, slot in states.items() if length > exact_len}
        session = self._session_to_update(req, scr)
        self._replace_session_kv(session, ids, exact_len, private, states,
                                 prompt_len=min(len(req.prompt_ids), len(ids)))
        self._spill_session(session)            # written through: a SIGKILL keeps the session
        self.forget(req)
        self._cap_states()

    def _session_to_update(self, req: Req, scr: ScrRequest) -> Session:
        """The session that takes the finished request's K/V: the attached one, or a new one when
        the match forks. An explicit session id moves to it (the id follows its conversation),
        unless it is a session another client named."""
        target = self.sessions.create(req.namespace) if scr.fork else scr.session
        if req.session_id is not None and not (target.named and target.session_id != req.session_id):
            self.sessions.claim_id(target, req.session_id)
        return target

    def _cap_states(self) -> None:
        """Hybrids: drop the least useful of the radix tree's checkpoints and the sessions' own
        states until together they fit the checkpoint policy's cap (`checkpoint_policy`; pinned
        states never go)."""
        cache = self.cache
        if cache.states is None:
            return
        while cache.radix.num_checkpoints() + self.private_state_slots() > cache.policy.max_states:
            victim = least_useful(cache.radix.checkpoint_candidates() + self._session_state_candidates())
            if victim is None:
                return
            if isinstance(victim.handle, tuple):
                kv, length = victim.handle
                cache.states.free([kv.states.pop(length)])
            else:
                cache.radix.drop_checkpoint(victim.handle)

    def _session_state_candidates(self) -> list:
        """Every session's own states as eviction candidates (handles (SessionKV, length)); a
        session's recency is that of its locked radix path, its exact checkpoints are the floor."""
        refcount = self.cache.states.allocator.refcount
        out = []
        for session in self.sessions.sessions():
            kv = session.payload
            if kv is None or not kv.states:
                continue
            below = list(self.cache.radix.path_checkpoints(kv.exact_node))
            out += [c for c in sequence_candidates(list(kv.states), below, kv.exact_node.last_access, kv)
                    if int(refcount[kv.states[c.depth]]) == 1]
        return out

    def _replace_session_kv(self, session: Session, ids: list[int], exact_len: int,
                            private: torch.Tensor, states: dict[int, int] | None = None,
                            prompt_len: int | None = None) -> None:
        self._free_payload(session)
        match = self.cache.radix.match_prefix(ids[:exact_len], session.namespace)
        if match.length != exact_len:  # cannot happen right after insert; never keep a gap
            raise RuntimeError(f"session exact part not cached: {match.length} != {exact_len}")
        self.cache.radix.lock(match.node)
        session.payload = SessionKV(match.node, match.slots, private, dict(states or {}))
        self.sessions.update(session, ids, private_tokens=int(private.numel()), prompt_len=prompt_len)

    def forget(self, req: Req) -> None:
        """`req` is gone: end its session's in-flight mark and enforce the session limits; drop the
        disk-tier reads started for it that no admission collected."""
        self.end_tier_reads(req)
        scr = req.scr
        if scr is not None and scr.session is not None:
            self.sessions.end(scr.session)
            scr.session = None
            self._free_sessions(self.sessions.evict_over_limits())

    # ----- sessions' resources ----------------------------------------------------------
    def _free_payload(self, session: Session) -> None:
        kv = session.payload
        if kv is not None:
            self.cache.radix.unlock(kv.exact_node)
            self.cache.allocator.free(kv.private_slots)
            if kv.states:
                self.cache.states.free(list(kv.states.values()))
            session.payload = None

    def _free_sessions(self, sessions: list[Session]) -> None:
        for session in sessions:
            self._free_payload(session)

    def _drop_one_idle_session(self, over_share_only: bool = False) -> bool:
        """Drop the least recently used idle session holding K/V, one of a namespace over its
        tenant share first (`kvsplice.cache.tenant_share`); with `over_share_only`, only such a
        one. Its private K/V may go to the disk tier. False when there is none."""
        over = self.cache.radix.over_share
        idle = [s for s in self.sessions.sessions() if s.inflight == 0 and s.payload is not None
                and (over(s.namespace) or not over_share_only)]
        if not idle:
            return False
        victim = min(idle, key=lambda s: (not over(s.namespace), s.last_used))
        self.sessions.remove(victim)
        self._spill_session(victim, replace=False)
        self._free_payload(victim)
        self.sessions_evicted_for_memory += 1
        return True

    def _drop_one_over_share_session(self) -> bool:
        return self._drop_one_idle_session(over_share_only=True)

    # ----- sessions in the disk tier ----------------------------------------------------
    def _spill_session(self, session: Session, replace: bool = True) -> None:
        """A session that a client named, as it takes a finished turn (written through) or is
        dropped for memory (`replace=False`: only when the tier has no entry of it yet, as it has
        after a turn's write): its K/V from a split on goes to the disk tier as an entry only this
        session id loads back (`_restore_session`); the part before the split is in the radix tree
        and the tier's exact entries. The split is where its private (approximate) K/V starts, or,
        for a session whose K/V is all exact, where its last prompt ended: the write-through
        (`CacheManager._write_through`) cut its exact entries there, and without an entry of its
        own the session (what its next turn relocates from) would not survive a restart. An entry
        left older than the session (its write dropped) is still consistent: its token ids are
        those of its K/V.

            session.token_ids  [ exact part (radix / tier exact entries) ][ private K/V      ]
            all exact          [ ... exact, cut at prompt_len ...        ][ completion's K/V ]
            entry              token ids [0, split + n), start_pos = split, kv of the n after it

        On a hybrid the entry also carries the session's states after the split (`_session_states`;
        its own approximate ones and the exact checkpoints of its radix path there), and is not
        written without the state at its end (a relocation from it would have no state to resume).
        """
        kv, tier = session.payload, self.cache.tier
        if tier is None or not session.named or kv is None:
            return
        split, slots = int(kv.exact_slots.numel()), kv.private_slots
        if not slots.numel():
            if not 0 < session.prompt_len < split:
                return
            split, slots = session.prompt_len, kv.exact_slots[session.prompt_len:]
        key = EntryKey.for_session(namespace_name(session.namespace), session.session_id)
        if not replace and tier.contains(key):
            return
        end = split + int(slots.numel())
        states = self._session_states(kv, split, end)
        if states is None:
            return
        ids = torch.tensor(session.token_ids[:end], dtype=torch.int64)
        tier.put(TierEntry(key, ids, split, kv_from_pool(self.cache.pool, slots), states, exact=False,
                           session_id=session.session_id))

    def _session_states(self, kv: SessionKV, split: int, end: int) -> dict[str, torch.Tensor] | None:
        """A hybrid session's states at lengths in (split, end] as the tensors of its tier entry
        (`state_pool.pack_states`, copies): its own and those on its locked radix path. {} on a
        model without states; None when the state at `end` is not among them."""
        if self.cache.states is None:
            return {}
        held = {**self.cache.radix.path_checkpoints(kv.exact_node), **kv.states}
        held = {length: slot for length, slot in held.items() if split < length <= end}
        if end not in held:
            return None
        return pack_states({length: self.cache.states.snapshot(slot) for length, slot in held.items()})

    def _load_session_states(self, entry: TierEntry) -> dict[int, int] | None:
        """The states a hybrid session's tier entry carries, each in a fresh state slot, {length:
        slot}; {} on a model without states. None, holding nothing, when they are malformed, of
        another layout, lack the state at the entry's end, or no state slot can be had."""
        states = self.cache.states
        if states is None:
            return {}
        try:
            snapshots = unpack_states(entry.states)
        except ValueError:
            return None
        if entry.end_pos not in snapshots or not all(
                entry.start_pos < length <= entry.end_pos and states.fits(snapshot)
                for length, snapshot in snapshots.items()):
            return None
        loaded: dict[int, int] = {}
        for length, snapshot in sorted(snapshots.items()):
            slot = self.cache.alloc_state()
            if slot is None:
                states.free(list(loaded.values()))
                return None
            states.restore(slot, snapshot)
            loaded[length] = slot
        return loaded

    def _restore_session(self, req: Req) -> None:
        """Bring back the session `req` names from what the reader thread read of it from the disk
        tier (`start_tier_reads`), if its exact part can be had whole (radix tree, then the tier's
        exact entries read with it): its private K/V gets fresh slots, and the session is tracked
        again (then verified as any named session). On a hybrid its states come back too, each in
        a state slot of its own (`_load_session_states`), or the session is not restored. The
        prompt / completion split is not stored: the whole sequence counts as its prompt."""
        reads = self.cache.reads
        result = reads.result(req.rid) if reads is not None else None
        if result is None or result.session is None:
            return
        namespace, session_id, entry = req.namespace, req.session_id, result.session
        ids = entry.token_ids.tolist()
        exact = ids[: entry.start_pos]
        match = self.cache.radix.match_prefix(exact, namespace)
        needed = len(exact) - match.length + entry.num_tokens
        while (self.cache.allocator.num_free + self.cache.radix.evictable_size() < needed
               and self._drop_one_idle_session()):
            pass                                # idle sessions go first, as for any admission
        before = match.length
        match = self.cache.extend_from_entries(exact, namespace, match, result.session_exact)
        # loaded from disk and shared with the prompt: the request's prefix match finds them cached
        req.disk_tokens += max(0, min(match.length, common_prefix_len(exact, req.prompt_ids)) - before)
        if match.length != len(exact):        # never keep a gap between the exact and private parts
            return
        self.cache.radix.lock(match.node)
        private = self._with_room(lambda: self.cache.alloc(entry.num_tokens))
        if private is None:
            self.cache.radix.unlock(match.node)
            return
        session_states = self._load_session_states(entry)
        if session_states is None:
            self.cache.allocator.free(private)
            self.cache.radix.unlock(match.node)
            return
        kv_into_pool(self.cache.pool, private, entry.kv)
        session = self.sessions.create(namespace, session_id)
        session.payload = SessionKV(match.node, match.slots, private, session_states)
        self.sessions.update(session, ids, private_tokens=int(private.numel()))
        self.sessions_restored += 1

    def _count_fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def private_slots(self) -> int:
        """Slots held privately by SCR sessions."""
        return sum(int(s.payload.private_slots.numel()) for s in self.sessions.sessions()
                   if s.payload is not None)

    def private_state_slots(self) -> int:
        """State slots held by SCR sessions (hybrid models)."""
        return sum(len(s.payload.states) for s in self.sessions.sessions() if s.payload is not None)

    def drop_idle_sessions(self, namespaces: Callable[[Hashable], bool] | None = None) -> None:
        """Release every session without a request in flight (only those of the namespaces for
        which `namespaces(namespace)` is true, when given). Nothing goes to the disk tier."""
        for session in self.sessions.sessions():
            if session.inflight == 0 and (namespaces is None or namespaces(session.namespace)):
                self.sessions.remove(session)
                self._free_payload(session)
