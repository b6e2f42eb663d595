"""The compiled decode step built in the background (kvsplice.models.compiled_decode): a request
issued while it builds is served on the eager step, the built graphs are taken between two steps,
and a build that fails leaves the eager step serving. A fake builder (no inductor) controls when
the build ends; it hands the eager function back as the "compiled" one."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time

import httpx
import pytest

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.models.compiled_decode import BUILD_SWITCH_INTERVAL_S, BuiltDecode, GraphSpec
from kvsplice.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class GatedBuilder:
    """Builds once `gate` is set (`building` says it started); raises `failure` if given."""

    def __init__(self, failure: Exception | None = None):
        self.gate, self.building = threading.Event(), threading.Event()
        self.failure = failure
        self.spec: GraphSpec | None = None

    def build(self, decode_fn, spec: GraphSpec) -> BuiltDecode:
        self.spec = spec
        self.building.set()
        assert self.gate.wait(60)
        if self.failure is not None:
            raise self.failure
        return BuiltDecode(decode_fn)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_gguf_like_model_dir
    return str(make_gguf_like_model_dir(tmp_path_factory.mktemp("tiny")))


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=model_dir, dtype="bfloat16", weight_format="auto", num_slots=2048, compile_decode="on")


def test_a_request_during_the_build_is_served_then_steps_switch(model_dir):
    import gc

    from kvsplice.server.api import ServerSettings
    from kvsplice.server.launch import ServerThread, build_app
    from kvsplice.server.request_log import RequestLog
    from tests.server.conftest import LineSink

    builder = GatedBuilder()
    app = build_app(_config(model_dir), ServerSettings(model_path=model_dir), RequestLog(LineSink()),
                    warm=True, decode_builder=builder)
    compiled = app.state.kvsplice.engine.runner.fast.compiled
    server = ServerThread(app)
    server.start()
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        assert builder.building.wait(10) and builder.spec.max_rows >= 2
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "compiled_decode": "building"}
        eager = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert eager.status_code == 200 and eager.json()["usage"]["completion_tokens"] == 8
        assert compiled.compiled_steps == 0 and compiled.state == "building"
        builder.gate.set()
        compiled.future.result(10)
        switched = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert switched.status_code == 200 and switched.json()["choices"][0]["text"] == eager.json()["choices"][0]["text"]
        assert compiled.compiled_steps >= 6 and compiled.fallbacks == 0
        assert httpx.get(f"{server.url}/health").json()["compiled_decode"] == "active"
    finally:
        builder.gate.set()
        server.stop()
        gc.unfreeze()   # the swap froze the start-up heap, as the server does


def test_a_failed_build_leaves_the_eager_step_and_says_so_once(model_dir, caplog):
    builder = GatedBuilder(failure=RuntimeError("no compiler today"))
    with caplog.at_level(logging.WARNING, logger="kvsplice.models.compiled_decode"):
        engine = build_engine(_config(model_dir), decode_builder=builder, wait_for_compile=False)
        compiled = engine.runner.fast.compiled
        llm = LLM(engine=engine)
        during = llm.generate([list(range(5, 20))], GREEDY)[0]
        builder.gate.set()
        with pytest.raises(RuntimeError, match="no compiler today"):
            compiled.wait(10)
        after = llm.generate([list(range(5, 20)), list(range(7, 30))], GREEDY)
    assert after[0].token_ids == during.token_ids
    assert compiled.state == "failed" and compiled.compiled_steps == 0
    assert [r.message for r in caplog.records].count(
        "compiled decode: the build failed, decode steps stay eager: RuntimeError: no compiler today") == 1
    engine.check_integrity()


class IntervalBuilder(GatedBuilder):
    """A GatedBuilder that records the interpreter's switch interval while it builds."""

    def build(self, decode_fn, spec: GraphSpec) -> BuiltDecode:
        self.interval = sys.getswitchinterval()
        return super().build(decode_fn, spec)


@pytest.mark.parametrize("failure", [None, RuntimeError("no compiler today")])
def test_the_build_runs_at_a_short_switch_interval_and_sets_it_back(model_dir, failure):
    """Tracing holds the GIL that every eager step's torch calls take back: the build runs at
    BUILD_SWITCH_INTERVAL_S, and the process's own interval is back once it ends either way."""
    before = sys.getswitchinterval()
    builder = IntervalBuilder(failure)
    builder.gate.set()
    engine = build_engine(_config(model_dir), decode_builder=builder, wait_for_compile=False)
    compiled = engine.runner.fast.compiled
    compiled.start()
    assert compiled.future.exception(10) is failure
    assert builder.interval == pytest.approx(BUILD_SWITCH_INTERVAL_S) and builder.interval < before
    assert sys.getswitchinterval() == before


def test_build_engine_waits_for_the_build_by_default(model_dir):
    builder = GatedBuilder()
    builder.gate.set()
    engine = build_engine(_config(model_dir), decode_builder=builder)
    assert engine.runner.fast.compiled.state == "active"
    [out] = LLM(engine=engine).generate([list(range(5, 20))], GREEDY)
    assert engine.runner.fast.compiled.compiled_steps >= GREEDY.max_tokens - 2


def test_auto_is_decided_at_build_time(model_dir, caplog):
    """auto on a dense float32 model stays eager, naming why (whatever this machine's CPU)."""
    with caplog.at_level(logging.INFO, logger="kvsplice.engine.llm"):
        engine = build_engine(EngineConfig(model=model_dir, dtype="float32", weight_format="dense", num_slots=256,
                                           compile_decode="auto"))
    assert engine.runner.fast.compiled is None and engine.config.compile_decode == "off"
    [line] = [r.message for r in caplog.records if r.message.startswith("compiled decode:")]
    assert "auto: eager" in line and "float32" in line


class SlowerBuilder:
    """Hands back a "compiled" step slower than the eager one, with its inputs to be measured on
    (as InductorBuilder does under auto)."""

    def build(self, decode_fn, spec: GraphSpec) -> BuiltDecode:
        from kvsplice.models.compiled_decode import _warm_up

        def slower(*args):
            time.sleep(0.02)
            return decode_fn(*args)

        return BuiltDecode(slower, trial_inputs=_warm_up(decode_fn, spec))


def test_a_compiled_step_that_measures_slower_leaves_the_eager_step(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kvsplice.models.compiled_decode"):
        engine = build_engine(_config(model_dir), decode_builder=SlowerBuilder())
    compiled = engine.runner.fast.compiled
    assert compiled.state == "eager" and compiled.verdict.use_compiled == (False, False)
    [line] = [r.message for r in caplog.records if "measured on the live model" in r.message]
    assert line.startswith("compiled decode: the eager step stays (not 5% faster)")
    expected = LLM(engine=build_engine(dataclasses.replace(_config(model_dir), compile_decode="off")))
    prompts = [list(range(5, 20)), list(range(7, 30))]
    assert [r.token_ids for r in LLM(engine=engine).generate(prompts, GREEDY)] == \
        [r.token_ids for r in expected.generate(prompts, GREEDY)]
    assert compiled.compiled_steps == 0 and compiled.fallbacks == 0
