"""The vLLM and SGLang extras over HTTP, on chat and completions: continuous usage in streams,
return_token_ids, stop_reason / matched_stop, regex and stop_regex, truncate_prompt_tokens,
prompt_logprobs, `logprobs: 0`, stop_token_ids inside the vocabulary, echo of a prompt with special
tokens. Each bad value is a 400 naming its field."""

from __future__ import annotations

import json
import math
import re

import httpx
import pytest

from kvsplice.server.protocol import ChatMessage
from tests.server.conftest import assert_idle_without_leak

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
PROMPT = "The quick brown fox jumps over the lazy dog."


def post(server, path: str, **fields) -> httpx.Response:
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    return httpx.post(f"{server.url}{path}", json={**base, "max_tokens": 6, "temperature": 0, **fields}, timeout=60)


def ok(server, path: str, **fields) -> dict:
    response = post(server, path, **fields)
    assert response.status_code == 200, response.text
    return response.json()


def refused(server, path: str, param: str, **fields) -> str:
    response = post(server, path, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def chunks(server, path: str, **fields) -> list[dict]:
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    body = {**base, "max_tokens": 6, "temperature": 0, "stream": True, **fields}
    out = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def tokenizer(server):
    return server.state.engine.tokenizer


# ----- stream_options.continuous_usage_stats -----------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_continuous_usage_is_on_every_chunk(server, path):
    events = chunks(server, path, stream_options={"include_usage": True, "continuous_usage_stats": True})
    with_choices = [e for e in events if e["choices"]]
    assert with_choices and all("usage" in e for e in with_choices)
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert counts == sorted(counts)
    final = events[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == counts[-1]
    for event in with_choices:
        usage = event["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_continuous_usage_needs_include_usage_as_in_vllm(server, path):
    events = chunks(server, path, stream_options={"continuous_usage_stats": True})
    assert not any("usage" in e for e in events)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_continuous_usage_of_the_wrong_type_is_a_400(server, path):
    refused(server, path, "stream_options.continuous_usage_stats", stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": "yes"})


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_options_without_stream_is_a_400(server, path):
    assert "stream" in refused(server, path, "stream_options", stream_options={"include_usage": True})
    ok(server, path, stream_options=None)


# ----- return_token_ids ---------------------------------------------------------------------------------


def test_chat_returns_the_prompt_and_reply_ids(server):
    answer = ok(server, CHAT, return_token_ids=True)
    rendered = server.state.chat.render([ChatMessage(**m) for m in MESSAGES])
    assert answer["prompt_token_ids"] == tokenizer(server).encode(rendered, add_special_tokens=False)
    choice = answer["choices"][0]
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"]
    streamed = chunks(server, CHAT, return_token_ids=True)
    assert streamed[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    assert [t for e in streamed for c in e["choices"] for t in c.get("token_ids", [])] == choice["token_ids"]


def test_completions_return_the_prompt_and_reply_ids_per_choice(server):
    answer = ok(server, COMPLETIONS, return_token_ids=True, prompt=[PROMPT, "Once upon"])
    for choice, prompt in zip(answer["choices"], [PROMPT, "Once upon"]):
        assert choice["prompt_token_ids"] == tokenizer(server).encode(prompt)
        if choice["finish_reason"] == "length":
            assert len(choice["token_ids"]) == 6
        assert tokenizer(server).decode(choice["token_ids"]).startswith(choice["text"])
    streamed = chunks(server, COMPLETIONS, return_token_ids=True)
    firsts = [c for e in streamed for c in e["choices"] if "prompt_token_ids" in c]
    assert len(firsts) == 1 and firsts[0]["prompt_token_ids"] == tokenizer(server).encode(PROMPT)
    single = ok(server, COMPLETIONS, return_token_ids=True)["choices"][0]
    assert [t for e in streamed for c in e["choices"] for t in c["token_ids"]] == single["token_ids"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_return_token_ids_of_the_wrong_type_is_a_400(server, path):
    refused(server, path, "return_token_ids", return_token_ids="yes")


# ----- stop_reason / matched_stop -----------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_reason_names_the_stop_string_or_token(server, path):
    plain = ok(server, path, max_tokens=8, return_token_ids=True)["choices"][0]
    text = plain["message"]["content"] if path == CHAT else plain["text"]
    assert plain["finish_reason"] == "length" and plain["stop_reason"] is None and plain["matched_stop"] is None
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1)
                if text.find(text[i:i + 2]) == i and "\ufffd" not in text[i:i + 2])
    stopped = ok(server, path, max_tokens=8, stop=[stop, "never-there"])["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["stop_reason"] == stop and stopped["matched_stop"] == stop
    token = plain["token_ids"][1]
    by_token = ok(server, path, max_tokens=8, stop_token_ids=[token], return_token_ids=True)["choices"][0]
    assert by_token["finish_reason"] == "stop" and by_token["token_ids"][-1] == token
    assert by_token["stop_reason"] == token and by_token["matched_stop"] == token
    streamed = chunks(server, path, max_tokens=8, stop_token_ids=[token])
    last = [c for e in streamed for c in e["choices"] if c["finish_reason"]][-1]
    assert last["stop_reason"] == token and last["matched_stop"] == token


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_at_eos_stop_reason_is_null_and_matched_stop_is_the_eos_id(server, path):
    eos = sorted(tokenizer(server).eos_token_ids)[0]
    choice = ok(server, path, logit_bias={str(eos): 100})["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None and choice["matched_stop"] == eos


# ----- regex, stop_regex -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_regex_constrains_the_reply(server, path):
    choice = ok(server, path, regex="ab*", max_tokens=5)["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert re.fullmatch("ab*", text), text


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_regex_fields_are_400s_naming_them(server, path):
    refused(server, path, "regex", regex="(")
    refused(server, path, "regex", regex="a", guided_regex="b")
    refused(server, path, "regex", regex=5)
    assert "does not compile" in refused(server, path, "stop_regex", stop_regex=["a+", "("])
    assert "empty string" in refused(server, path, "stop_regex", stop_regex="a*")
    refused(server, path, "stop_regex", stop_regex=["a"] * 100)
    refused(server, path, "stop_regex", stop_regex=5)
    ok(server, path, stop_regex=[])


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_regex_cuts_before_the_first_match_and_is_the_matched_stop(server, path):
    plain = ok(server, path, max_tokens=8)["choices"][0]
    text = plain["message"]["content"] if path == CHAT else plain["text"]
    piece = next(text[i:i + 2] for i in range(1, len(text) - 1)
                 if text.find(text[i:i + 2]) == i and "\ufffd" not in text[i:i + 2])
    pattern = re.escape(piece) + "|zzz+q"
    stopped = ok(server, path, max_tokens=8, stop_regex=[pattern])["choices"][0]
    cut = stopped["message"]["content"] if path == CHAT else stopped["text"]
    assert cut == text[:text.index(piece)], (text, piece, cut)
    assert stopped["finish_reason"] == "stop"
    assert stopped["matched_stop"] == pattern and stopped["stop_reason"] == pattern
    streamed = chunks(server, path, max_tokens=8, stop_regex=pattern)
    pieces = [c.get("delta", {}).get("content") or c.get("text") or "" for e in streamed for c in e["choices"]]
    assert "".join(pieces) == cut


# ----- truncate_prompt_tokens ---------------------------------------------------------------------------


def test_completions_keep_the_last_tokens_of_the_prompt(server):
    ids = tokenizer(server).encode(PROMPT)
    truncated = ok(server, COMPLETIONS, truncate_prompt_tokens=5)
    assert truncated["usage"]["prompt_tokens"] == 5
    direct = ok(server, COMPLETIONS, prompt=ids[-5:])
    assert truncated["choices"][0]["text"] == direct["choices"][0]["text"]
    assert ok(server, COMPLETIONS, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == len(ids)
    assert ok(server, COMPLETIONS, truncate_prompt_tokens=500)["usage"]["prompt_tokens"] == len(ids)
    echoed = ok(server, COMPLETIONS, truncate_prompt_tokens=5, echo=True, max_tokens=0, logprobs=0)["choices"][0]
    kept = tokenizer(server).decode(ids[-5:], skip_special_tokens=False)
    assert echoed["text"] == kept and len(echoed["logprobs"]["tokens"]) == 5
    whole = ok(server, COMPLETIONS, truncate_prompt_tokens=500, echo=True, max_tokens=1)["choices"][0]
    assert whole["text"].startswith(PROMPT)


def test_chat_keeps_the_last_tokens_of_the_rendered_prompt(server):
    full = ok(server, CHAT, return_token_ids=True)
    truncated = ok(server, CHAT, truncate_prompt_tokens=4, return_token_ids=True)
    assert truncated["usage"]["prompt_tokens"] == 4
    assert truncated["prompt_token_ids"] == full["prompt_token_ids"][-4:]


def test_truncation_side_right_keeps_the_first_tokens(server):
    ids = tokenizer(server).encode(PROMPT)
    kept = ok(server, COMPLETIONS, truncate_prompt_tokens=5, truncation_side="right", echo=True, max_tokens=0,
              logprobs=0)["choices"][0]
    assert kept["text"] == tokenizer(server).decode(ids[:5], skip_special_tokens=False)
    left = ok(server, COMPLETIONS, truncate_prompt_tokens=5, truncation_side="left", max_tokens=3)
    assert left["choices"][0]["text"] == ok(server, COMPLETIONS, prompt=ids[-5:], max_tokens=3)["choices"][0]["text"]
    full = ok(server, CHAT, return_token_ids=True)
    right = ok(server, CHAT, truncate_prompt_tokens=4, truncation_side="right", return_token_ids=True)
    assert right["prompt_token_ids"] == full["prompt_token_ids"][:4]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_truncation_is_a_400_naming_it(server, path):
    refused(server, path, "truncation_side", truncate_prompt_tokens=3, truncation_side="middle")
    limit = server.state.context_limit
    assert str(limit) in refused(server, path, "truncate_prompt_tokens", truncate_prompt_tokens=limit + 1)
    refused(server, path, "truncate_prompt_tokens", truncate_prompt_tokens=0)
    refused(server, path, "truncate_prompt_tokens", truncate_prompt_tokens=-2)
    refused(server, path, "truncate_prompt_tokens", truncate_prompt_tokens="5")


# ----- prompt_logprobs ----------------------------------------------------------------------------------


def check_prompt_logprobs(entries: list, prompt_ids: list[int], top_n: int) -> None:
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry in zip(prompt_ids[1:], entries[1:]):
        own = entry[str(token_id)]
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str) and math.isfinite(own["logprob"])
        assert len(entry) <= top_n + 1
        ranks = sorted(e["rank"] for key, e in entry.items() if key != str(token_id))
        assert ranks == list(range(1, len(ranks) + 1))
        best = max(e["logprob"] for e in entry.values())
        assert own["logprob"] <= best + 1e-6


def test_completions_prompt_logprobs_in_vllms_shape(server):
    answer = ok(server, COMPLETIONS, prompt_logprobs=2, n=2, temperature=1.0, seed=1)
    ids = tokenizer(server).encode(PROMPT)
    for choice in answer["choices"]:
        check_prompt_logprobs(choice["prompt_logprobs"], ids, 2)
    echo = ok(server, COMPLETIONS, echo=True, logprobs=0, max_tokens=1)["choices"][0]["logprobs"]
    own = [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], answer["choices"][0]["prompt_logprobs"][1:])]
    assert own == pytest.approx(echo["token_logprobs"][1:len(ids)], abs=1e-4)
    assert_idle_without_leak(server)


def test_chat_prompt_logprobs_in_vllms_shape(server):
    answer = ok(server, CHAT, prompt_logprobs=0, return_token_ids=True)
    check_prompt_logprobs(answer["prompt_logprobs"], answer["prompt_token_ids"], 0)
    assert all(entry is None or len(entry) == 1 for entry in answer["prompt_logprobs"])


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_prompt_logprobs_are_400s_naming_it(server, path):
    refused(server, path, "prompt_logprobs", prompt_logprobs=21)
    refused(server, path, "prompt_logprobs", prompt_logprobs=-1)
    refused(server, path, "prompt_logprobs", prompt_logprobs=True)
    refused(server, path, "prompt_logprobs", prompt_logprobs=1, stream=True)


# ----- logprobs: 0, stop_token_ids, echo with special tokens --------------------------------------------


def test_logprobs_zero_gives_the_sampled_token_only(server):
    logprobs = ok(server, COMPLETIONS, logprobs=0)["choices"][0]["logprobs"]
    assert logprobs["tokens"]
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert top == {token: value}
    two = ok(server, COMPLETIONS, logprobs=2)["choices"][0]["logprobs"]
    for token, top in zip(two["tokens"], two["top_logprobs"]):
        assert token in top and 2 <= len(top) <= 3


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(server, path):
    vocab = server.state.engine.model_config.vocab_size
    assert str(vocab) in refused(server, path, "stop_token_ids", stop_token_ids=[1, vocab])
    refused(server, path, "stop_token_ids", stop_token_ids=[-1])


def test_chat_top_logprobs_out_of_range_is_a_400_naming_top_logprobs(server):
    for bad in (21, -1):
        assert "top_logprobs" in refused(server, CHAT, "top_logprobs", logprobs=True, top_logprobs=bad)
    assert ok(server, CHAT, logprobs=True, top_logprobs=20)["choices"][0]["logprobs"]["content"]

def test_generate_stop_token_ids_outside_the_vocabulary_are_a_400(server):
    vocab = server.state.engine.model_config.vocab_size
    param = "sampling_params.stop_token_ids"
    for bad in ([1, vocab], [-1]):
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "stop_token_ids": bad}}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and str(bad[-1]) in error["message"], error
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "stop_token_ids": [vocab - 1]}}
    assert httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code == 200


def test_echo_of_a_prompt_with_special_tokens_is_consistent_with_its_tokens(server):
    tok = tokenizer(server)
    start = tok.backend.convert_tokens_to_ids("<|im_start|>")
    ids = [start] + tok.encode("user\nhi", add_special_tokens=False)
    choice = ok(server, COMPLETIONS, prompt=ids, echo=True, logprobs=0, max_tokens=2)["choices"][0]
    echoed = tok.decode(ids, skip_special_tokens=False)
    text, logprobs = choice["text"], choice["logprobs"]
    assert text.startswith("<|im_start|>user\nhi") and text.startswith(echoed)
    for token, offset in zip(logprobs["tokens"][:len(ids)], logprobs["text_offset"]):
        assert text[offset:offset + len(token)] == token
    assert logprobs["text_offset"][len(ids)] == len(echoed)


# ----- vLLM's defaults and bounds ----------------------------------------------------------------------


def test_completions_default_to_16_tokens(server):
    answer = httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True},
                        timeout=60).json()
    assert answer["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_prompt_logprobs_key_is_null_when_not_asked_for(server, path):
    answer = ok(server, path)
    holder = answer if path == CHAT else answer["choices"][0]
    assert "prompt_logprobs" in holder and holder["prompt_logprobs"] is None


@pytest.mark.parametrize("seed, bound", [(-2**63 - 1, "greater_than_equal"), (2**63, "less_than_equal")])
def test_seed_is_an_int64(server, seed, bound):
    assert bound in refused(server, CHAT, "seed", seed=seed)
    ok(server, CHAT, seed=seed + (1 if seed < 0 else -1))


def test_a_custom_role_reaches_the_template(server):
    text = ok(server, CHAT, messages=[{"role": "my-custom-role", "content": "what is 1+1?"}])
    parts = ok(server, CHAT, messages=[{"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}])
    assert text["choices"][0]["message"]["content"] == parts["choices"][0]["message"]["content"]
    refused(server, CHAT, "messages.0.role", messages=[{"role": "two words", "content": "x"}])


# ----- delta.reasoning_content (SGLang) --------------------------------------------------------------------

def test_every_streamed_chat_delta_names_reasoning_content(server):
    """SGLang's clients read `delta.reasoning_content` from each chunk (the openai SDK's delta has the
    attribute only when the JSON names it): every delta names it, null without a reasoning parser."""
    deltas = [choice["delta"] for chunk in chunks(server, CHAT) for choice in chunk["choices"]]
    assert deltas and all("reasoning_content" in delta and delta["reasoning_content"] is None for delta in deltas)
    assert deltas[0]["role"] == "assistant" and "".join(delta.get("content") or "" for delta in deltas)
