"""Engine end to end on a tiny random model: prefix reuse is exact, batching/chunking/preemption
keep results identical, aborts and small pools leak nothing."""

from __future__ import annotations

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def make_llm(model_dir, **kwargs) -> LLM:
    return LLM(engine=build_engine(EngineConfig(model=model_dir, **kwargs)))


def prompt_ids(n: int, seed: int, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()


def assert_same_result(a, b, atol=1e-4):
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert abs(x.logprob - y.logprob) <= atol
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_prefix_hit_matches_cold_run(model_dir):
    """A request sharing a prefix with an earlier one gets the cold run's logits, and says how
    many prompt tokens came from the radix cache."""
    shared = prompt_ids(40, seed=1)
    first, second = shared + prompt_ids(10, seed=2), shared + prompt_ids(12, seed=3)
    warm = make_llm(model_dir)
    warm.generate([first], GREEDY)
    [hit] = warm.generate([second], GREEDY)
    [cold] = make_llm(model_dir, prefix_cache=False).generate([second], GREEDY)
    assert hit.reuse.prefix_tokens == 40
    assert hit.reuse.prefilled_tokens == len(second) - 40
    assert cold.reuse.prefix_tokens == 0
    assert_same_result(hit, cold)
    warm.engine.check_integrity()


def test_batched_chunked_equals_one_at_a_time(model_dir):
    """Continuous batching and chunked prefill (tiny token budget) change nothing."""
    prompts = [prompt_ids(30 + 7 * i, seed=10 + i) for i in range(5)]
    alone = [make_llm(model_dir, prefix_cache=False).generate([p], GREEDY)[0] for p in prompts]
    batched = make_llm(model_dir, prefix_cache=False, max_batch_tokens=16).generate(prompts, GREEDY)
    for a, b in zip(alone, batched):
        assert_same_result(a, b)


def test_small_pool_all_requests_finish(model_dir):
    """32 concurrent requests against a pool too small for all of them: every one finishes
    (queued or preempted), results match unconstrained runs, and no slot stays in use."""
    prompts = [prompt_ids(20, seed=100 + i) for i in range(32)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    small = make_llm(model_dir, num_slots=128, max_batch_tokens=64)
    results = small.generate(prompts, params)
    reference = make_llm(model_dir).generate(prompts, params)
    assert all(r.finish_reason == "length" and len(r.token_ids) == 12 for r in results)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert small.engine.counters.preemptions > 0
    assert small.engine.slots_in_use() == 0
    small.engine.check_integrity()


def test_abort_at_any_point_frees_slots(model_dir):
    """Aborting while waiting, mid-prefill and mid-decode frees every slot."""
    llm = make_llm(model_dir, max_batch_tokens=8, max_running=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(prompt_ids(30, seed=s), params) for s in range(3)]
    engine.step()                         # rids[0] mid-prefill, the others waiting
    assert engine.abort(rids[2])          # waiting
    assert engine.abort(rids[0])          # mid-prefill
    for _ in range(8):
        engine.step()                     # rids[1] admitted and decoding
    assert engine.abort(rids[1])          # mid-decode
    finals = [o for _ in range(3) for o in engine.step() if o.finished]
    assert {o.rid for o in finals} >= {rids[1]}
    assert not engine.has_work()
    assert engine.slots_in_use() == 0
    engine.check_integrity()


def test_stream_yields_deltas_and_close_aborts(model_dir):
    llm = make_llm(model_dir)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = list(llm.stream(prompt_ids(10, seed=5), params))
    assert [len(o.new_token_ids) for o in outs] == [1] * 6 and outs[-1].finished
    stream = llm.stream(prompt_ids(10, seed=6), SamplingParams(max_tokens=40, temperature=0.0))
    next(stream)
    stream.close()
    assert llm.engine.slots_in_use() == 0


def test_bad_requests_raise_value_error(model_dir):
    engine = make_llm(model_dir, num_slots=256).engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([10**7], SamplingParams())
    with pytest.raises(ValueError, match="logprob_token_ids: token id 10000000 is outside the vocabulary"):
        engine.add_request([1, 2], SamplingParams(logprobs=0, logprob_token_ids=[3, 10**7]))
    with pytest.raises(ValueError, match="allowed_token_ids: token id 10000000 is outside the vocabulary"):
        engine.add_request([1, 2], SamplingParams(allowed_token_ids=[3, 10**7]))
    with pytest.raises(ValueError, match="context limit"):
        engine.add_request(prompt_ids(250, seed=0), SamplingParams(max_tokens=10))
