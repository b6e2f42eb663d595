"""`message_offsets` over HTTP: checked on /v1/completions and /generate (400 naming the field),
refused on chat completions (the server computes them), and on a hybrid model a chat request leaves
state checkpoints at its message starts."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import start_server


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


PROMPT = list(range(5, 25))


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}),
])
@pytest.mark.parametrize("offsets, needle", [
    ([3, 3], "increasing"), ([8, 2], "increasing"), ([4, 20], "outside"), ([-1], "outside"),
    (list(range(5000)), "at most"), (["x"], "message_offsets"), ([1.5], "message_offsets"),
])
def test_bad_offsets_are_400_naming_the_field(server, path, body, offsets, needle):
    response = _post(server, path, {**body, "message_offsets": offsets})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("message_offsets") and needle in error["message"]


def test_good_offsets_are_accepted_and_chat_refuses_them(server):
    for path, body in [("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
                       ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})]:
        assert _post(server, path, {**body, "message_offsets": [0, 4, 19]}).status_code == 200
    response = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 1, "message_offsets": [1]})
    assert response.status_code == 400 and "message_offsets" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    from models.test_hybrid import hf_tiny
    from tiny_model import make_tokenizer_files

    path = tmp_path_factory.mktemp("tiny-hybrid-server")
    vocab = make_tokenizer_files(path)
    eos_id = json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    hf_tiny("qwen3_5_text", seed=7, vocab_size=vocab, eos_token_id=eos_id).save_pretrained(path)
    running = start_server(path, num_slots=2048, max_batch_tokens=512)
    yield running
    running.thread.stop()


def test_chat_on_a_hybrid_checkpoints_its_message_starts(hybrid_server):
    from kvsplice.message_offsets import message_offsets

    messages = [{"role": "system", "content": "The robot reads documentation."},
                {"role": "user", "content": "Once upon a time there was a fox."},
                {"role": "assistant", "content": "Tool results are long; notes are short."},
                {"role": "user", "content": "Agents edit their own context."}]
    response = _post(hybrid_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                                             "temperature": 0})
    assert response.status_code == 200, response.text
    engine = hybrid_server.state.engine
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    offsets = message_offsets(engine.tokenizer, messages, ids)
    assert len(offsets) == len(messages)

    def depths():
        return {c.depth for c in engine.cache.radix.checkpoint_candidates()}

    assert set(offsets) | {len(ids)} <= asyncio.run(_on_engine(hybrid_server, depths))


async def _on_engine(server, fn):
    """Run `fn` on the engine thread (between steps) and return its result."""
    return await server.state.async_engine.call(fn)
