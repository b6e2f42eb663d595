"""docs/COMPATIBILITY.md against the server: every OpenAI request field (as the `openai` package
declares them) is listed, the list is exactly what the request models declare, and each field
behaves as its status says (supported and ignored fields are accepted, refused ones are a 400
naming the field, default-only ones take their default and refuse anything else)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import httpx
import pytest

from kvsplice.server.protocol import ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "COMPATIBILITY.md"
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
STATUSES = {"supported", "ignored", "default only", "refused"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# A value for each field (plus the fields it needs), accepted when the field is supported or
# ignored, refused when it is refused; for default-only fields (default value, another value).
ACCEPTED = {
    "messages": {}, "prompt": {}, "model": {"model": None}, "message_offsets": {"message_offsets": [0]},
    "frequency_penalty": {"frequency_penalty": 0.5}, "presence_penalty": {"presence_penalty": -0.5},
    "repetition_penalty": {"repetition_penalty": 1.2}, "logit_bias": {"logit_bias": {"5": 1.5}},
    "logprobs": None, "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "max_tokens": {"max_tokens": 3}, "max_completion_tokens": {"max_completion_tokens": 3}, "n": {"n": 2},
    "best_of": {"n": 2, "best_of": 2}, "echo": {"echo": True},
    "parallel_tool_calls": {"tools": [TOOL], "parallel_tool_calls": False},
    "response_format": {"response_format": {"type": "json_object"}, "max_tokens": 2},
    "seed": {"seed": 7}, "stop": {"stop": ["zz"]}, "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0.5}, "top_p": {"top_p": 0.9}, "top_k": {"top_k": 5}, "min_p": {"min_p": 0.1},
    "tools": {"tools": [TOOL]}, "tool_choice": {"tools": [TOOL], "tool_choice": "required", "max_tokens": 2},
    "min_tokens": {"min_tokens": 1}, "stop_token_ids": {"stop_token_ids": [3]}, "ignore_eos": {"ignore_eos": True},
    "skip_special_tokens": {"skip_special_tokens": False},
    "guided_json": {"guided_json": {"type": "object"}, "max_tokens": 2}, "guided_regex": {"guided_regex": "a+"},
    "guided_choice": {"guided_choice": ["x", "y"]}, "guided_grammar": {"guided_grammar": 'root ::= "a"'},
    "guided_decoding_backend": {"guided_decoding_backend": "xgrammar"},
    "structured_outputs": {"structured_outputs": {"regex": "b+"}},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "user": {"user": "u-1"}, "metadata": {"metadata": {"k": "v"}}, "safety_identifier": {"safety_identifier": "s"},
    "prompt_cache_key": {"prompt_cache_key": "k"}, "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "prompt_cache_options": {"prompt_cache_options": {}},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
                               "continue_final_message": True, "add_generation_prompt": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 1},
    "truncation_side": {"truncate_prompt_tokens": 1, "truncation_side": "right"}, "prompt_logprobs": {"prompt_logprobs": 1},
    "return_token_ids": {"return_token_ids": True}, "allowed_token_ids": {"allowed_token_ids": [5, 6]},
    "logprob_token_ids": {"logprob_token_ids": [5]}, "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True}, "regex": {"regex": "a+"}, "stop_regex": {"stop_regex": ["zz+"]},
    "cache_salt": {"cache_salt": "salt"}, "session_id": {"session_id": "conv"}, "scr": {"scr": "off"},
}
# fields whose value above is sent with logprobs asked for (chat: true, completions: a count)
WITH_LOGPROBS = {"logprobs", "logprob_token_ids", "return_tokens_as_token_ids"}
REFUSED = {
    "message_offsets": [0],
    "audio": {"voice": "alloy", "format": "wav"}, "functions": [{"name": "f"}], "function_call": "auto",
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "high", "verbosity": "low",
    "web_search_options": {}, "moderation": {"model": "x"}, "suffix": "tail",
}
DEFAULT_ONLY = {
    "store": (False, True), "service_tier": ("auto", "flex"), "modalities": (["text"], ["text", "audio"]),
    "no_stop_trim": (False, True), "continue_final_message": (False, True), "separate_reasoning": (True, False),
    "stream_reasoning": (True, False), "return_hidden_states": (False, True), "use_beam_search": (False, True),
}


def documented() -> dict[str, dict[str, str]]:
    """{endpoint: {field: status}} from the tables of docs/COMPATIBILITY.md."""
    tables: dict[str, dict[str, str]] = {}
    endpoint = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"## POST (\S+)", line)
        if heading:
            endpoint = next(name for name, path in ENDPOINTS.items() if path == heading.group(1))
            tables[endpoint] = {}
        elif line.startswith("## "):
            endpoint = None
        row = re.match(r"\| `([a-z_]+)` \| ([a-z ]+) \|", line)
        if endpoint and row:
            assert row.group(2) in STATUSES, line
            assert row.group(1) not in tables[endpoint], f"{row.group(1)} listed twice"
            tables[endpoint][row.group(1)] = row.group(2)
    return tables


def declared(model) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()}


def openai_fields(kind: str) -> set[str]:
    openai = pytest.importorskip("openai")
    module = openai.types.chat.completion_create_params if kind == "chat" else openai.types.completion_create_params
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


@pytest.mark.parametrize("kind, model", [("chat", ChatCompletionRequest), ("completions", CompletionRequest)])
def test_every_openai_field_is_listed_and_the_list_is_what_the_server_declares(kind, model):
    fields = documented()[kind]
    missing = openai_fields(kind) - set(fields)
    assert not missing, f"OpenAI fields missing from docs/COMPATIBILITY.md ({kind}): {sorted(missing)}"
    assert set(fields) == declared(model), (set(fields) ^ declared(model))


def base_body(kind: str) -> dict:
    if kind == "chat":
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {"prompt": "hi", "max_tokens": 2}


def send(server, kind: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{ENDPOINTS[kind]}", json=body, timeout=60)


@pytest.mark.parametrize("kind", ENDPOINTS)
def test_each_field_behaves_as_its_status_says(server, kind):
    for field, status in documented()[kind].items():
        samples = {"supported": ACCEPTED, "ignored": ACCEPTED, "refused": REFUSED, "default only": DEFAULT_ONLY}[status]
        assert field in samples, f"{field} is documented as {status}, which the test has no value to check with"
        if status in ("supported", "ignored"):
            logprobs = {"logprobs": True} if kind == "chat" else {"logprobs": 2}
            body = {**base_body(kind), **(logprobs if field in WITH_LOGPROBS else {}), **(ACCEPTED[field] or {})}
            if body.get("model", "") is None:
                body["model"] = server.state.engine.name
            response = send(server, kind, body)
            assert response.status_code == 200, (field, response.text)
        elif status == "refused":
            response = send(server, kind, {**base_body(kind), field: REFUSED[field]})
            assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)
        else:
            default, other = DEFAULT_ONLY[field]
            assert send(server, kind, {**base_body(kind), field: default}).status_code == 200, field
            response = send(server, kind, {**base_body(kind), field: other})
            assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)


@pytest.mark.parametrize("kind", ENDPOINTS)
def test_a_field_not_listed_is_refused_naming_it(server, kind):
    response = send(server, kind, {**base_body(kind), "frobnicate": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "frobnicate" and "unknown field" in error["message"]
