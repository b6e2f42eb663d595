"""A constraint that does not compile within --grammar-compile-timeout: a 400 naming its field, soon
after the limit, the same constraint refused at once afterwards, and the server serving meanwhile
(the abandoned compile runs on a thread of its own, the GIL released)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import assert_idle_without_leak, start_server

LIMIT_S = 0.3
SLOW_EBNF = "root ::= " + " ".join(["[a-z]*"] * 3000) + ' "!"'     # seconds to compile, even on a tiny vocabulary


@pytest.fixture(scope="module")
def timed_server(tiny_model_dir):
    running = start_server(tiny_model_dir, num_slots=2048, max_batch_tokens=512, grammar_compile_timeout=LIMIT_S)
    yield running
    running.thread.stop()


def _chat(server, **extra) -> httpx.Response:
    body = {"model": server.state.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_a_quick_constraint_compiles(timed_server):
    assert _chat(timed_server, guided_regex="[cd]{2}").status_code == 200


@pytest.mark.parametrize("field, extra", [
    ("guided_grammar", {"guided_grammar": SLOW_EBNF}),
    ("structured_outputs", {"structured_outputs": {"grammar": SLOW_EBNF + ' "2"'}}),
])
def test_a_slow_grammar_is_a_400_and_the_server_keeps_serving(timed_server, field, extra):
    started = time.perf_counter()
    refused = _chat(timed_server, **extra)
    elapsed = time.perf_counter() - started
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == field and "did not compile within 0.3 s" in error["message"]
    assert elapsed < LIMIT_S + 3.0
    served = _chat(timed_server)                     # while the abandoned compile still runs
    assert served.status_code == 200 and served.json()["choices"][0]["message"]["content"] is not None
    started = time.perf_counter()
    again = _chat(timed_server, **extra)
    assert again.status_code == 400 and time.perf_counter() - started < 2.0
    assert_idle_without_leak(timed_server)


def test_while_slow_compiles_hold_every_slot_a_constraint_is_a_503_then_compiles(timed_server):
    """The two slow compiles above may still hold both compile slots: a new constraint then gets a 503
    (code grammar_busy, Retry-After) rather than waiting; once they end it compiles as usual."""
    deadline = time.monotonic() + 120
    while True:
        response = _chat(timed_server, guided_regex="[ab]{3}")
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        assert response.status_code == 503 and response.json()["error"]["code"] == "grammar_busy"
        assert response.headers["Retry-After"] == "1"
        time.sleep(0.5)
    assert response.status_code == 200
    assert set(response.json()["choices"][0]["message"]["content"]) <= {"a", "b"}
