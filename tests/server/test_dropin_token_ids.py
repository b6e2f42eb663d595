"""vLLM's token-id extras over HTTP, on chat and completions: `allowed_token_ids` (only those tokens are
sampled), `logprob_token_ids` (those tokens' logprobs in place of the most likely ones),
`return_tokens_as_token_ids` (logprob tokens written "token_id:N"), and `use_beam_search` (false is
accepted, true is a 400: beam search is not built). Each bad value is a 400 naming its field."""

from __future__ import annotations

import pytest

from tests.server.test_dropin_extras import CHAT, COMPLETIONS, chunks, ok, refused

ALLOWED = [11, 23, 42]


def generated_ids(server, path: str, **fields) -> list[int]:
    return ok(server, path, return_token_ids=True, **fields)["choices"][0]["token_ids"]


def token_name(server, token_id: int) -> str:
    return server.state.engine.tokenizer.token_str(token_id)


# ----- allowed_token_ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_allowed_token_ids_are_the_only_tokens_generated(server, path, temperature):
    ids = generated_ids(server, path, max_tokens=8, temperature=temperature, seed=3, ignore_eos=True,
                        allowed_token_ids=ALLOWED)
    assert len(ids) == 8 and set(ids) <= set(ALLOWED), ids


def test_allowed_token_ids_change_the_reply_not_its_logprobs(server):
    """The whitelist changes which token is sampled; the logprobs reported are the model's raw ones (vLLM's
    default): the free reply's first token keeps its logprob, and the forced token's is no higher."""
    free = ok(server, COMPLETIONS, max_tokens=1, logprobs=0, return_token_ids=True)["choices"][0]
    first = free["token_ids"][0]
    forced = next(token for token in ALLOWED if token != first)
    kept = ok(server, COMPLETIONS, max_tokens=1, logprobs=0, allowed_token_ids=[forced],
              logprob_token_ids=[first])["choices"][0]["logprobs"]
    assert kept["tokens"] == [token_name(server, forced)]
    assert kept["top_logprobs"][0][token_name(server, first)] == pytest.approx(free["logprobs"]["token_logprobs"][0],
                                                                                abs=1e-4)
    assert kept["token_logprobs"][0] <= free["logprobs"]["token_logprobs"][0]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_allowed_token_ids_are_a_400_naming_the_field(server, path):
    vocab = server.state.engine.model_config.vocab_size
    assert str(vocab) in refused(server, path, "allowed_token_ids", allowed_token_ids=[1, vocab])
    refused(server, path, "allowed_token_ids", allowed_token_ids=[-1])
    refused(server, path, "allowed_token_ids", allowed_token_ids=[])
    refused(server, path, "allowed_token_ids", allowed_token_ids="12")
    refused(server, path, "allowed_token_ids", allowed_token_ids=[1], regex="a+")


# ----- logprob_token_ids and return_tokens_as_token_ids -----------------------------------------------------


def test_completions_report_the_named_tokens_and_the_chosen_one_as_token_ids(server):
    """vLLM's test_logprob_token_ids: the chosen token (forced by the whitelist) and the named one, each
    written "token_id:N", and no other top entry although logprobs asks for 5; streamed the same."""
    fields = dict(max_tokens=1, logprobs=5, logprob_token_ids=[50], allowed_token_ids=[42],
                  return_tokens_as_token_ids=True)
    logprobs = ok(server, COMPLETIONS, **fields)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:42"]
    assert set(logprobs["top_logprobs"][0]) == {"token_id:42", "token_id:50"}
    assert logprobs["text_offset"] == [0]
    streamed = [c["choices"][0]["logprobs"] for c in chunks(server, COMPLETIONS, **fields) if c["choices"]]
    tops = [top for lp in streamed if lp for top in lp["top_logprobs"]]
    assert [set(top) for top in tops] == [{"token_id:42", "token_id:50"}]


def test_chat_reports_the_named_tokens_in_order_with_their_logprobs(server):
    named = [50, 7, 99]
    answer = ok(server, CHAT, max_tokens=3, logprobs=True, top_logprobs=2, logprob_token_ids=named)
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    plain = ok(server, CHAT, max_tokens=3, logprobs=True, top_logprobs=20)["choices"][0]["logprobs"]["content"]
    for entry in content:
        assert [top["token"] for top in entry["top_logprobs"]] == [token_name(server, t) for t in named]
        assert all(top["logprob"] <= 0 for top in entry["top_logprobs"])
    # the same tokens are generated either way (greedy): the named ones do not change the reply
    assert [e["token"] for e in content] == [e["token"] for e in plain]


def test_chat_tokens_as_token_ids_keep_their_bytes(server):
    content = ok(server, CHAT, max_tokens=3, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True,
                 return_token_ids=True)
    ids = content["choices"][0]["token_ids"]
    entries = content["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in ids]
    assert all(top["token"].startswith("token_id:") for e in entries for top in e["top_logprobs"])
    assert [e["bytes"] for e in entries] == [list(token_name(server, t).encode()) for t in ids]


def test_completions_echo_as_token_ids_keeps_text_offsets_on_the_text(server):
    answer = ok(server, COMPLETIONS, max_tokens=2, echo=True, logprobs=1, return_tokens_as_token_ids=True,
                return_token_ids=True)
    choice = answer["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ids]
    pieces = [token_name(server, t) for t in ids]
    assert logprobs["text_offset"] == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_logprob_token_ids_are_a_400_naming_the_field(server, path):
    asked = {"logprobs": True} if path == CHAT else {"logprobs": 1}
    vocab = server.state.engine.model_config.vocab_size
    assert str(vocab) in refused(server, path, "logprob_token_ids", logprob_token_ids=[vocab], **asked)
    refused(server, path, "logprob_token_ids", logprob_token_ids=[-3], **asked)
    refused(server, path, "logprob_token_ids", logprob_token_ids=[], **asked)
    assert "needs logprobs" in refused(server, path, "logprob_token_ids", logprob_token_ids=[5])
    refused(server, path, "return_tokens_as_token_ids", return_tokens_as_token_ids="yes")


# ----- use_beam_search -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_beam_search_is_refused_and_false_accepted(server, path):
    assert "beam search" in refused(server, path, "use_beam_search", use_beam_search=True)
    ok(server, path, use_beam_search=False)
    refused(server, path, "use_beam_search", use_beam_search=1)
