"""Suffix Cache Reuse inside the engine, on a tiny random model: what must be exact is exact,
relocated keys are the keys a fresh forward would store, namespaces never mix, nothing leaks."""

from __future__ import annotations

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.engine.request import Namespace
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

SMALL_SCR = ReuseConfig(match_min_tokens=16, min_span=8, tail=4, max_spans=6)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-scr")))


def make_llm(model_dir, reuse=SMALL_SCR, **kwargs) -> LLM:
    return LLM(engine=build_engine(EngineConfig(model=model_dir, reuse=reuse, **kwargs)))


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 300, (n,), generator=g).tolist()


SYSTEM, TOOL_RESULT, NOTES, TAIL = ids(40, 1), ids(30, 2), ids(100, 3), ids(60, 4)
TURN1 = SYSTEM + TOOL_RESULT + NOTES + TAIL
TURN2 = SYSTEM + ids(10, 5) + NOTES + TAIL + ids(10, 6)   # tool result replaced by a short note


def cold(model_dir, prompt, params=GREEDY):
    return make_llm(model_dir, prefix_cache=False).generate([prompt], params)[0]


def assert_close(a, b, atol=1e-4):
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert abs(x.logprob - y.logprob) <= atol


def test_no_edit_and_append_are_exact(model_dir):
    """Repeating a prompt, or appending to the previous sequence, gives the cold run's logits."""
    llm = make_llm(model_dir)
    first = llm.generate([TURN1], GREEDY, session_id="c1")[0]
    again = llm.generate([TURN1], GREEDY, session_id="c1")[0]
    assert_close(again, cold(model_dir, TURN1))
    appended = TURN1 + first.token_ids + ids(12, 7)
    nxt = llm.generate([appended], GREEDY, session_id="c1")[0]
    assert nxt.reuse.session == "matched" and nxt.reuse.relocated_tokens == 0
    assert nxt.reuse.prefix_tokens >= len(TURN1)
    assert_close(nxt, cold(model_dir, appended))
    llm.engine.check_integrity()


def test_edit_relocates_and_accounting_holds(model_dir):
    """A middle edit relocates the surviving spans; prompt = prefix + relocated + prefilled."""
    llm = make_llm(model_dir)
    llm.generate([TURN1], GREEDY, session_id="c2")
    out = llm.generate([TURN2], GREEDY, session_id="c2")[0]
    stats = out.reuse
    assert stats.session == "matched" and stats.fallback is None
    assert stats.prefix_tokens == len(SYSTEM)
    assert stats.relocated_spans >= 1 and stats.relocated_tokens >= len(NOTES) - SMALL_SCR.tail
    stats.check(len(TURN2))
    assert llm.engine.counters.relocated_tokens == stats.relocated_tokens
    llm.engine.check_integrity()


def _relocated_layer0_keys(llm, prompt, session_id):
    """Admit `prompt` (one step), return (plan, layer-0 keys at the plan's relocated slots)."""
    engine = llm.engine
    rid = engine.add_request(prompt, GREEDY, session_id=session_id)
    engine.step()
    req = engine._reqs[rid]
    plan = req.scr.plan
    slots = torch.cat([req.seq_slots[k.dst_pos:k.dst_end] for k in plan.keeps])
    keys = engine.cache.pool.k[0][slots].clone()
    while engine.has_work():
        engine.step()
    return plan, keys


def _fresh_layer0_keys(model_dir, prompt, plan):
    llm = make_llm(model_dir)
    llm.generate([prompt], GREEDY)
    match = llm.engine.cache.radix.match_prefix(prompt, Namespace(None, None))
    offsets = torch.cat([torch.arange(k.dst_pos, k.dst_end) for k in plan.keeps])
    return llm.engine.cache.pool.k[0][match.slots[offsets]]


def test_relocated_layer0_keys_equal_fresh_ones(model_dir):
    """Layer 0 sees only its own token, so relocated + re-rotated keys must equal freshly
    computed keys at the new positions; without re-rotation (the control) they must not."""
    llm = make_llm(model_dir)
    llm.generate([TURN1], GREEDY, session_id="c3")
    plan, keys = _relocated_layer0_keys(llm, TURN2, "c3")
    assert any(k.delta != 0 for k in plan.keeps)
    fresh = _fresh_layer0_keys(model_dir, TURN2, plan)
    torch.testing.assert_close(keys, fresh, atol=1e-5, rtol=1e-5)

    control = make_llm(model_dir, reuse=SMALL_SCR.replace(no_rerotate=True))
    control.generate([TURN1], GREEDY, session_id="c3")
    _, unrotated = _relocated_layer0_keys(control, TURN2, "c3")
    assert (unrotated - fresh).abs().max() > 1e-2


def test_other_salt_never_relocates_and_tree_stays_exact(model_dir):
    """Another cache_salt never matches the session; a request sharing the edited sequence's
    prefix gets only exact K/V from the tree (its logits equal a cold run's)."""
    llm = make_llm(model_dir)
    llm.generate([TURN1], GREEDY, cache_salt="tenant-a")
    other = llm.generate([TURN2], GREEDY, cache_salt="tenant-b")[0]
    assert other.reuse.relocated_tokens == 0 and other.reuse.prefix_tokens == 0
    edited = llm.generate([TURN2], GREEDY, cache_salt="tenant-a")[0]
    assert edited.reuse.relocated_tokens > 0
    # shares TURN2's first 120 tokens, which include relocated entries after offset 50
    sibling = TURN2[:120] + ids(15, 9)
    out = llm.generate([sibling], GREEDY, cache_salt="tenant-a",
                       scr="off")[0]
    # the first relocated span's recomputed seam attends only to exact K/V, so it is exact too
    assert out.reuse.prefix_tokens <= len(SYSTEM) + 10 + SMALL_SCR.seam_tokens
    assert_close(out, cold(model_dir, sibling))
    llm.engine.check_integrity()


def test_scr_off_per_request(model_dir):
    """`scr="off"` and the seed's "kvreuse:off" salt both serve by prefix caching only."""
    llm = make_llm(model_dir)
    llm.generate([TURN1], GREEDY, session_id="c5")
    off = llm.generate([TURN2], GREEDY, session_id="c5", scr="off")[0]
    assert off.reuse.session == "off" and off.reuse.relocated_tokens == 0
    salted = llm.generate([TURN2], GREEDY, cache_salt="kvreuse:off")[0]
    assert salted.reuse.session == "off"
    with pytest.raises(ValueError):
        llm.generate([TURN2], GREEDY, scr={"no_such_setting": 1})


def test_small_pool_with_sessions_leaks_nothing(model_dir):
    """Many edited conversations against a small pool: sessions are evicted under pressure,
    every request finishes, and the pool balances."""
    llm = make_llm(model_dir, num_slots=700, max_batch_tokens=64)
    for conv in range(6):
        llm.generate([TURN1 + ids(5, 100 + conv)], GREEDY, session_id=f"s{conv}")
    outs = llm.generate([TURN2 + ids(5, 200 + c) for c in range(6)], GREEDY)
    assert all(o.finish_reason == "length" for o in outs)
    for o, c in zip(outs, range(6)):
        o.reuse.check(len(TURN2) + 5)
    llm.engine.check_integrity()
    llm.engine.flush_cache()
    llm.engine.check_integrity()
    assert llm.engine.slots_in_use() == 0


def test_prompt_logprobs_say_why_and_keep_the_session_for_the_next_turn(model_dir):
    """Prompt logprobs need every position computed: no relocation, fallback "prompt_logprobs", the
    logprobs those of a cold run; the session still takes the turn, so the next edit relocates."""
    llm = make_llm(model_dir)
    llm.generate([TURN1], GREEDY, session_id="c-lp")
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    scored = llm.generate([TURN2], scoring, session_id="c-lp")[0]
    assert scored.reuse.session == "matched" and scored.reuse.fallback == "prompt_logprobs"
    assert scored.reuse.relocated_tokens == 0 and scored.reuse.prefilled_tokens == len(TURN2)
    reference = cold(model_dir, TURN2, scoring)
    for ours, theirs in zip(scored.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert abs(ours.logprob - theirs.logprob) <= 1e-4
    edited = SYSTEM + NOTES + TAIL + ids(10, 6) + ids(8, 9)
    after = llm.generate([edited], GREEDY, session_id="c-lp")[0]
    assert after.reuse.session == "matched" and after.reuse.relocated_tokens > 0
    llm.engine.check_integrity()
