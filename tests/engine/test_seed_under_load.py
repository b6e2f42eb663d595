"""A seeded request gives the same tokens alone and beside 8 concurrent requests (tiny model, fp32).

Beside others its prefill shares a step with their prompts or their decode rows, and its decode
rows are batched with theirs. The sampler draws from the request's own generator only (one uniform
per token), so only the logits could change the tokens; at float32 they agree with the lone run's
to rounding (the kernels' blocking follows the step's row count), well within LOGPROB_TOLERANCE, as
docs/COMPATIBILITY.md states.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.sampling_params import SamplingParams

LOGPROB_TOLERANCE = 1e-4   # the bound docs/COMPATIBILITY.md gives for float32
TARGET = SamplingParams(temperature=1.0, top_p=0.95, seed=2024, max_tokens=24, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def neighbours() -> list[tuple[list[int], SamplingParams]]:
    """8 requests of different lengths and sampling settings (greedy, seeded, unseeded, filters)."""
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
             SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=0.6, min_p=0.1, seed=3)]
    return [(prompt_ids(10 + 9 * i, seed=100 + i),
             replace(kinds[i % 4], max_tokens=16 + 3 * i, ignore_eos=True))
            for i in range(8)]


def make_llm(model_dir, **kwargs) -> LLM:
    return LLM(engine=build_engine(EngineConfig(model=model_dir, prefix_cache=False, **kwargs)))


def run_until_done(engine, rids: list[str]) -> dict[str, list]:
    outs = {rid: [] for rid in rids}
    while any(not o or not o[-1].finished for o in outs.values()):
        for out in engine.step():
            outs[out.rid].append(out)
    return outs


def assert_close(logprobs: list, expected: list) -> None:
    assert max(abs(a.logprob - b.logprob) for a, b in zip(logprobs, expected)) <= LOGPROB_TOLERANCE


def tokens_and_logprobs(outs: list) -> tuple[list[int], list[float]]:
    return [t for o in outs for t in o.new_token_ids], [lp.logprob for o in outs for lp in o.logprobs]


@pytest.mark.parametrize("extra", [{}, {"max_batch_tokens": 32}, {"decode_arena_tokens": 0}])
def test_seeded_request_alone_equals_beside_eight_concurrent(model_dir, extra):
    target = prompt_ids(37, seed=7)
    [alone] = make_llm(model_dir, **extra).generate([target], TARGET)

    llm = make_llm(model_dir, **extra)
    together = llm.generate([p for p, _ in neighbours()] + [target], [sp for _, sp in neighbours()] + [TARGET])
    assert together[-1].token_ids == alone.token_ids
    assert_close(together[-1].logprobs, alone.logprobs)

    # arriving while the others decode: its prefill shares their decode steps
    engine = make_llm(model_dir, **extra).engine
    others = [engine.add_request(p, sp) for p, sp in neighbours()]
    for _ in range(3):
        engine.step()
    rid = engine.add_request(target, TARGET)
    tokens, logprobs = tokens_and_logprobs(run_until_done(engine, [rid] + others)[rid])
    assert tokens == alone.token_ids
    assert max(abs(a - b.logprob) for a, b in zip(logprobs, alone.logprobs)) <= LOGPROB_TOLERANCE
    engine.check_integrity()


def test_same_seed_again_with_the_prompt_cached(model_dir):
    """Run again on a warm engine the prompt comes from the prefix cache (one row prefilled, not 37):
    the same tokens."""
    target = prompt_ids(37, seed=7)
    llm = LLM(engine=build_engine(EngineConfig(model=model_dir)))
    [first] = llm.generate([target], TARGET)
    [again] = llm.generate([target], TARGET)
    assert again.reuse.prefix_tokens > 0
    assert again.token_ids == first.token_ids
    assert_close(again.logprobs, first.logprobs)


def test_other_seed_gives_other_tokens(model_dir):
    target = prompt_ids(37, seed=7)
    llm = make_llm(model_dir)
    [a] = llm.generate([target], TARGET)
    [b] = llm.generate([target], replace(TARGET, seed=2025))
    assert a.token_ids != b.token_ids
