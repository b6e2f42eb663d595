"""A model whose generation_config.json sets `max_new_tokens`: that is the completion budget of a request
that sets none (chat, completions, Responses), as vLLM reads it; a request's own budget wins. Its
sampling settings (temperature, top_p, top_k, min_p, repetition_penalty) are the defaults of a request
that leaves them unset, as vLLM's `--generation-config auto`."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from kvsplice.server import protocol as p
from kvsplice.server.sampling import openai_sampling
from kvsplice.tokenizer import generation_max_new_tokens, generation_sampling_defaults
from tests.server.conftest import start_server

BUDGET = 3


@pytest.fixture(scope="module")
def budget_server(tiny_model_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("budget_model") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config_path.write_text(json.dumps({**config, "max_new_tokens": BUDGET, "temperature": 0.0}))
    running = start_server(model_dir, num_slots=2048, max_batch_tokens=256)
    yield running
    running.thread.stop()


def post(server, path: str, body: dict) -> dict:
    reply = httpx.post(f"{server.url}{path}", json={"model": server.state.model_name, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_requests_without_a_budget_get_the_models(budget_server):
    chat = post(budget_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Go on."}],
                                                        "ignore_eos": True})
    assert chat["usage"]["completion_tokens"] == BUDGET and chat["choices"][0]["finish_reason"] == "length"
    completion = post(budget_server, "/v1/completions", {"prompt": "Once upon", "ignore_eos": True})
    assert completion["usage"]["completion_tokens"] == BUDGET
    response = post(budget_server, "/v1/responses", {"input": "Go on."})
    assert response["usage"]["output_tokens"] <= BUDGET


def test_a_requests_own_budget_wins(budget_server):
    chat = post(budget_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Go on."}],
                                                        "max_tokens": BUDGET + 2, "ignore_eos": True})
    assert chat["usage"]["completion_tokens"] == BUDGET + 2


def test_a_bad_max_new_tokens_is_a_clear_error(tmp_path):
    assert generation_max_new_tokens(tmp_path) is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generation_max_new_tokens(tmp_path)


def test_sampling_settings_left_unset_come_from_the_generation_config(budget_server):
    defaults = budget_server.state.engine.tokenizer.sampling_defaults
    assert defaults == {"temperature": 0.0}
    unset = openai_sampling(p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), 4, None, None, defaults=defaults)
    assert unset.temperature == 0.0 and unset.top_p == 1.0
    own = openai_sampling(p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.7), 4, None, None, defaults=defaults)
    assert own.temperature == 0.7
    response = post(budget_server, "/v1/responses", {"input": "Go on."})
    assert response["temperature"] == 0.0   # the setting it ran with
    # greedy by default: the same reply every time, without a seed
    bodies = [{"messages": [{"role": "user", "content": "Go on."}], "ignore_eos": True}] * 2
    replies = [post(budget_server, "/v1/chat/completions", body)["choices"][0]["message"]["content"] for body in bodies]
    assert replies[0] == replies[1]


def test_generation_config_sampling_settings_are_read_and_checked(tmp_path):
    assert generation_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_k": 20, "do_sample": True,
                                                                 "top_p": None}))
    assert generation_sampling_defaults(tmp_path) == {"temperature": 0.2, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "low"}))
    with pytest.raises(ValueError, match="temperature"):
        generation_sampling_defaults(tmp_path)
