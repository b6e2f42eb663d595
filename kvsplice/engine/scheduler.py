"""Scheduler: continuous batching of prefill chunks and decode steps under a token budget.

Each step the engine (kvsplice.engine.engine) asks it, in this order:

  1. `schedule_decodes`: every running request that is decoding (one token each), given a slot
     for its newest token; when the pool is exhausted it preempts the most recently admitted
     request (its slots are freed, it goes back to the front of the queue and is recomputed later);
  2. `schedule_prefill`: the next chunk of each running request still in prefill (chunked prefill);
  3. admission, the engine's own phase: while budget is left, `next_to_admit` names the waiting
     request first in line (first come first served, while fewer than `max_running` run), the
     engine gives it its slots (kvsplice.engine.reuse_manager) and `start` moves it to the running
     list with its first chunk.

Steps 2 and 3 share the step's prefill budget, which the step's placement decides
(kvsplice.engine.step_plan): `max_batch_tokens` when nothing decodes, else what `StepBudget`
(kvsplice.engine.step_budget) measured to fit next to the decodes within the step-time budget, at
least `min_prefill_tokens`, so that a long prefill goes in chunks that keep the decoding requests'
pace, and every prefill still progresses every step; with a prefill lane, what is left of
`max_batch_tokens` for the lane's job, whose requests stay `held` until it is done.

The scheduler never calls a layer above it: it grows and frees slots through the CacheManager it
owns, and the engine does the admitting.

A request's work in a step is a list of offsets to compute (not necessarily contiguous: under
SCR the relocated spans sit between them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from kvsplice.config import EngineConfig
from kvsplice.engine.cache_manager import CacheManager
from kvsplice.engine.request import Req, ReqStatus
from kvsplice.engine.step_budget import StepBudget


@dataclass(frozen=True)
class Chunk:
    """Offsets of one request to compute in this step; `samples` when the last of them is the
    sequence's last token (so the step yields the request's next token)."""

    req: Req
    offsets: list[int]

    @property
    def samples(self) -> bool:
        return self.offsets[-1] == self.req.seq_len - 1


class Scheduler:
    """Owns the waiting queue and the running list, and the slots running requests grow into."""

    def __init__(self, config: EngineConfig, cache: CacheManager):
        self.config = config
        self.cache = cache
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # rids whose chunk is being computed elsewhere (the prefill lane): never scheduled nor
        # preempted until the engine takes them back
        self.held: set[str] = set()
        self.budget = StepBudget(config.max_batch_tokens, config.step_budget_ratio, config.min_prefill_tokens)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def remove(self, req: Req) -> None:
        """Forget `req` (finished or aborted); its slots must already be released."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule_decodes(self) -> tuple[list[Chunk], int]:
        """One chunk per decoding request not `held`, each given the slot of its newest token
        (preempting the newest others when the pool is exhausted); and how many requests were
        preempted."""
        chunks: list[Chunk] = []
        preempted = 0
        for req in [r for r in self.running if r.is_decoding and r.rid not in self.held]:
            if req.status is not ReqStatus.RUNNING:
                continue  # preempted earlier in this loop
            grown, victims = self._grow_or_preempt(req, chunks)
            preempted += victims
            if grown:
                chunks.append(Chunk(req, list(req.pending)))
        return chunks, preempted

    def schedule_prefill(self, budget: int) -> list[Chunk]:
        """The next prefill chunks of running requests still in prefill (not `held`), at most
        `budget` tokens in all."""
        chunks: list[Chunk] = []
        for req in [r for r in self.running if not r.is_decoding and r.rid not in self.held]:
            if budget <= 0:
                break
            chunk = self._prefill_chunk(req, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= len(chunk.offsets)
        return chunks

    def _prefill_chunk(self, req: Req, budget: int) -> Chunk | None:
        """`req`'s next `budget` pending offsets, given their window slots (a windowed pool); None
        when the window space is short this step (the request waits for the next)."""
        offsets = req.pending[:budget]
        return Chunk(req, offsets) if self.cache.ensure_window(req, offsets) else None

    def next_to_admit(self, ready: Callable[[Req], bool] = lambda req: True) -> Req | None:
        """The waiting request first in line among those `ready` (the engine's: disk-tier reads
        done), while fewer than `max_running` run; else None."""
        if len(self.running) >= self.config.max_running:
            return None
        return next((req for req in self.waiting if ready(req)), None)

    def start(self, req: Req, budget: int) -> Chunk | None:
        """`req` (`next_to_admit`, now holding its slots) runs from this step: its first prefill
        chunk, of at most `budget` tokens (None when a windowed pool has no window slots for it
        this step: it runs from a later step's `schedule_prefill`)."""
        self.waiting.remove(req)
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        return self._prefill_chunk(req, budget)

    def _grow_or_preempt(self, req: Req, chunks: list[Chunk]) -> tuple[bool, int]:
        """Give `req` its decode slot, preempting the newest other requests not yet scheduled
        this step; if nothing else can go, `req` itself is preempted. Returns whether `req` got
        its slot, and how many requests were preempted."""
        scheduled = {id(c.req) for c in chunks}
        preempted = 0
        while not self.cache.grow(req):
            victims = [r for r in self.running
                       if r is not req and id(r) not in scheduled and r.rid not in self.held]
            victim = victims[-1] if victims else req
            self.preempt(victim)
            preempted += 1
            if victim is req:
                return False, preempted
        return True, preempted

    def preempt(self, req: Req) -> None:
        """Send running `req` back to the front of the queue, its slots freed (nothing of it is
        cached; its SCR session stays attached, so re-admission plans again from the same
        previous sequence). Also what the engine does when a failed forward left its state unknown."""
        self.cache.release(req, cache=False)
        self.running.remove(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
