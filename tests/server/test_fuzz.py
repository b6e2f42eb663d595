"""Property-based fuzzing of every route against the server's own OpenAPI document (schemathesis).

For each operation, schemathesis generates requests that follow the document (positive) and requests
that break it (negative); seeded (derandomize) and bounded (MAX_EXAMPLES per operation and mode) so the
run is repeatable and quick. Every answer must be: no 5xx, a status the document declares for that
route, the declared content type and schema, OpenAI's error body on every 4xx; and afterwards the server
is healthy with no slot held by a request.

Positive cases are steered a little so that more of them reach the engine and stay quick: fields the
server refuses unless neutral are dropped, and completion budgets are capped at MAX_NEW_TOKENS.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[test]')")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvsplice.server.auth import ApiKeys  # noqa: E402
from tests.server.conftest import assert_idle_without_leak, start_server  # noqa: E402

KEY = "sk-fuzz-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_EXAMPLES = 12
# Fields the server refuses unless neutral (n > 1, penalties, ...), which the document types but does not
# constrain: positive cases drop them, so that more of them get past validation into the engine (their
# refusal is tested by the negative cases and test_hostile_input.py).
REFUSED_UNLESS_NEUTRAL = ("n", "presence_penalty", "frequency_penalty", "logit_bias", "best_of", "suffix",
                          "top_logprobs")
MAX_NEW_TOKENS = 8


def _steer(body: dict) -> None:
    """Drop REFUSED_UNLESS_NEUTRAL and cap the completion budget of a positive case's body (in place)."""
    for name in REFUSED_UNLESS_NEUTRAL:
        body.pop(name, None)
    budgets = [(body, "max_tokens"), (body, "max_completion_tokens")]
    if "text" in body or "input_ids" in body:  # /generate: the budget is sampling_params.max_new_tokens
        body.setdefault("sampling_params", {})
        budgets = [(body["sampling_params"], "max_new_tokens")] if isinstance(body["sampling_params"], dict) else []
    elif "max_completion_tokens" not in body:
        budgets = budgets[:1]
    for holder, name in budgets:
        value = holder.get(name)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > MAX_NEW_TOKENS):
            holder[name] = MAX_NEW_TOKENS
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    running = start_server(tiny_model_dir, settings_kwargs={"api_keys": ApiKeys((KEY,))}, num_slots=128,
                           max_batch_tokens=256)
    yield running
    running.thread.stop()


def _operations(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=AUTH)
    return [result.ok() for result in schema.get_all_operations()]


def _assert_openai_error(response) -> None:
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]


def _fuzz(server, operation, mode) -> None:
    @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        if mode == schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict):
            _steer(case.body)
        response = case.call(base_url=server.url, headers=AUTH, timeout=60)
        case.validate_response(response, checks=CHECKS)
        _assert_openai_error(response)

    run()


@pytest.mark.slow  # schemathesis calls every route with generated bodies
def test_every_route_against_its_openapi_document(fuzz_server):
    operations = _operations(fuzz_server)
    labels = {operation.label for operation in operations}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /generate", "GET /health",
            "HEAD /health", "POST /flush_cache", "GET /metrics", "POST /v1/responses", "GET /v1/responses/{response_id}",
            "DELETE /v1/responses/{response_id}", "POST /v1/messages", "POST /v1/messages/count_tokens"} <= labels, labels
    for operation in operations:
        modes = [schemathesis.GenerationMode.POSITIVE]
        if operation.body:  # negative data needs something to break: a body
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:
            _fuzz(fuzz_server, operation, mode)
    assert_idle_without_leak(fuzz_server)


def test_the_document_declares_the_statuses_sent(fuzz_server):
    document = fuzz_server.app.openapi()
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert set(chat["responses"]) == {"200", "400", "401", "404", "413", "500", "503"}
    assert chat["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"}
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "ChatMessage" in document["components"]["schemas"]
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            assert "422" not in operation["responses"], (method, path)
