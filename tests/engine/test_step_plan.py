"""Where a step's chunks run: one forward without a prefill lane; with one, decodes here and the
prefill chunks as a lane job while something decodes, here when nothing does, none while it works."""

from __future__ import annotations

from dataclasses import dataclass

from kvsplice.engine.step_budget import StepBudget
from kvsplice.engine.step_plan import BesideLane, OneForward, StepPlan


@dataclass
class _Lane:
    busy: bool = False


DECODES, PREFILLS = ["d1", "d2"], ["p1"]   # placements only pass chunks along


def test_one_forward_runs_everything_here_within_the_step_budget():
    placement = OneForward(StepBudget(64, 2.0, 8), 64)
    assert placement.prefill_budget(0) == 64
    assert placement.prefill_budget(2) <= 62
    assert placement.place(DECODES, PREFILLS) == StepPlan(DECODES + PREFILLS, [])


def test_beside_a_lane_decodes_run_here_and_prefill_goes_to_the_idle_lane():
    lane = _Lane()
    placement = BesideLane(lane, 64)
    assert placement.prefill_budget(2) == 62 and placement.prefill_budget(0) == 64
    assert placement.place(DECODES, PREFILLS) == StepPlan(DECODES, PREFILLS, beside_lane=True)
    assert placement.place(DECODES, []) == StepPlan(DECODES, [])
    assert placement.place([], PREFILLS) == StepPlan(PREFILLS, [])      # nothing decodes: here
    lane.busy = True
    assert placement.prefill_budget(2) == 0 and placement.prefill_budget(0) == 0
    assert placement.place(DECODES, []) == StepPlan(DECODES, [], beside_lane=True)
    assert placement.place([], []) == StepPlan([], [], wait_for_lane=True)
