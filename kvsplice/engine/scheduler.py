"""Scheduler: continuous batching of prefill chunks and decode steps under a token budget.

Each step it picks, in this order:

  1. every running request that is decoding (one token each), giving it a slot for its
     newest token; when the pool is exhausted it preempts the most recently admitted request
     (its slots are freed, it goes back to the front of the queue and is recomputed later);
  2. the next chunk of each running request still in prefill (chunked prefill);
  3. waiting requests, first come first served, as long as their slots can be had.

Steps 2 and 3 share the step's prefill budget: `max_batch_tokens` when nothing decodes, else what
`StepBudget` (kvsplice.engine.step_budget) measured to fit next to the decodes within the step-time
budget, at least `min_prefill_tokens`, so that a long prefill goes in chunks that keep the
decoding requests' pace, and every prefill still progresses every step. With a prefill lane
(kvsplice.engine.prefill_lane) the engine asks for the two parts separately: `schedule_decodes`
for its own steps, `schedule_prefill(max_batch_tokens)` for the lane's job, whose requests stay
`held` until it is done.

A request's work in a step is a list of offsets to compute (not necessarily contiguous: under
SCR the relocated spans sit between them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

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
    """Owns the waiting queue and the running list; asks `admit_fn` to give a request its slots
    (plain prefix caching, or SCR planning + relocation)."""

    def __init__(self, config: EngineConfig, cache: CacheManager, admit_fn, preempt_fn):
        self.config = config
        self.cache = cache
        self.admit_fn = admit_fn
        self.preempt_fn = preempt_fn
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

    def schedule(self) -> list[Chunk]:
        """Choose this step's work (see the module docstring). Side effects: allocates slots,
        may preempt running requests, moves admitted requests from waiting to running."""
        chunks = self.schedule_decodes()
        budget = min(self.budget.prefill_tokens(len(chunks)), self.config.max_batch_tokens - len(chunks))
        return chunks + self.schedule_prefill(budget)

    def schedule_decodes(self) -> list[Chunk]:
        """One chunk per decoding request not `held`, each given the slot of its newest token
        (preempting the newest others when the pool is exhausted)."""
        chunks: list[Chunk] = []
        for req in [r for r in self.running if r.is_decoding and r.rid not in self.held]:
            if req.status is not ReqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self._grow_or_preempt(req, chunks):
                continue
            chunks.append(Chunk(req, list(req.pending)))
        return chunks

    def schedule_prefill(self, budget: int) -> list[Chunk]:
        """Prefill chunks of at most `budget` tokens in all: running requests still in prefill
        first (not `held`), then waiting ones admitted first come first served."""
        chunks: list[Chunk] = []
        for req in [r for r in self.running if not r.is_decoding and r.rid not in self.held]:
            if budget <= 0:
                break
            budget -= self._add_prefill_chunk(req, budget, chunks)
        while budget > 0 and self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            if not self.admit_fn(req):
                break
            self.waiting.popleft()
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            budget -= self._add_prefill_chunk(req, budget, chunks)
        return chunks

    @staticmethod
    def _add_prefill_chunk(req: Req, budget: int, chunks: list[Chunk]) -> int:
        """Append `req`'s next prefill chunk within `budget`; return its token count."""
        chunks.append(Chunk(req, req.pending[:budget]))
        return len(chunks[-1].offsets)

    def _grow_or_preempt(self, req: Req, chunks: list[Chunk]) -> bool:
        """Give `req` its decode slot, preempting the newest other requests not yet scheduled
        this step; if nothing else can go, `req` itself is preempted (returns False)."""
        scheduled = {id(c.req) for c in chunks}
        while not self.cache.grow(req):
            victims = [r for r in self.running
                       if r is not req and id(r) not in scheduled and r.rid not in self.held]
            victim = victims[-1] if victims else req
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Req) -> None:
        """Send running `req` back to the front of the queue, its slots freed (it is recomputed
        when admitted again); the engine uses it when a failed forward left its state unknown."""
        self._preempt(req)

    def _preempt(self, req: Req) -> None:
        self.preempt_fn(req)
        self.running.remove(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
