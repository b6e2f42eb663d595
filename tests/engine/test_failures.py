"""The engine never dies of a request: a failure injected at each stage (kvsplice.engine.failpoints)
for one request among several running concurrently fails that request only (or, while planning
SCR, serves it by prefix caching), the others' outputs equal a run without the fault, the pool
adds up, nothing stays in use, and the engine serves new requests afterwards."""

from __future__ import annotations

import logging

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.engine import RequestFailedError
from kvsplice.engine.failpoints import Failpoints, InjectedFailure
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

SCR = ReuseConfig(match_min_tokens=16, min_span=8, tail=4, max_spans=6)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM, TOOL_RESULT, NOTES, TAIL = ids(40, 1), ids(30, 2), ids(100, 3), ids(60, 4)
TURN1 = SYSTEM + TOOL_RESULT + NOTES + TAIL
TURN2 = SYSTEM + ids(10, 5) + NOTES + TAIL + ids(10, 6)   # the tool result replaced: relocates NOTES, TAIL
OTHERS = {f"other-{i}": ids(50 + 7 * i, 20 + i) for i in range(3)}
AFTER = ids(45, 30)
CULPRIT = "culprit"
# planning stages fall back to prefix caching; the rest fail the request
FALLBACK_STAGES = ("match", "diff", "plan")
FAILING_STAGES = ("relocate", "forward", "sample", "detokenize")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-failures")))


def drain(engine) -> dict[str, list]:
    """Step until idle; every output by rid."""
    outputs: dict[str, list] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.rid, []).append(out)
    return outputs


def tokens_and_lps(outs) -> tuple[list[int], list[float]]:
    return ([t for o in outs for t in o.new_token_ids], [lp.logprob for o in outs for lp in o.logprobs])


def assert_same(a, b, atol=1e-4):
    assert a[0] == b[0]
    assert all(abs(x - y) <= atol for x, y in zip(a[1], b[1]))


def scenario(model_dir, failpoints=None, **engine_kwargs):
    """Turn 1 of a conversation; then three other requests start, and while they decode the
    conversation's edited turn 2 (`culprit`, served by SCR) joins their batch; then one more request
    on the idle engine. Returns (engine, outputs by rid)."""
    engine = build_engine(EngineConfig(model=model_dir, reuse=SCR, **engine_kwargs), failpoints=failpoints)
    engine.add_request(TURN1, GREEDY, rid="turn1", session_id="conv")
    outputs = drain(engine)
    for rid, prompt in OTHERS.items():
        engine.add_request(prompt, GREEDY, rid=rid)
    outputs.update({out.rid: [out] for out in engine.step()})   # the others' prefill
    engine.add_request(TURN2, GREEDY, rid=CULPRIT, session_id="conv")
    for rid, outs in drain(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    assert_idle_and_whole(engine)
    engine.add_request(AFTER, GREEDY, rid="after")
    outputs.update(drain(engine))
    assert_idle_and_whole(engine)
    return engine, outputs


def assert_idle_and_whole(engine) -> None:
    """Pool conservation, no request holding a slot, no session in flight."""
    engine.check_integrity()
    assert engine.num_running() == engine.num_waiting() == 0
    assert engine.cache.held_by(engine.scheduler.running) == 0
    assert all(session.inflight == 0 for session in engine.reuse.sessions.sessions())
    assert not engine._reqs and not engine._failed


@pytest.fixture(scope="module")
def baseline(model_dir):
    _, outputs = scenario(model_dir)
    assert outputs[CULPRIT][-1].reuse.relocated_tokens > 0   # the culprit really goes through SCR
    return {rid: tokens_and_lps(outs) for rid, outs in outputs.items()}


@pytest.fixture(scope="module")
def exact_turn2(model_dir):
    """TURN2 computed exactly (no SCR), as prefix caching serves it."""
    engine = build_engine(EngineConfig(model=model_dir, prefix_cache=False))
    engine.add_request(TURN2, GREEDY, rid="cold")
    return tokens_and_lps(drain(engine)["cold"])


def assert_others_unharmed(outputs, baseline) -> None:
    for rid in (*OTHERS, "turn1", "after"):
        assert outputs[rid][-1].finish_reason == "length" and outputs[rid][-1].error is None, rid
        assert_same(tokens_and_lps(outputs[rid]), baseline[rid])


@pytest.mark.parametrize("stage", FAILING_STAGES)
def test_a_failure_fails_only_that_request(model_dir, baseline, stage, caplog):
    failpoints = Failpoints()
    failpoints.fail(stage, rid=CULPRIT, times=None)
    with caplog.at_level(logging.ERROR, logger="kvsplice.engine.engine"):
        engine, outputs = scenario(model_dir, failpoints)
    assert failpoints.fired[stage] >= 1
    last = outputs[CULPRIT][-1]
    assert last.finished and last.finish_reason == "error"
    assert f"stage {stage!r} for request {CULPRIT}" in last.error
    assert engine.counters.requests_failed == 1
    logged = [r for r in caplog.records if CULPRIT in r.getMessage() and r.exc_info]
    assert logged and logged[0].exc_info[0] is InjectedFailure   # the traceback is logged
    assert_others_unharmed(outputs, baseline)


@pytest.mark.parametrize("stage", FALLBACK_STAGES)
def test_a_planning_failure_falls_back_to_exact_prefix_caching(model_dir, baseline, exact_turn2, stage, caplog):
    failpoints = Failpoints()
    failpoints.fail(stage, rid=CULPRIT, times=None)
    with caplog.at_level(logging.ERROR, logger="kvsplice.engine.reuse_manager"):
        engine, outputs = scenario(model_dir, failpoints)
    assert failpoints.fired[stage] >= 1
    last = outputs[CULPRIT][-1]
    assert last.finish_reason == "length" and last.error is None
    assert last.reuse.fallback == "error" and last.reuse.relocated_tokens == 0
    last.reuse.check(len(TURN2))
    assert_same(tokens_and_lps(outputs[CULPRIT]), exact_turn2)
    assert engine.reuse.fallbacks["error"] == 1
    assert any(CULPRIT in r.getMessage() and r.exc_info for r in caplog.records)
    assert_others_unharmed(outputs, baseline)


def test_a_batch_only_failure_fails_nobody(model_dir, baseline):
    """A forward that fails once for the batch but not for any chunk alone: every request goes on."""
    failpoints = Failpoints()
    failpoints.fail("forward", rid=CULPRIT, times=1)
    engine, outputs = scenario(model_dir, failpoints)
    assert failpoints.fired["forward"] == 1 and engine.counters.requests_failed == 0
    for rid in baseline:
        assert_same(tokens_and_lps(outputs[rid]), baseline[rid])


def test_a_failed_step_escapes_and_the_next_one_goes_on(model_dir, baseline):
    """A failure outside every request's handling leaves the engine as it was: `step()` raises
    (the caller decides), and stepping again serves everyone."""
    failpoints = Failpoints()
    engine = build_engine(EngineConfig(model=model_dir, reuse=SCR), failpoints=failpoints)
    engine.add_request(TURN1, GREEDY, rid="turn1")
    failpoints.fail("step")
    with pytest.raises(InjectedFailure):
        engine.step()
    outputs = drain(engine)
    assert_same(tokens_and_lps(outputs["turn1"]), baseline["turn1"])
    assert_idle_and_whole(engine)


def test_llm_raises_request_failed_after_the_others_end(model_dir, baseline):
    failpoints = Failpoints()
    failpoints.fail("detokenize", rid="req-1", after=2)
    llm = LLM(engine=build_engine(EngineConfig(model=model_dir), failpoints=failpoints))
    with pytest.raises(RequestFailedError, match="req-1"):
        llm.generate([OTHERS["other-0"], OTHERS["other-1"]], GREEDY)
    assert_idle_and_whole(llm.engine)
    [result] = llm.generate([OTHERS["other-2"]], GREEDY)
    assert_same((result.token_ids, [lp.logprob for lp in result.logprobs]), baseline["other-2"])


# ----- hybrid models: a failed forward may have advanced states, so the batch is recomputed ---------

@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    import json

    from models.test_hybrid import hf_tiny
    from tiny_model import make_tokenizer_files

    path = tmp_path_factory.mktemp("tiny-hybrid-failures")
    vocab = make_tokenizer_files(path)
    eos_id = json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    model = hf_tiny("qwen3_5_text", seed=7, vocab_size=vocab, eos_token_id=eos_id)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


HYBRID_PROMPTS = {"other-0": ids(30, 40), "other-1": ids(36, 41)}
HYBRID_CULPRIT = ids(40, 42)


def hybrid_run(hybrid_dir, failpoints=None):
    """Two requests decode while a third joins their batch; outputs (tokens, logprobs) by rid."""
    engine = build_engine(EngineConfig(model=hybrid_dir, reuse=SCR.replace(enabled=False, checkpoint_policy="every:16")),
                          failpoints=failpoints)
    for rid, prompt in HYBRID_PROMPTS.items():
        engine.add_request(prompt, GREEDY, rid=rid)
    outputs = {out.rid: [out] for out in engine.step()}
    engine.add_request(HYBRID_CULPRIT, GREEDY, rid=CULPRIT)
    for rid, outs in drain(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    engine.check_integrity()
    assert engine.num_running() == 0 and engine.cache.held_by(engine.scheduler.running) == 0
    return engine, {rid: tokens_and_lps(outs) for rid, outs in outputs.items()}, outputs


@pytest.fixture(scope="module")
def hybrid_expected(hybrid_dir):
    return hybrid_run(hybrid_dir)[1]


@pytest.mark.parametrize("times", [None, 1], ids=["culprit-fails-alone", "batch-only"])
def test_hybrid_batch_failure_recomputes_the_innocent(hybrid_dir, hybrid_expected, times):
    """Sampling fails after the forward advanced every request's linear-layer state: running the
    chunks again would advance them twice, so they are recomputed (and then run alone)."""
    expected = hybrid_expected
    failpoints = Failpoints()
    failpoints.fail("sample", rid=CULPRIT, times=times, after=1)   # while the others decode
    engine, got, outputs = hybrid_run(hybrid_dir, failpoints)
    assert failpoints.fired["sample"] >= 1
    assert engine.counters.preemptions >= len(HYBRID_PROMPTS)   # their states were unknown: recomputed
    for rid in HYBRID_PROMPTS:
        assert_same(got[rid], expected[rid])
    if times is None:
        assert outputs[CULPRIT][-1].finish_reason == "error" and engine.counters.requests_failed == 1
    else:
        assert_same(got[CULPRIT], expected[CULPRIT])
