"""TierReads: a request's disk-tier reads, done on a thread of their own while the engine steps.

A request whose prompt continues beyond the radix tree into the disk tier (or that names a session
the engine no longer holds) gets its tier entries read, checksummed and verified off the engine
thread; the request waits in the queue meanwhile (not the engine: every other request keeps
decoding), and only the copy into the pool runs on the engine thread, at admission:

    engine thread                                     reader thread ("kv-tier-loads")
    add_request ─ start(): radix match length L,      read(): tier.match_prefix(prompt, from 0;
                  tier index look-ups (no I/O) ─────>  a hybrid: from L), tier.get() each entry (file
                                                       read + XXH3 + token ids verified) into
                                                       host memory; a named session's entry and
                                                       the chain of its exact part likewise
    step: admission passes over the request ...       ... until the Future is done
          (queued with nothing to read: planned again, the tree may have evicted its prefix)
    admission: result(req) ─ kv_into_pool (CacheManager.extend_from_entries) ─ radix insert
    finish / abort / admitted: drop(req)

A read that fails (a file missing, torn, truncated, corrupt, an I/O error, an exception) ends its
chain there: the request prefills the rest, it never gets a wrong token (`DiskTier.get` verifies
everything). Held results are bounded: at most `max_requests` requests hold reads (started and not
yet dropped); another one waits in the queue until one is dropped, then starts its own (`ready`).

Not thread-safe on the engine side: one engine thread calls `start`, `ready`, `result`, `drop`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from kvsplice.cache.disk_tier import DiskTier
from kvsplice.cache.tier_format import EntryKey, TierEntry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierReadResult:
    """What the reader thread read for one request, verified. `prefix`: the chain of exact entries
    continuing the prompt from the radix tree's match at queue time (gapless, increasing ends);
    `session`: the named session's approximate entry (None when not asked or missed);
    `session_exact`: the chain of exact entries of that session's exact part."""

    prefix: tuple[TierEntry, ...] = ()
    session: TierEntry | None = None
    session_exact: tuple[TierEntry, ...] = ()


@dataclass(frozen=True)
class ReadPlan:
    """What to read for one request (all of it decided on the engine thread, no I/O)."""

    namespace: str                  # the tier's name of the request's namespace
    token_ids: tuple[int, ...]      # the prompt tokens a prefix may cover
    start: int                      # the radix tree's match of them when planned
    session_key: EntryKey | None    # the named session's entry, when it is to be restored
    session_id: str | None


def read_chain(tier: DiskTier, namespace: str, token_ids: Sequence[int], start: int,
               known: dict[EntryKey, TierEntry] | None = None) -> tuple[TierEntry, ...]:
    """The stored exact entries continuing `token_ids` from `start`, read and verified, up to the
    first miss (`known`: entries read already, by key, used instead of reading them again)."""
    found = tier.match_prefix(namespace, token_ids, start_pos=start)
    entries = []
    for key in found.keys:
        entry = (known or {}).get(key) or tier.get(key, token_ids=token_ids)
        if entry is None:
            break
        entries.append(entry)
    return tuple(entries)


def read(tier: DiskTier, plan: ReadPlan) -> TierReadResult:
    """Run on the reader thread: every read `plan` names (pure I/O and verification, no pool)."""
    prefix = read_chain(tier, plan.namespace, plan.token_ids, plan.start)
    if plan.session_key is None:
        return TierReadResult(prefix)
    session = tier.get(plan.session_key, session_id=plan.session_id)
    if session is None:
        return TierReadResult(prefix)
    exact = session.token_ids[: session.start_pos].tolist()
    # the radix tree held prompt[:start] when planned; the exact part shares `common` tokens with it
    common = common_prefix_len(exact, plan.token_ids)
    known = {entry.key: entry for entry in prefix}
    return TierReadResult(prefix, session, read_chain(tier, plan.namespace, exact, min(plan.start, common), known))


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if not n:
        return 0
    differ = torch.nonzero(torch.as_tensor(a[:n]) != torch.as_tensor(b[:n]))
    return int(differ[0]) if differ.numel() else n


class TierReads:
    """Reads of waiting requests (keyed by request id), on one thread of their own: not the
    tier's per-entry prefetch reader, which a read here would wait on from its own queue."""

    def __init__(self, tier: DiskTier, max_requests: int):
        self.tier = tier
        self.max_requests = max_requests
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-loads")
        self._reads: dict[str, Future] = {}
        self._closed = False

    def start(self, rid: str, plan: ReadPlan | None) -> bool:
        """Start reading `plan` for request `rid` (nothing to read when `plan` is None); False when
        `max_requests` requests hold reads already (try again later)."""
        if plan is None or self._closed:
            return True
        if len(self._reads) >= self.max_requests:
            return False
        self._reads[rid] = self._executor.submit(read, self.tier, plan)
        return True

    def holds(self, rid: str) -> bool:
        """Whether a read was started for `rid` (running or done) and not dropped."""
        return rid in self._reads

    def ready(self, rid: str) -> bool:
        """Whether `rid` has no read still running."""
        future = self._reads.get(rid)
        return future is None or future.done()

    def result(self, rid: str) -> TierReadResult:
        """`rid`'s finished reads (empty when none was started, or it failed: logged). Never
        blocks on a running read: it answers empty (the caller should have checked `ready`)."""
        future = self._reads.get(rid)
        if future is None or not future.done() or future.cancelled():
            return TierReadResult()
        try:
            return future.result()
        except Exception:  # noqa: BLE001 -- a failed read costs a prefill, never the request
            logger.exception("request %s: disk tier read failed; its prompt is prefilled", rid)
            self._reads[rid] = _done(TierReadResult())
            return TierReadResult()

    def drop(self, rid: str) -> None:
        """Forget `rid`'s reads (admitted, finished or aborted): their memory goes."""
        future = self._reads.pop(rid, None)
        if future is not None:
            future.cancel()

    def wait_any(self, rids: Sequence[str], timeout_s: float) -> None:
        """Block until a running read of one of `rids` ends, or `timeout_s` (an idle engine)."""
        running = [self._reads[rid] for rid in rids if rid in self._reads and not self._reads[rid].done()]
        if running:
            concurrent.futures.wait(running, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Cancel reads not started, wait for the running one; no reads start after."""
        self._closed = True
        for future in self._reads.values():
            future.cancel()
        self._reads.clear()
        self._executor.shutdown(wait=True)


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
