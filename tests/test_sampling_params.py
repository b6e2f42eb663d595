"""SamplingParams: validation (field named in the error), normalisation, is_greedy."""

import dataclasses

import pytest

from kvsplice.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", 0),
        ("top_k", -1),
        ("top_k", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("seed", 2**64),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 2.0),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.5]),
        ("stop_token_ids", "12"),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("allowed_token_ids", [1.5]),
        ("allowed_token_ids", "12"),
    ],
)
def test_bad_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs", [
    {"logprob_token_ids": [5]},                                  # no logprobs to report them in
    {"logprob_token_ids": [], "logprobs": 1},
    {"logprob_token_ids": [True], "logprobs": 1},
    {"logprob_token_ids": list(range(1025)), "logprobs": 1},
])
def test_bad_logprob_token_ids_name_the_field(kwargs):
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(**kwargs)


def test_token_id_lists_are_distinct_tuples_in_order():
    params = SamplingParams(allowed_token_ids=[9, 4, 9], logprob_token_ids=[7, 2, 7], logprobs=0)
    assert params.allowed_token_ids == (9, 4) and params.logprob_token_ids == (7, 2)
    assert params.processes_logits and not SamplingParams(logprob_token_ids=[1], logprobs=0).processes_logits


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_tokens": 1, "temperature": 0.0, "top_p": 1.0, "top_k": 1, "min_p": 1.0},
        {"top_p": 1e-6, "min_p": 0.0, "seed": -(2**63), "logprobs": 0, "prompt_logprobs": 20},
        {"seed": 2**64 - 1, "logprobs": 20, "temperature": 2},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_lists_and_single_string_are_normalised_to_tuples():
    params = SamplingParams(stop=["a", "bc"], stop_token_ids=[2, 7])
    assert params.stop == ("a", "bc")
    assert params.stop_token_ids == (2, 7)
    assert SamplingParams(stop="###").stop == ("###",)
    # Normalised params hash and compare like ones built from tuples.
    assert hash(params) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(2, 7)))


def test_frozen():
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, greedy",
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.0, "top_k": 5}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 1.0, "top_k": 2, "top_p": 0.1}, False),
    ],
)
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy
