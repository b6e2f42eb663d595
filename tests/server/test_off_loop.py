"""Work that grows with the input runs off the event loop: /health and /metrics keep answering while a
2 MB prompt is tokenized, and 100,000 messages are refused before any of them is rendered.

The assertions are about concurrency, not speed: while the big request is in flight, the probes keep
being answered (the longest silence between two answers is a small part of the big request's time);
were tokenization on the loop, one silence would last nearly all of it.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvsplice.server.limits import RequestLimits
from tests.server.conftest import assert_idle_without_leak, start_server

SENTENCE = "The quick brown fox jumps over the lazy dog. "
BIG_PROMPT = SENTENCE * (2_000_000 // len(SENTENCE))  # 2 MB, ~1M tokens: seconds of tokenization
# The other endpoints take the same path through the worker pool; a quarter of the size keeps them quick.
PROMPT_512K = SENTENCE * (512_000 // len(SENTENCE))


@pytest.fixture(scope="module")
def roomy_server(tiny_model_dir):
    """A server whose body limit admits a 2 MB prompt (16 MiB) and 100,000 messages."""
    running = start_server(tiny_model_dir, settings_kwargs={"limits": RequestLimits(max_body_bytes=16 << 20)},
                           num_slots=1024)
    yield running
    running.thread.stop()


def _big_request_in_background(server, path: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def send() -> None:
        result["start"] = time.monotonic()
        result["response"] = httpx.post(f"{server.url}{path}", json=body, timeout=120)
        result["end"] = time.monotonic()

    thread = threading.Thread(target=send)
    thread.start()
    return thread, result


def _probe_while(thread: threading.Thread, server, paths: tuple[str, ...]) -> list[float]:
    """GET each of `paths` in turn until `thread` ends; the times at which answers (all 200) arrived."""
    answered = []
    while thread.is_alive():
        for path in paths:
            response = httpx.get(f"{server.url}{path}", timeout=30)
            assert response.status_code == 200, response.text
            answered.append(time.monotonic())
    return answered


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": BIG_PROMPT, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT_512K}]}, "messages"),
    ("/generate", {"text": PROMPT_512K}, "text"),
])
def test_probes_answer_while_a_long_prompt_is_tokenized(roomy_server, path, body, param):
    thread, result = _big_request_in_background(roomy_server, path, body)
    answered = _probe_while(thread, roomy_server, ("/health", "/metrics"))
    thread.join()
    response = result["response"]
    assert response.status_code == 400 and response.json()["error"]["param"] == param  # too long for the context
    in_flight = [t for t in answered if result["start"] < t < result["end"]]
    busy_s = result["end"] - result["start"]
    assert len(in_flight) >= 5, (len(in_flight), busy_s)
    marks = [result["start"], *in_flight, result["end"]]
    longest_silence = max(b - a for a, b in zip(marks, marks[1:]))
    assert longest_silence < 0.5 * busy_s, (longest_silence, busy_s)


def test_100k_messages_are_refused_before_rendering(roomy_server):
    thread, result = _big_request_in_background(
        roomy_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 100_000})
    thread.join()
    response = result["response"]
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "at most 1024 messages" in error["message"]
    assert_idle_without_leak(roomy_server)
