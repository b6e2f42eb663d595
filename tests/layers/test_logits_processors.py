"""Penalties, logit_bias and min_tokens: the batched path against the plain per-row reference and
against transformers' own logits processors; the sampler takes logprobs from the raw logits."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from kvsplice.layers.logits_processors import (LogitsState, accept_tokens, process_logits,
                                               process_logits_reference)
from kvsplice.layers.sampler import sample
from kvsplice.sampling_params import SamplingParams
from kvsplice.structured.spec import StructuredSpec

VOCAB = 50
EOS = (3,)


def run_states(params_list, prompts, outputs):
    """LogitsStates of each row after accepting its output tokens one by one."""
    states = [LogitsState.create(p, prompt, VOCAB, EOS) for p, prompt in zip(params_list, prompts)]
    for state, output in zip(states, outputs):
        for token in output:
            if state is not None:
                state.accept(token)
    return states


def test_batched_processing_matches_reference_per_row():
    """Random params, prompts and outputs in one batch: every row equals the reference, and rows
    without processing come back unchanged."""
    rng = random.Random(0)
    torch.manual_seed(0)
    params_list, prompts, outputs = [], [], []
    for row in range(12):
        max_tokens = 20
        params_list.append(SamplingParams(
            max_tokens=max_tokens,
            presence_penalty=rng.choice([0.0, 0.5, -1.5, 2.0]),
            frequency_penalty=rng.choice([0.0, 0.3, -0.7, 2.0]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.8, 2.5]),
            logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(4))},
            min_tokens=rng.choice([0, 3, 10]),
            stop_token_ids=[7] if row % 3 == 0 else [],
            allowed_token_ids=rng.sample(range(VOCAB), 6) if row % 4 == 1 else None))
        prompts.append([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 15))])
        outputs.append([rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))])
    logits = torch.randn(len(params_list), VOCAB) * 5
    states = run_states(params_list, prompts, outputs)
    processed = process_logits(logits, states)
    for row, params in enumerate(params_list):
        stop_ids = EOS + params.stop_token_ids
        expected = process_logits_reference(logits[row], params, prompts[row], outputs[row], stop_ids)
        torch.testing.assert_close(processed[row], expected, rtol=1e-6, atol=1e-5)
        if states[row] is None:
            assert torch.equal(processed[row], logits[row])


def test_input_logits_are_not_modified_and_no_state_means_no_copy():
    logits = torch.randn(2, VOCAB)
    original = logits.clone()
    states = run_states([SamplingParams(presence_penalty=1.0), SamplingParams()], [[1], [2]], [[4, 4], []])
    process_logits(logits, states)
    assert torch.equal(logits, original)
    assert process_logits(logits, [None, None]) is logits


def test_repetition_penalty_matches_transformers():
    """vLLM / HF semantics: prompt and output tokens are penalised (positive / p, negative * p)."""
    torch.manual_seed(1)
    prompt, output = [5, 9, 9, 12], [12, 30, 1]
    params = SamplingParams(repetition_penalty=1.7)
    logits = torch.randn(1, VOCAB) * 3
    [state] = run_states([params], [prompt], [output])
    ours = process_logits(logits, [state])
    hf = RepetitionPenaltyLogitsProcessor(penalty=1.7)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(ours, hf)


def test_min_tokens_matches_transformers_min_new_tokens():
    torch.manual_seed(2)
    prompt = [1, 2, 4]
    params = SamplingParams(min_tokens=3, stop_token_ids=[8])
    for generated in range(5):
        output = [10] * generated
        logits = torch.randn(1, VOCAB)
        [state] = run_states([params], [prompt], [output])
        ours = process_logits(logits, [state])
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [3, 8])(torch.tensor([prompt + output]), logits.clone())
        torch.testing.assert_close(ours, hf)
        assert torch.isinf(ours[0, 3]) == (generated < 3)


def test_logit_bias_matches_transformers_sequence_bias():
    torch.manual_seed(3)
    params = SamplingParams(logit_bias={"4": 5.0, 17: -100, 49: 0.25})
    logits = torch.randn(1, VOCAB)
    [state] = run_states([params], [[1]], [[]])
    ours = process_logits(logits, [state])
    hf = SequenceBiasLogitsProcessor({(4,): 5.0, (17,): -100.0, (49,): 0.25})(torch.tensor([[1]]), logits.clone())
    torch.testing.assert_close(ours, hf)


def test_frequency_and_presence_follow_openai_formula():
    """logit -= frequency * count + presence * (count > 0), over generated tokens only."""
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    logits = torch.zeros(1, VOCAB)
    [state] = run_states([params], [[6, 6, 6]], [[2, 2, 2, 9]])
    out = process_logits(logits, [state])[0]
    assert out[2].item() == pytest.approx(-(0.5 * 3 + 1.0))
    assert out[9].item() == pytest.approx(-(0.5 + 1.0))
    assert out[6].item() == 0.0          # in the prompt only: untouched
    assert out[0].item() == 0.0


def test_logit_bias_steers_greedy_sampling_and_logprobs_stay_raw():
    """A +100 bias makes greedy decoding pick the token; the reported logprob is the raw one."""
    torch.manual_seed(4)
    logits = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=0, logprobs=1, logit_bias={11: 100})
    [state] = run_states([params], [[1]], [[]])
    tokens, lps = sample(process_logits(logits, [state]), [params], [None], raw_logits=logits)
    assert tokens == [11]
    assert lps[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[11].item(), abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_allowed_token_ids_are_the_only_tokens_sampled_and_logprobs_stay_raw(temperature):
    """Greedy and random rows pick only whitelisted tokens, even where the others are far likelier;
    the reported logprob is the raw one (vLLM's), and a row without a whitelist is untouched."""
    torch.manual_seed(5)
    logits = torch.randn(2, VOCAB) * 3
    logits[0, 20:] += 50                          # every likely token is outside the whitelist
    allowed = SamplingParams(temperature=temperature, logprobs=0, allowed_token_ids=[2, 11, 17])
    free = SamplingParams(temperature=0)
    states = run_states([allowed, free], [[1], [1]], [[], []])
    for _ in range(20):
        tokens, lps = sample(process_logits(logits, states), [allowed, free], [None, None], raw_logits=logits)
        assert tokens[0] in (2, 11, 17) and tokens[1] == int(logits[1].argmax())
        assert lps[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[tokens[0]].item(), abs=1e-6)


def test_allowed_token_ids_outside_the_vocabulary_or_all_masked_by_min_tokens_are_refused():
    with pytest.raises(ValueError, match=r"allowed_token_ids: token ids 50, 61 are outside the vocabulary \[0, 50\)"):
        LogitsState.create(SamplingParams(allowed_token_ids=[4, 50, 61]), [1], VOCAB, EOS)
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed token is a stop token"):
        LogitsState.create(SamplingParams(allowed_token_ids=[3, 7], stop_token_ids=[7], min_tokens=1), [1], VOCAB, EOS)
    assert LogitsState.create(SamplingParams(allowed_token_ids=[3, 7], stop_token_ids=[7]), [1], VOCAB, EOS)


def test_accept_tokens_counts_generated_tokens():
    params = SamplingParams(frequency_penalty=1.0, min_tokens=2)
    [state] = run_states([params], [[1]], [[]])
    accept_tokens([state, None], [5, 7])
    accept_tokens([state], [5])
    assert state.num_generated == 2 and state.output_counts[5].item() == 2


def test_no_processing_gives_no_state_and_bad_bias_id_is_refused():
    assert LogitsState.create(SamplingParams(temperature=0.5, top_k=3), [1], VOCAB, EOS) is None
    with pytest.raises(ValueError, match="logit_bias: token id 50 is outside"):
        LogitsState.create(SamplingParams(logit_bias={50: 1}), [1], VOCAB, EOS)


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=11), "repetition_penalty"),
    (dict(min_tokens=17), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={i: 1 for i in range(1025)}), "logit_bias"),
    (dict(allowed_token_ids=[1], structured=StructuredSpec("regex", "a+")), "allowed_token_ids"),
])
def test_bad_processing_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
