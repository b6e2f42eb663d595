"""Where a step's chunks run: one forward here, or decodes here and prefill on the prefill lane.

An engine step is always schedule -> run -> postprocess (kvsplice.engine.engine). What differs
with a prefill lane (kvsplice.engine.prefill_lane) is only how large the step's prefill share is
and where its chunks go, so that is this module's one question, answered by a placement chosen
once at engine start:

    OneForward (no lane)   prefill budget: StepBudget's share next to the decodes (all of
                           max_batch_tokens when nothing decodes); every chunk in one forward here
    BesideLane             prefill budget: what max_batch_tokens leaves after the decodes, and
                           none while the lane still works; with something decoding the prefill
                           chunks go to the lane as one job and the decodes run here beside it;
                           with nothing decoding the prefill runs here on every thread, or, while
                           the lane works, the step waits for its job

A placement reads the lane's state and returns a StepPlan; it starts nothing (the engine does).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsplice.engine.prefill_lane import PrefillLane
from kvsplice.engine.scheduler import Chunk
from kvsplice.engine.step_budget import StepBudget


@dataclass(frozen=True)
class StepPlan:
    """A step's chunks by where they run: `here` in this step's forward (beside a running lane
    job when `beside_lane`), `to_lane` as a job started before it; `wait_for_lane`: nothing runs
    here, the step waits for the lane's job instead."""

    here: list[Chunk]
    to_lane: list[Chunk]
    beside_lane: bool = False
    wait_for_lane: bool = False


class OneForward:
    """No prefill lane: decodes and prefill chunks together, the prefill share sized by `budget`."""

    def __init__(self, budget: StepBudget, max_batch_tokens: int):
        self.budget = budget
        self.max_batch_tokens = max_batch_tokens

    def prefill_budget(self, decodes: int) -> int:
        """Prefill tokens for a step with `decodes` decode rows."""
        return min(self.budget.prefill_tokens(decodes), self.max_batch_tokens - decodes)

    def place(self, decodes: list[Chunk], prefills: list[Chunk]) -> StepPlan:
        return StepPlan(decodes + prefills, [])


class BesideLane:
    """A prefill lane: decode steps here, prefill jobs on `lane` (see the module docstring)."""

    def __init__(self, lane: PrefillLane, max_batch_tokens: int):
        self.lane = lane
        self.max_batch_tokens = max_batch_tokens

    def prefill_budget(self, decodes: int) -> int:
        """Prefill tokens for a step with `decodes` decode rows: none while the lane works."""
        return 0 if self.lane.busy else self.max_batch_tokens - decodes

    def place(self, decodes: list[Chunk], prefills: list[Chunk]) -> StepPlan:
        if not decodes:
            return StepPlan(prefills, [], wait_for_lane=not prefills and self.lane.busy)
        return StepPlan(decodes, prefills, beside_lane=bool(prefills) or self.lane.busy)
