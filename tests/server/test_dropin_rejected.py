"""One `kvsplice.rejected` log line for every 4xx answer over HTTP, whichever layer refused the request
(validation, a route's own checks, an unknown model or route, the body limit, the API key): status,
route, the error's param and message, the request id; never the prompt."""

from __future__ import annotations

import json

import httpx
import pytest

from kvsplice.server.auth import ApiKeys
from kvsplice.server.limits import RequestLimits
from kvsplice.server.request_log import REJECTED_PREFIX
from tests.server.conftest import start_server

SECRET = "zebra-marmalade-7731"   # in every prompt: it must never reach the log


def rejected_lines(server) -> list[dict]:
    return [json.loads(line[len(REJECTED_PREFIX):]) for line in server.sink.lines() if line.startswith(REJECTED_PREFIX)]


def rejected_after(server, send) -> dict:
    before = len(rejected_lines(server))
    response = send()
    assert 400 <= response.status_code < 500, response.text
    lines = rejected_lines(server)
    assert len(lines) == before + 1, lines[before:]
    assert SECRET not in json.dumps(lines[-1])
    assert lines[-1]["status"] == response.status_code
    assert lines[-1]["message"] == response.json()["error"]["message"][:500] + (
        "..." if len(response.json()["error"]["message"]) > 500 else "")
    return lines[-1]


def chat(server, **fields):
    body = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 2, **fields}
    return lambda: httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_a_validation_error_is_logged_with_its_param(server):
    line = rejected_after(server, chat(server, n=17))
    assert line["route"] == "/v1/chat/completions" and line["param"] == "n" and line["rid"] is None
    line = rejected_after(server, chat(server, temperature=-1))
    assert line["param"] == "temperature" and line["rid"].startswith("chatcmpl-")


def test_a_routes_own_refusal_names_the_request_id(server):
    line = rejected_after(server, chat(server, max_tokens=0))
    assert line["param"] == "max_tokens" and line["rid"].startswith("chatcmpl-")
    line = rejected_after(server, lambda: httpx.post(f"{server.url}/v1/completions", json={
        "prompt": SECRET, "max_tokens": 1, "stop_token_ids": [10**6]}, timeout=60))
    assert line["route"] == "/v1/completions" and line["param"] == "stop_token_ids" and line["rid"].startswith("cmpl-")


def test_unknown_model_and_route_are_logged(server):
    line = rejected_after(server, chat(server, model="nope"))
    assert line["status"] == 404 and line["param"] == "model"
    line = rejected_after(server, lambda: httpx.get(f"{server.url}/v1/nothing-here", timeout=10))
    assert line["status"] == 404 and line["route"] == "/v1/nothing-here"


def test_other_protocols_are_logged_in_their_error_shape(server):
    line = rejected_after(server, lambda: httpx.post(f"{server.url}/v1/messages", json={
        "model": "x", "max_tokens": -1, "messages": [{"role": "user", "content": SECRET}]}, timeout=60))
    assert line["route"] == "/v1/messages" and line["message"]


def test_successes_are_not_logged(server):
    before = len(rejected_lines(server))
    assert chat(server)().status_code == 200
    assert len(rejected_lines(server)) == before


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    running = start_server(tiny_model_dir, {"api_keys": ApiKeys(("key-1",)),
                                            "limits": RequestLimits(max_body_bytes=2048)}, num_slots=512)
    yield running
    running.thread.stop()


def test_a_missing_key_and_a_body_too_large_are_logged(guarded):
    line = rejected_after(guarded, chat(guarded))
    assert line["status"] == 401 and line["route"] == "/v1/chat/completions"
    headers = {"Authorization": "Bearer key-1"}
    line = rejected_after(guarded, lambda: httpx.post(f"{guarded.url}/v1/completions", headers=headers, json={
        "prompt": SECRET * 200, "max_tokens": 1}, timeout=60))
    assert line["status"] == 413


def test_a_body_too_large_is_named_as_sglang_names_it(guarded):
    """SGLang answers a body past its --max-payload-size with "Payload Too Large", and its clients look
    for those words: kvsplice's 413 message starts with them."""
    response = httpx.post(f"{guarded.url}/v1/chat/completions", headers={"Authorization": "Bearer key-1"},
                          json={"messages": [{"role": "user", "content": "hello " * 400}]}, timeout=60)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["message"].startswith("Payload Too Large: ") and error["code"] == "request_too_large", error
