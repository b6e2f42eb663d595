"""Batch prompts on /v1/completions over HTTP: a list of strings or of token-id lists, each prompt with
its own `n` choices (index prompt * n + choice), usage summed, the prompts sharing the prefix cache,
streaming with the right indexes, and the bound on the number of prompts."""

from __future__ import annotations

import json

import httpx

from kvsplice.server.limits import MAX_PROMPTS
from tests.server.conftest import assert_idle_without_leak


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def one(server, prompt, **fields) -> dict:
    response = post(server, {"prompt": prompt, "max_tokens": 4, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_list_of_strings_answers_each_prompt_as_alone(server):
    prompts = ["Once upon a time", "The quick brown fox", "def main():"]
    batch = one(server, prompts)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    singles = [one(server, prompt) for prompt in prompts]
    assert [c["text"] for c in batch["choices"]] == [s["choices"][0]["text"] for s in singles]
    usage = batch["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert_idle_without_leak(server)


def test_token_id_lists_with_n_index_prompt_times_n_plus_choice(server):
    ids = server.state.engine.tokenizer.encode("Agents edit their own context")
    batch = one(server, [ids, ids[:3]], n=2, temperature=1.0, seed=3)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["usage"]["prompt_tokens"] == len(ids) + 3
    assert 4 <= batch["usage"]["completion_tokens"] <= 16
    again = one(server, [ids, ids[:3]], n=2, temperature=1.0, seed=3)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in batch["choices"]]
    assert_idle_without_leak(server)


def test_the_prompts_share_their_common_prefix_through_the_cache(server):
    shared = "Tool results are long; notes are short. " * 6
    batch = one(server, [shared + "Once upon", shared + "The quick", shared + "héllo"], cache_salt="batch-share")
    cached = batch["usage"]["prompt_tokens_details"]["cached_tokens"]
    prefix_len = len(server.state.engine.tokenizer.encode(shared)) - 2
    assert cached >= 3 * prefix_len, batch["usage"]


def test_streaming_chunks_carry_each_choices_index(server):
    body = {"prompt": ["Once upon a time", "The quick"], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    texts: dict[int, str] = {}
    finished = set()
    usage = None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"]:
                    finished.add(choice["index"])
    assert finished == {0, 1, 2, 3}
    plain = one(server, ["Once upon a time", "The quick"], max_tokens=3, n=2)
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert_idle_without_leak(server)


def test_echo_and_logprobs_per_prompt(server):
    batch = one(server, ["Once upon", "The quick brown"], echo=True, logprobs=1, max_tokens=1)
    for choice, prompt in zip(batch["choices"], ["Once upon", "The quick brown"]):
        assert choice["text"].startswith(prompt)
        assert choice["logprobs"]["token_logprobs"][0] is None


def streamed_choices(server, body: dict) -> dict[int, dict]:
    """Each choice's streamed text and logprobs joined, and its chunk count, by index."""
    choices: dict[int, dict] = {}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                joined = choices.setdefault(choice["index"], {"text": "", "chunks": 0, "logprobs": None})
                joined["text"] += choice["text"]
                joined["chunks"] += 1
                if choice["logprobs"]:
                    lps = joined["logprobs"] or {key: [] for key in choice["logprobs"]}
                    joined["logprobs"] = {key: lps[key] + value for key, value in choice["logprobs"].items()}
    return choices


def test_streamed_echo_equals_the_answer_with_echo(server):
    # as SGLang's and vLLM's clients stream it: each choice's first chunk starts with its prompt
    body = {"prompt": ["Once upon", "The quick brown"], "echo": True, "logprobs": 2, "max_tokens": 4,
            "temperature": 0}
    whole = one(server, body["prompt"], **{k: v for k, v in body.items() if k != "prompt"})
    streamed = streamed_choices(server, body)
    for choice in whole["choices"]:
        assert streamed[choice["index"]]["text"] == choice["text"]
        got, want = streamed[choice["index"]]["logprobs"], choice["logprobs"]
        assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
        assert [lp is None for lp in got["token_logprobs"]] == [lp is None for lp in want["token_logprobs"]]
        # equal up to float rounding (the two runs batch their rows differently)
        assert all(abs(a - b) < 1e-4 for a, b in zip(got["token_logprobs"], want["token_logprobs"]) if a is not None)
        assert [top and set(top) for top in got["top_logprobs"]] == [top and set(top) for top in want["top_logprobs"]]
    refused = post(server, {**body, "max_tokens": 0, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert_idle_without_leak(server)


def test_too_many_prompts_is_a_400_naming_prompt(server):
    response = post(server, {"prompt": ["a"] * (MAX_PROMPTS + 1), "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert f"at most {MAX_PROMPTS}" in response.json()["error"]["message"]


def test_bad_entries_are_400s_naming_prompt(server):
    vocab = server.state.engine.model_config.vocab_size
    for prompt in ([], [[1, 2], [vocab]], ["ok", ""], [[1], []], ["a", 5]):
        response = post(server, {"prompt": prompt, "max_tokens": 1})
        assert response.status_code == 400, (prompt, response.text)
        assert response.json()["error"]["param"].startswith("prompt"), (prompt, response.text)
    assert_idle_without_leak(server)


def test_message_offsets_need_a_single_prompt(server):
    response = post(server, {"prompt": ["a b c", "d e f"], "message_offsets": [1], "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "message_offsets"
