"""AsyncEngine: a refused request (duplicate id, full queue) is refused at once on the asyncio side
without touching anyone else's stream; a failed request ends its own stream; a step loop that
cannot go on stops the engine loudly (alive False, every stream and call told, the fatal hook)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvsplice.config import EngineConfig
from kvsplice.engine.async_engine import AsyncEngine, EngineDeadError
from kvsplice.engine.engine import QueueFullError, RequestFailedError
from kvsplice.engine.failpoints import Failpoints
from kvsplice.engine.llm import build_engine
from kvsplice.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-async")))


def started(model_dir, failpoints=None, on_fatal=None, **engine_kwargs) -> AsyncEngine:
    engine = build_engine(EngineConfig(model=model_dir, **engine_kwargs), failpoints=failpoints)
    async_engine = AsyncEngine(engine, on_fatal=on_fatal)
    async_engine.start()
    return async_engine


async def collect(gen, timeout_s: float = 30.0) -> list:
    async def drain():
        return [out async for out in gen]
    return await asyncio.wait_for(drain(), timeout_s)


async def first_output(gen, timeout_s: float = 60.0):   # generous: CI machines may be busy
    return await asyncio.wait_for(gen.__anext__(), timeout_s)


def test_duplicate_rid_is_refused_and_the_victim_stream_goes_on(model_dir):
    failpoints = Failpoints()
    async_engine = started(model_dir, failpoints)

    async def main():
        victim = async_engine.generate(PROMPT, PARAMS, "same")
        first = await first_output(victim)
        release = threading.Event()
        reached = failpoints.pause("step", release)   # the victim is surely still running
        await asyncio.to_thread(reached.wait, 10)
        with pytest.raises(ValueError, match="already in use"):
            await first_output(async_engine.generate(PROMPT, PARAMS, "same"))
        release.set()
        return [first] + await collect(victim)

    try:
        outs = asyncio.run(main())
    finally:
        async_engine.stop()
    assert sum(len(o.new_token_ids) for o in outs) == PARAMS.max_tokens
    assert outs[-1].finish_reason == "length"


def test_queue_full_is_answered_without_waiting_for_the_engine_thread(model_dir):
    """With the engine thread held inside a step, the request beyond max_waiting is refused while
    the step still runs (it never waited for it)."""
    failpoints = Failpoints()
    release = threading.Event()
    reached = failpoints.pause("forward", release)
    async_engine = started(model_dir, failpoints, max_running=1, max_waiting=2)

    async def main():
        running = asyncio.ensure_future(collect(async_engine.generate(PROMPT, PARAMS, "a")))
        await asyncio.to_thread(reached.wait, 10)
        queued = [asyncio.ensure_future(collect(async_engine.generate(PROMPT, PARAMS, rid))) for rid in "bc"]
        while async_engine.queued() < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError):
            await first_output(async_engine.generate(PROMPT, PARAMS, "d"))
        assert not release.is_set() and async_engine.engine.counters.forward_steps == 0
        release.set()
        return await asyncio.gather(running, *queued)

    try:
        results = asyncio.run(main())
    finally:
        async_engine.stop()
    assert [outs[-1].finish_reason for outs in results] == ["length"] * 3
    assert async_engine.queued() == 0


def test_a_failed_request_ends_its_own_stream_only(model_dir):
    failpoints = Failpoints()
    failpoints.fail("forward", rid="bad", times=None, after=2)
    async_engine = started(model_dir, failpoints)

    async def main():
        good = asyncio.ensure_future(collect(async_engine.generate(PROMPT, PARAMS, "good")))
        with pytest.raises(RequestFailedError, match="request bad failed") as failed:
            await collect(async_engine.generate(PROMPT[::-1], PARAMS, "bad"))
        assert failed.value.rid == "bad"
        return await good

    try:
        outs = asyncio.run(main())
        assert outs[-1].finish_reason == "length" and async_engine.alive
    finally:
        async_engine.stop()
    async_engine.engine.check_integrity()
    assert async_engine.engine.slots_in_use() == 0


def test_one_failed_step_is_survived(model_dir):
    failpoints = Failpoints()
    failpoints.fail("step", times=1)
    async_engine = started(model_dir, failpoints)
    try:
        outs = asyncio.run(collect(async_engine.generate(PROMPT, PARAMS, "x")))
        assert outs[-1].finish_reason == "length" and async_engine.alive
        assert failpoints.fired["step"] == 1
    finally:
        async_engine.stop()


def test_a_step_loop_that_keeps_failing_stops_the_engine_loudly(model_dir):
    failpoints = Failpoints()
    failpoints.fail("step", times=None)
    fatal: list[BaseException] = []
    died = threading.Event()
    async_engine = started(model_dir, failpoints, on_fatal=lambda exc: (fatal.append(exc), died.set()))

    async def main():
        with pytest.raises(EngineDeadError):
            await collect(async_engine.generate(PROMPT, PARAMS, "x"))
        assert died.wait(10)
        with pytest.raises(EngineDeadError):
            await async_engine.call(lambda: True)

    try:
        asyncio.run(main())
    finally:
        async_engine.stop()
    assert not async_engine.alive and len(fatal) == 1 and isinstance(fatal[0], EngineDeadError)
    assert failpoints.fired["step"] == 3
