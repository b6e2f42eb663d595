"""Sampler: greedy, seeded reproducibility, filters' allowed sets, temperature, logprobs."""

import math

import pytest
import torch

from kvsplice.layers.sampler import (
    TokenLogprob,
    filtered_probs,
    filtered_probs_reference,
    logprobs_of,
    make_generator,
    sample,
)
from kvsplice.sampling_params import SamplingParams

# A crafted distribution over 6 tokens, listed most likely first after a shuffle of ids, so that
# "first k tokens" bugs (ignoring the sort) show up.
_PROBS = {3: 0.40, 0: 0.25, 5: 0.15, 1: 0.10, 4: 0.06, 2: 0.04}


def _crafted_logits() -> torch.Tensor:
    """Logits [6] whose softmax is _PROBS (shifted by a constant, which softmax ignores)."""
    logits = torch.empty(6)
    for token_id, prob in _PROBS.items():
        logits[token_id] = math.log(prob) + 3.0
    return logits


def _draw_many(logits_row: torch.Tensor, params: SamplingParams, draws: int, seed: int) -> list[int]:
    """`draws` independent seeded draws: one batch of identical rows, one generator each."""
    logits = logits_row.expand(draws, -1).contiguous()
    generators = [make_generator(seed + offset) for offset in range(draws)]
    token_ids, _ = sample(logits, [params] * draws, generators)
    return token_ids


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(dim=-1).tolist()
    greedy, _ = sample(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5)
    top_k_1, _ = sample(logits, [SamplingParams(temperature=1.3, top_k=1)] * 5, [make_generator(9)] * 5)
    assert greedy == expected
    assert top_k_1 == expected


def test_seeded_rows_reproducible_and_independent_of_batch():
    vocab = 64
    logits_rng = torch.Generator().manual_seed(1)
    steps = [torch.randn(4, vocab, generator=logits_rng) for _ in range(12)]
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=5, min_p=0.1), SamplingParams()]

    alone_gen = make_generator(target.seed)
    alone = [sample(step[2:3], [target], [alone_gen])[0][0] for step in steps]

    batch_gens = [None, make_generator(77), make_generator(target.seed), None]
    batch_params = [others[0], others[1], target, others[2]]
    in_batch = [sample(step, batch_params, batch_gens)[0][2] for step in steps]
    assert alone == in_batch

    other_seed_gen = make_generator(4321)
    other_seed = [sample(step[2:3], [target], [other_seed_gen])[0][0] for step in steps]
    assert other_seed != alone  # 12 draws over a broad distribution: a clash is ~impossible


def test_filtered_probs_row_does_not_depend_on_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.8), SamplingParams(top_k=7, top_p=0.6), SamplingParams(min_p=0.2)]
    batched = filtered_probs(logits, params)
    for row in range(3):
        alone = filtered_probs(logits[row : row + 1], [params[row]])
        assert torch.equal(alone[0], batched[row])


def test_filtered_probs_matches_per_row_reference():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3)) * 2
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.5, top_k=4),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(min_p=0.3),
        SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
        SamplingParams(top_k=30, top_p=1.0),
    ]
    original = logits.clone()
    batched = filtered_probs(logits, params)
    assert torch.equal(logits, original)  # the caller's logits are not modified
    for row, row_params in enumerate(params):
        reference = filtered_probs_reference(logits[row], row_params)
        torch.testing.assert_close(batched[row], reference)
        assert math.isclose(batched[row].sum().item(), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("scale", [0.05, 5.0])  # flat: nucleus > 1024 candidates (full-sort fallback); peaked
def test_filtered_probs_large_vocab_matches_reference(scale):
    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(6)) * scale
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=40, top_p=0.5), SamplingParams(top_p=0.3, min_p=0.01)]
    batched = filtered_probs(logits, params)
    for row, row_params in enumerate(params):
        reference = filtered_probs_reference(logits[row], row_params)
        assert torch.equal(batched[row] > 0, reference > 0)
        torch.testing.assert_close(batched[row], reference)
    if scale < 1:
        assert int((batched[0] > 0).sum()) > 1024


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=2), {3, 0}),
        (SamplingParams(top_k=4), {3, 0, 5, 1}),
        # top-p keeps a token while the mass before it is < top_p: before 5 it is 0.65.
        (SamplingParams(top_p=0.6), {3, 0}),
        (SamplingParams(top_p=0.7), {3, 0, 5}),
        (SamplingParams(top_p=0.85), {3, 0, 5, 1}),
        (SamplingParams(min_p=0.5), {3, 0}),  # threshold 0.20
        (SamplingParams(min_p=0.2), {3, 0, 5, 1}),  # threshold 0.08
        (SamplingParams(top_k=3, min_p=0.5), {3, 0}),
        # top-p applies to the top-k-renormalised distribution: before 5 the mass is 0.65 / 0.9 = 0.72.
        (SamplingParams(top_k=4, top_p=0.7), {3, 0}),
        (SamplingParams(temperature=0.3, top_p=0.9), {3, 0}),  # sharper: 0.80, 0.17, ...
    ],
)
def test_filters_never_pick_outside_the_allowed_set(params, allowed):
    token_ids = _draw_many(_crafted_logits(), params, draws=1500, seed=10_000)
    assert set(token_ids) == allowed


def _chi_square(token_ids: list[int], expected_probs: dict[int, float]) -> float:
    """Pearson chi-square of observed counts against expected probabilities."""
    draws = len(token_ids)
    return sum(
        (token_ids.count(token_id) - draws * prob) ** 2 / (draws * prob) for token_id, prob in expected_probs.items()
    )


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_reshapes_distribution(temperature):
    # softmax(logits / T) over the crafted distribution is p_i ** (1/T), renormalised.
    weights = {token_id: prob ** (1.0 / temperature) for token_id, prob in _PROBS.items()}
    total = sum(weights.values())
    expected = {token_id: weight / total for token_id, weight in weights.items()}
    token_ids = _draw_many(_crafted_logits(), SamplingParams(temperature=temperature), draws=4000, seed=500)
    assert set(token_ids) <= set(_PROBS)
    # 5 degrees of freedom: P(chi2 > 25) ~ 1e-4. Fixed seeds make this deterministic anyway.
    assert _chi_square(token_ids, expected) < 25.0
    if temperature != 1.0:
        # The same bound rejects the untempered distribution, so ignoring temperature would fail.
        assert _chi_square(token_ids, _PROBS) > 25.0


def test_unseeded_rows_sample_from_the_distribution():
    torch.manual_seed(0)
    draws = 3000
    logits = _crafted_logits().expand(draws, -1).contiguous()
    token_ids, _ = sample(logits, [SamplingParams()] * draws, [None] * draws)
    assert _chi_square(token_ids, _PROBS) < 25.0


def test_logprobs_are_raw_log_softmax_with_sorted_top():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4)) * 3
    params = [
        SamplingParams(temperature=0.3, top_k=3, logprobs=5),
        SamplingParams(),  # no logprobs asked
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    token_ids, logprobs = sample(logits, params, [make_generator(1), None, None])
    raw = torch.log_softmax(logits, dim=-1)
    assert logprobs[1] is None
    for row in (0, 2):
        entry = logprobs[row]
        assert isinstance(entry, TokenLogprob)
        assert entry.token_id == token_ids[row]
        assert math.isclose(entry.logprob, raw[row, token_ids[row]].item(), rel_tol=1e-6)
    assert logprobs[2].top == ()
    top = logprobs[0].top
    assert len(top) == 5
    assert [value for _, value in top] == sorted((value for _, value in top), reverse=True)
    expected_ids = raw[0].topk(5).indices.tolist()
    assert [token_id for token_id, _ in top] == expected_ids
    for token_id, value in top:
        assert math.isclose(value, raw[0, token_id].item(), rel_tol=1e-6)


def test_logprob_token_ids_replace_the_top_alternatives():
    """A row with logprob_token_ids reports those tokens' raw logprobs, in the order named, however
    unlikely, and not the top ones; the row beside it keeps its own top-n."""
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(6)) * 3
    named = tuple(raw_order for raw_order in logits[0].argsort().tolist()[:2])   # the two least likely
    params = [SamplingParams(temperature=0.0, logprobs=5, logprob_token_ids=[named[1], named[0]]),
              SamplingParams(temperature=0.0, logprobs=2)]
    token_ids, logprobs = sample(logits, params, [None, None])
    raw = torch.log_softmax(logits, dim=-1)
    assert [token for token, _ in logprobs[0].top] == [named[1], named[0]]
    for token, value in logprobs[0].top:
        assert math.isclose(value, raw[0, token].item(), rel_tol=1e-6)
    assert logprobs[0].token_id == token_ids[0] == int(logits[0].argmax())
    assert [token for token, _ in logprobs[1].top] == raw[1].topk(2).indices.tolist()


def test_logprobs_of_prompt_tokens():
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(5))
    token_ids = torch.tensor([3, 0, 11, 7])
    entries = logprobs_of(logits, token_ids, top_n=2)
    raw = torch.log_softmax(logits, dim=-1)
    assert [entry.token_id for entry in entries] == token_ids.tolist()
    for row, entry in enumerate(entries):
        assert math.isclose(entry.logprob, raw[row, token_ids[row]].item(), rel_tol=1e-6)
        assert [token_id for token_id, _ in entry.top] == raw[row].topk(2).indices.tolist()
    assert logprobs_of(logits, token_ids, top_n=0)[0].top == ()
    with pytest.raises(ValueError, match="top_n"):
        logprobs_of(logits, token_ids, top_n=-1)
    with pytest.raises(ValueError):
        logprobs_of(logits, token_ids[:3], top_n=1)


def test_make_generator():
    assert make_generator(None) is None
    first, second = make_generator(42), make_generator(42)
    assert torch.equal(torch.rand(5, generator=first), torch.rand(5, generator=second))


def test_batch_mismatch_raises():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="batch"):
        sample(logits, [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="batch"):
        sample(logits, [SamplingParams()] * 2, [None])
    with pytest.raises(ValueError):
        sample(torch.zeros(5), [SamplingParams()], [None])
