"""warm_up: throwaway requests run through the engine before it serves, leaving it as it was."""

from __future__ import annotations

import pytest

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.engine.warmup import warm_up
from kvsplice.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("lane", [0, 1])
def test_warm_up_leaves_the_pool_and_counters_as_they_were(model_dir, lane):
    from kvsplice.utils.thread_policy import intra_op_threads

    with intra_op_threads(2):   # a prefill lane needs fewer threads than the engine's
        engine = build_engine(EngineConfig(model=model_dir, num_slots=512, max_batch_tokens=32,
                                           prefill_lane_threads=lane))
        free_before = engine.cache.allocator.num_free
        done = warm_up(engine)
    assert done.tokens == 8 and done.steps >= 4 + 3   # a 96-token prompt in chunks of 32, then decodes
    assert engine.cache.radix.cached_size() == 0 and not engine.has_work()
    assert engine.counters.requests_finished == engine.counters.generation_tokens == 0
    assert engine.cache.allocator.num_free == free_before
    engine.check_integrity()
    # and it serves as before
    [out] = LLM(engine=engine).generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 3


def test_warm_up_keeps_what_the_tree_held_before(model_dir):
    engine = build_engine(EngineConfig(model=model_dir, num_slots=512))
    LLM(engine=engine).generate([list(range(3, 40))], SamplingParams(max_tokens=2, temperature=0.0))
    cached = engine.cache.radix.cached_size()
    assert cached > 0
    warm_up(engine)
    assert engine.cache.radix.cached_size() >= cached
    engine.check_integrity()
    with pytest.raises(RuntimeError, match="idle"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
        warm_up(engine)
