"""vLLM's /tokenize, /detokenize and /version against the shared tiny-model server, and the special-token
defaults on a tokenizer that has a BOS."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import kvsplice
from kvsplice.server.tokenization import TokenizeRequest, tokenize
from kvsplice.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Agents edit their own context."},
            {"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
STORIES_HF = next((p / "shared/models/stories260K/hf" for p in Path(__file__).resolve().parents
                   if (p / "shared/models/stories260K/hf").is_dir()), None)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_tokenize_prompt_matches_the_tokenizer(server):
    prompt = "Once upon a time there was a little robot."
    out = post(server, "/tokenize", {"prompt": prompt, "model": server.state.model_name}).json()
    assert out["tokens"] == server.state.engine.tokenizer.encode(prompt)
    assert out["count"] == len(out["tokens"]) > 0
    assert out["max_model_len"] == server.state.context_limit and out["token_strs"] is None


def test_tokenize_messages_counts_what_a_chat_request_bills(server, client):
    counted = post(server, "/tokenize", {"messages": MESSAGES}).json()
    chat = client.chat.completions.create(model=server.state.model_name, messages=MESSAGES, max_tokens=1)
    assert counted["count"] == chat.usage.prompt_tokens
    without_prompt = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without_prompt["tokens"] == counted["tokens"][:without_prompt["count"]]
    assert without_prompt["count"] < counted["count"]


def test_token_strs_and_detokenize_round_trip(server):
    prompt = "The function returns None when nothing is found."
    out = post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert len(out["token_strs"]) == out["count"] and "".join(out["token_strs"]) == prompt
    back = post(server, "/detokenize", {"tokens": out["tokens"], "model": server.state.model_name})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("tokens", [[-1], [1, 10**9]])
def test_detokenize_refuses_ids_outside_the_vocabulary(server, tokens):
    response = post(server, "/detokenize", {"tokens": tokens})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tokens" and "outside the vocabulary" in error["message"]
    assert f"tokens[{len(tokens) - 1}]" in error["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, None),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": ["5"]}, "tokens.0"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_tokenize_requests_are_400_naming_the_field(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "x", "model": "nope"}),
                                        ("/detokenize", {"tokens": [1], "model": "nope"})])
def test_tokenize_with_an_unknown_model_is_404(server, path, body):
    response = post(server, path, body)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_version(server):
    assert httpx.get(f"{server.url}/version", timeout=10).json() == {"version": kvsplice.__version__}


@pytest.mark.skipif(STORIES_HF is None, reason="stories260K not present")
def test_special_tokens_default_on_for_prompts_off_for_chats():
    tokenizer = Tokenizer.from_dir(STORIES_HF)
    bos = tokenizer.bos_token_id
    plain = tokenize(tokenizer, TokenizeRequest(prompt="Once upon a time"), 256)["tokens"]
    bare = tokenize(tokenizer, TokenizeRequest(prompt="Once upon a time", add_special_tokens=False), 256)["tokens"]
    assert plain[0] == bos and plain[1:] == bare and bos not in bare
