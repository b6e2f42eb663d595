"""Sampler: a seeded row's token depends only on its own logits row, params and generator.

Whatever shares the batch (greedy rows, unseeded rows, other filters, rows that force top-p's
full-sort fallback), a seeded row draws exactly one uniform per step from its own generator and
gets the same distribution bit for bit, so the same seed gives the same tokens alone or beside others.
"""

import torch

from kvsplice.layers.sampler import filtered_probs, filtered_probs_reference, make_generator, sample
from kvsplice.sampling_params import SamplingParams

VOCAB = 4096
TARGET = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
NEIGHBOURS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=20, seed=5),
    SamplingParams(temperature=1.2, min_p=0.05),
    SamplingParams(temperature=1.0, top_p=0.999),    # a flat row: forces top-p's full sort
    SamplingParams(temperature=0.5, top_k=3, top_p=0.5, seed=8),
    SamplingParams(),
    SamplingParams(temperature=0.8, top_k=1),
    SamplingParams(temperature=1.0, seed=99),
]


def _neighbour_generators() -> list:
    return [make_generator(p.seed) if p.seed is not None else None for p in NEIGHBOURS]


def test_seeded_row_alone_equals_beside_eight_others_at_every_position():
    rng = torch.Generator().manual_seed(11)
    steps = [torch.randn(1 + len(NEIGHBOURS), VOCAB, generator=rng) * 3 for _ in range(16)]
    alone_gen = make_generator(TARGET.seed)
    alone = [sample(step[:1], [TARGET], [alone_gen])[0][0] for step in steps]
    for position in (0, 4, len(NEIGHBOURS)):
        params = NEIGHBOURS[:position] + [TARGET] + NEIGHBOURS[position:]
        gens = _neighbour_generators()
        gens.insert(position, make_generator(TARGET.seed))
        rows = [torch.cat([step[1:position + 1], step[:1], step[position + 1:]]) for step in steps]
        in_batch = [sample(batch, params, gens)[0][position] for batch in rows]
        assert in_batch == alone


def test_seeded_row_draws_exactly_one_uniform_per_step():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(12))
    gen = make_generator(TARGET.seed)
    for _ in range(5):
        sample(logits, [TARGET, NEIGHBOURS[0], NEIGHBOURS[2]], [gen, None, None])
    expected = make_generator(TARGET.seed)
    torch.rand(5, generator=expected)
    assert torch.equal(gen.get_state(), expected.get_state())


def test_greedy_rows_leave_their_generator_untouched():
    gen = make_generator(3)
    sample(torch.randn(1, VOCAB), [SamplingParams(temperature=0.0, seed=3)], [gen])
    assert torch.equal(gen.get_state(), make_generator(3).get_state())


def test_filtered_probs_bit_identical_beside_a_row_forcing_the_full_sort():
    rng = torch.Generator().manual_seed(13)
    peaked = torch.randn(1, VOCAB, generator=rng) * 4
    flat = torch.randn(1, VOCAB, generator=rng) * 0.01
    alone = filtered_probs(peaked, [TARGET])
    beside = filtered_probs(torch.cat([flat, peaked]), [NEIGHBOURS[3], TARGET])
    assert torch.equal(alone[0], beside[1])


def test_top_p_keeps_every_token_tied_with_the_last_kept_one():
    # probs 0.3, then three tokens at 0.2, then 0.1: the mass before the second 0.2 is 0.5 < 0.6,
    # before the third 0.7; all three 0.2s are kept whichever order a sort gives them.
    logits = torch.tensor([0.2, 0.3, 0.1, 0.2, 0.2]).log()
    params = SamplingParams(top_p=0.6)
    kept = filtered_probs(logits.unsqueeze(0), [params])[0] > 0
    assert kept.tolist() == [True, True, False, True, True]
    assert torch.equal(filtered_probs_reference(logits, params) > 0, kept)
    for order in ([4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        permuted = filtered_probs(logits[order].unsqueeze(0), [params])[0]
        assert torch.equal(permuted > 0, kept[order])


def test_processed_logits_of_a_row_do_not_depend_on_the_batch():
    from kvsplice.layers.logits_processors import LogitsState, accept_tokens, process_logits
    vocab = 64
    kinds = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias=((3, 2.0),), seed=1),
             SamplingParams(presence_penalty=1.0, min_tokens=4), None,
             SamplingParams(logit_bias=((7, -5.0), (3, 1.5)), frequency_penalty=-0.2)]

    def states():
        return [LogitsState.create(p, [1, 2, 3, 9], vocab, [0]) if p is not None else None for p in kinds]

    rng = torch.Generator().manual_seed(14)
    alone_states, batch_states = states(), states()
    for step in range(6):
        logits = torch.randn(len(kinds), vocab, generator=rng)
        batched = process_logits(logits, batch_states)
        tokens = [(5 * step + row) % vocab for row in range(len(kinds))]
        accept_tokens(batch_states, tokens)
        alone = process_logits(logits[:1], alone_states[:1])
        accept_tokens(alone_states[:1], tokens[:1])
        assert torch.equal(alone[0], batched[0])
