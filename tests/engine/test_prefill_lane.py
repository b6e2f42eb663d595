"""The prefill lane (kvsplice.engine.prefill_lane): prefill jobs on a thread of their own beside
decode steps give the same tokens as the engine without it; a request held by a running job is
never scheduled or preempted, an abort waits for its job, a failed job fails only its culprit;
the lane is off where it cannot run beside the engine thread."""

from __future__ import annotations

import threading

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.failpoints import Failpoints
from kvsplice.engine.llm import build_engine
from kvsplice.engine.prefill_lane import PrefillLane
from kvsplice.engine.scheduler import Scheduler
from kvsplice.sampling_params import SamplingParams
from kvsplice.utils.thread_policy import ThreadPolicy

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def two_threads():
    """The lane needs an engine thread with more threads than the lane's one."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


def _prompts(lengths, vocab: int = 300, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def _engine(model_dir, failpoints=None, **kwargs):
    return build_engine(EngineConfig(model=model_dir, num_slots=4096, max_batch_tokens=32, **kwargs),
                        failpoints=failpoints)


def _run_until_done(engine, limit: int = 5000) -> dict[str, list]:
    """Step until nothing is left; every request's outputs by rid."""
    outputs: dict[str, list] = {}
    for _ in range(limit):
        if not engine.has_work():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.rid, []).append(out)
    raise AssertionError("the engine did not finish")


def _staggered(engine, prompts) -> dict[str, list]:
    """The first prompt decodes before the others arrive, so their prefill meets decode steps."""
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), rid="dec")
    while not engine.scheduler.running or not engine.scheduler.running[0].is_decoding:
        engine.step()
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(prompt, GREEDY, rid=f"p{i}")
    outputs = _run_until_done(engine)
    assert outputs[first][-1].finished
    return outputs


def _tokens(outputs) -> dict[str, list[int]]:
    return {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}


def test_tokens_with_the_lane_equal_tokens_without_it(model_dir, two_threads):
    shared = _prompts((50,), seed=3)[0]
    prompts = _prompts((6, 23, 140, 9, 75)) + [shared + [7, 8], shared + [9]]
    off = _engine(model_dir)
    on = _engine(model_dir, prefill_lane_threads=1)
    assert off.lane is None and on.lane is not None
    expected, got = _staggered(off, prompts), _staggered(on, prompts)
    assert on.lane.jobs > 0 and not on.scheduler.held
    assert _tokens(got) == _tokens(expected)
    for rid in expected:
        a = [lp.logprob for o in expected[rid] for lp in o.logprobs]
        b = [lp.logprob for o in got[rid] for lp in o.logprobs]
        assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) <= 1e-4
    on.check_integrity()
    assert on.slots_in_use() == 0
    on.close()


def _hold_a_lane_job(engine, failpoints, release):
    """A decoding request, then a long prompt whose first lane job waits at its forward."""
    engine.add_request(_prompts((6,))[0], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), rid="dec")
    while not engine.scheduler.running or not engine.scheduler.running[0].is_decoding:
        engine.step()
    reached = failpoints.pause("forward", release, rid="long")
    engine.add_request(_prompts((200,), seed=5)[0], GREEDY, rid="long")
    engine.step()
    assert reached.wait(10) and engine.lane.busy and engine.scheduler.held == {"long"}


@pytest.mark.slow  # a 400-token decode beside a held lane job
def test_decodes_go_on_while_a_lane_job_runs_and_a_held_request_is_never_scheduled(model_dir, two_threads):
    failpoints, release = Failpoints(), threading.Event()
    engine = _engine(model_dir, failpoints, prefill_lane_threads=1)
    _hold_a_lane_job(engine, failpoints, release)
    for _ in range(5):
        outs = engine.step()
        assert [o.rid for o in outs] == ["dec"]          # the decode steps keep their pace
        assert all(c.req.rid != "long" for c in engine.scheduler.schedule_prefill(64))
    release.set()
    outputs = _run_until_done(engine)
    assert outputs["long"][-1].finished and outputs["long"][-1].finish_reason == "length"
    engine.check_integrity()
    assert engine.slots_in_use() == 0


@pytest.mark.slow  # a 400-token decode beside a held lane job
def test_an_abort_of_a_held_request_waits_for_its_job_then_frees_it(model_dir, two_threads):
    failpoints, release = Failpoints(), threading.Event()
    engine = _engine(model_dir, failpoints, prefill_lane_threads=1)
    _hold_a_lane_job(engine, failpoints, release)
    timer = threading.Timer(0.3, release.set)
    timer.start()
    assert engine.abort("long")
    assert not engine.lane.busy and not engine.scheduler.held
    engine.check_integrity()
    outputs = _run_until_done(engine)
    assert outputs["long"][-1].finish_reason == "abort"
    assert outputs["dec"][-1].finished
    assert engine.slots_in_use() == 0


def test_a_failed_lane_job_fails_only_its_culprit(model_dir, two_threads):
    prompts = _prompts((6, 12, 14, 9))
    reference = _staggered(_engine(model_dir), prompts)
    failpoints = Failpoints()
    failpoints.fail("forward", rid="p1", times=None)
    engine = _engine(model_dir, failpoints, prefill_lane_threads=1)
    outputs = _staggered(engine, prompts)
    assert engine.lane.jobs > 0
    assert outputs["p1"][-1].finish_reason == "error" and "InjectedFailure" in outputs["p1"][-1].error
    tokens, expected = _tokens(outputs), _tokens(reference)
    assert {rid: tokens[rid] for rid in tokens if rid != "p1"} == {rid: expected[rid] for rid in expected if rid != "p1"}
    engine.check_integrity()
    assert engine.slots_in_use() == 0


class _FullPool:
    """A cache whose pool has no slot to grow into until some request was preempted (released)."""

    def __init__(self, preempted: list[str]):
        self.preempted = preempted

    def grow(self, req) -> bool:
        return bool(self.preempted)

    def release(self, req, cache: bool) -> None:
        self.preempted.append(req.rid)


def test_preemption_passes_over_held_requests(model_dir):
    engine = _engine(model_dir)
    for prompt in _prompts((8, 8)):
        engine.add_request(prompt, GREEDY)
    engine.step()
    growing, held = engine.scheduler.running
    preempted: list[str] = []
    sched = Scheduler(engine.config, _FullPool(preempted))
    sched.running = [growing, held]
    sched.held.add(held.rid)
    assert sched._grow_or_preempt(growing, []) == (False, 1)   # the only candidate left is itself
    assert preempted == [growing.rid] and sched.running == [held]


def test_the_lane_is_off_where_it_cannot_run_beside_the_engine(model_dir, two_threads):
    assert _engine(model_dir, prefill_lane_threads=1, fast_path=False).lane is None
    assert _engine(model_dir, prefill_lane_threads=torch.get_num_threads()).lane is None
    with pytest.raises(ValueError, match="prefill_lane_threads"):
        EngineConfig(prefill_lane_threads=-1)
    with pytest.raises(ValueError, match="at least one thread"):
        PrefillLane(0, lambda chunks: [])


def test_steps_beside_a_lane_job_take_the_threads_it_leaves(two_threads):   # (restores the count apply sets)
    policy = ThreadPolicy(compute_threads=4, lane_threads=1)
    policy.apply(decoding=True, beside_lane=True)
    assert (policy.step_threads, policy.head_threads) == (3, 3)
    policy.apply(decoding=True)
    assert (policy.step_threads, policy.head_threads) == (4, 4)
    capped = ThreadPolicy(compute_threads=4, decode_threads=2, lane_threads=1)
    capped.apply(decoding=True, beside_lane=True)
    assert (capped.step_threads, capped.head_threads) == (2, 3)


def test_the_lane_keeps_its_own_thread_count_whatever_other_threads_set_later(two_threads):
    lane = PrefillLane(1, lambda chunks: [torch.get_num_threads()])
    torch.set_num_threads(2)              # as the engine thread does after the lane is built
    lane.start(["c"])
    assert lane.take(block=True).results == [1]
    lane.close()


def test_a_lane_job_that_is_taken_back_leaves_the_lane_idle():
    lane = PrefillLane(1, lambda chunks: ["done"] * len(chunks))
    assert lane.take(block=False) is None
    lane.start(["c1", "c2"])
    with pytest.raises(RuntimeError, match="already has a job"):
        lane.start(["c3"])
    taken = lane.take(block=True)
    assert taken.results == ["done", "done"] and taken.error is None and not lane.busy
    lane.start(["c4"])
    assert lane.take(block=True).results == ["done"]
    broken = PrefillLane(1, lambda chunks: 1 / 0)
    broken.start(["c"])
    assert isinstance(broken.take(block=True).error, ZeroDivisionError)
    lane.close()
    broken.close()
