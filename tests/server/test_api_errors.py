"""Bad input, full queue, disconnects and exactness of prompt logprobs, against a real server."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from tests.server.conftest import start_server


def _post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=30, **kwargs)


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/chat/completions", _chat(max_tokens=-1), 400, "max_tokens"),
    ("/v1/chat/completions", _chat(max_tokens=10_000_000), 400, "context limit"),
    ("/v1/chat/completions", _chat(max_tokens="many"), 400, "max_tokens"),
    ("/v1/chat/completions", _chat(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 2}, 400, "at least one message"),
    ("/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "not a role!", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", _chat(n=17), 400, "[1, 16]"),
    ("/v1/chat/completions", _chat(temperature=-1), 400, "temperature"),
    ("/v1/chat/completions", _chat(top_p=0), 400, "top_p"),
    ("/v1/chat/completions", _chat(top_logprobs=3), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat(presence_penalty=5), 400, "presence_penalty"),
    ("/v1/chat/completions", _chat(unknown_field=1), 400, "unknown field"),
    ("/v1/chat/completions", _chat(scr={"max_sessions": 3}), 400, "scr"),
    ("/v1/chat/completions", _chat(scr="sometimes"), 400, "scr"),
    ("/v1/chat/completions", _chat(model="gpt-4"), 404, "gpt-4"),
    ("/v1/chat/completions", _chat(stream=True, max_tokens=10_000_000), 400, "context limit"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "echo"),
    ("/v1/completions", {"prompt": ["a"] * 65, "max_tokens": 2}, 400, "at most 64 prompts"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10_000_000], "max_tokens": 2}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": list(range(3000)), "max_tokens": 1}, 400, "3000 tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 99}, 400, "logprobs"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, "text or input_ids"),
])
def test_bad_input_is_answered_in_openai_format(server, path, body, status, needle):
    response = _post(server, path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle.lower() in error["message"].lower(), error
    assert set(error) >= {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_malformed_json_is_400(server):
    response = _post(server, "/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "json" in response.json()["error"]["message"].lower()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_model_path_is_accepted_as_the_model_name(server):
    response = _post(server, "/v1/chat/completions", json=_chat(model=str(server.model_dir)))
    assert response.status_code == 200


def test_disconnect_mid_stream_frees_slots(server):
    body = _chat(max_tokens=400, stream=True, ignore_eos=True, temperature=0)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.metric("kvsplice_kv_slots_in_use") == 0 and server.metric("kvsplice_num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert server.metric("kvsplice_kv_slots_in_use") == 0
    assert server.metric("kvsplice_num_requests_running") == 0
    assert server.metric("kvsplice_engine_requests_aborted_total") >= 1


def test_echo_prompt_logprobs_match_transformers(server, client):
    from transformers import AutoModelForCausalLM

    tok = server.state.engine.tokenizer
    prompt = "Agents edit their own context: they delete tool results."
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=1,
                                    echo=True, logprobs=0, temperature=0)
    served = out.choices[0].logprobs.token_logprobs
    ids = tok.encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert served[0] is None
    got = torch.tensor(served[1:len(ids)])
    assert torch.max(torch.abs(got - expected)).item() <= 1e-3
    assert len(served) == len(ids) + 1  # echo plus the one generated token


@pytest.mark.slow  # a server of its own, held busy until its queue is full
def test_full_queue_answers_503_with_retry_after(tiny_model_dir):
    busy = start_server(tiny_model_dir, num_slots=4096, max_running=1, max_waiting=1)
    try:
        long_body = _chat(max_tokens=3000, ignore_eos=True, temperature=0)  # busy for seconds
        runners = [threading.Thread(target=_post, args=(busy, "/v1/chat/completions"), kwargs={"json": long_body})
                   for _ in range(2)]
        for runner in runners:
            runner.start()
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while busy.metric("kvsplice_num_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        response = _post(busy, "/v1/chat/completions", json=_chat())
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        assert "queue" in response.json()["error"]["message"]
        for runner in runners:
            runner.join(60)
        assert _post(busy, "/v1/chat/completions", json=_chat()).status_code == 200
    finally:
        busy.thread.stop()


def test_health_is_503_once_the_engine_thread_is_gone(tiny_model_dir):
    doomed = start_server(tiny_model_dir, num_slots=256)
    try:
        doomed.state.async_engine.stop()
        assert httpx.get(f"{doomed.url}/health", timeout=10).status_code == 503
        assert httpx.get(f"{doomed.url}/readiness", timeout=10).status_code == 503
        response = _post(doomed, "/v1/chat/completions", json=_chat())
        assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
    finally:
        doomed.thread.stop()
