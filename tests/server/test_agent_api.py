"""The agent-facing API through the real `openai` client on the tiny random model: forced tool calls
(streamed and not) are always valid calls, structured outputs always match, n choices share the
prompt, penalties / logit_bias / min_tokens steer sampling, and what cannot be served is a 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.test_tool_parsers import SEARCH, TOOLS, WEATHER

USER = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


def model_id(client) -> str:
    return client.models.list().data[0].id


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"messages": USER, "max_tokens": 8, **body}, timeout=60)


def validate_calls(calls, allowed: dict[str, dict]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


# Random weights rarely pick the stop token among everything the grammar allows after a call (another
# call), so these tests ask for one call; a reply cut inside a later call still returns its complete ones.
@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_always_returns_valid_calls(client, seed):
    reply = client.chat.completions.create(model=model_id(client), messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=seed, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    validate_calls(choice.message.tool_calls, {"get_weather": WEATHER, "search": SEARCH})


def test_a_required_call_wins_over_a_response_format_beside_it(client):
    # as on OpenAI's API (the OpenAI Agents SDK sends its output type beside tool_choice "required")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "sky": {"enum": ["sunny", "rainy"]}}, "required": ["sky"]}}}
    reply = client.chat.completions.create(model=model_id(client), messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=0, parallel_tool_calls=False,
                                           response_format=fmt)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    validate_calls(choice.message.tool_calls, {"get_weather": WEATHER, "search": SEARCH})


def test_parallel_required_calls_cut_by_max_tokens_keep_the_complete_ones(client):
    reply = client.chat.completions.create(model=model_id(client), messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=1.0, seed=5)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    validate_calls(choice.message.tool_calls, {"get_weather": WEATHER, "search": SEARCH})


@pytest.mark.parametrize("seed", range(3))
def test_required_tool_choice_streamed_deltas_add_up_to_valid_calls(client, seed):
    stream = client.chat.completions.create(model=model_id(client), messages=USER, tools=TOOLS, tool_choice="required",
                                            max_tokens=200, temperature=1.0, seed=seed, stream=True,
                                            parallel_tool_calls=False)
    calls, reasons, content = {}, [], ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or delta.id
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls" and content == ""
    assert calls and all(c["id"] for c in calls.values())
    schemas = {"get_weather": WEATHER, "search": SEARCH}
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_named_tool_choice_calls_that_function_once(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=model_id(client), messages=USER, tools=TOOLS, max_tokens=200, seed=seed,
            tool_choice={"type": "function", "function": {"name": "search"}})
        calls = reply.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "search"
        validate_calls(calls, {"search": SEARCH})


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_parses_nothing(server):
    offered = post(server, {"tools": TOOLS, "tool_choice": "auto", "temperature": 0}).json()
    hidden = post(server, {"tools": TOOLS, "tool_choice": "none", "temperature": 0}).json()
    plain = post(server, {"temperature": 0}).json()
    assert hidden["usage"]["prompt_tokens"] == offered["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert "tool_calls" not in hidden["choices"][0]["message"]


def test_parallel_tool_calls_false_keeps_one_call(client):
    for seed in range(3):
        reply = client.chat.completions.create(model=model_id(client), messages=USER, tools=TOOLS, seed=seed,
                                               tool_choice="required", parallel_tool_calls=False, max_tokens=300)
        assert len(reply.choices[0].message.tool_calls) == 1


SCHEMAS = [
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 100}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "temps": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4}},
     "required": ["city", "temps"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 10},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["ok", "note", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"], "additionalProperties": False}, "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["person", "id"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "do": {"type": "string", "maxLength": 8}},
        "required": ["n", "do"], "additionalProperties": False}}},
     "required": ["steps"], "additionalProperties": False},
]


def test_fifty_strict_json_schema_requests_all_validate(client):
    """50 varied requests (5 schemas x 10 prompts and seeds, sampled at temperature 1 from random
    weights): every reply parses and validates."""
    valid = 0
    for index in range(50):
        schema = SCHEMAS[index % len(SCHEMAS)]
        reply = client.chat.completions.create(
            model=model_id(client), max_tokens=300, temperature=1.0, seed=index,
            messages=[{"role": "user", "content": f"Request {index}: answer in JSON about topic {index * 7}."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{index % 5}", "schema": schema,
                                                                   "strict": True}})
        assert reply.choices[0].finish_reason == "stop", reply.choices[0]
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        valid += 1
    assert valid == 50


def test_json_object_regex_and_choice(server):
    obj = post(server, {"response_format": {"type": "json_object"}, "max_tokens": 400, "seed": 1}).json()
    assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)
    regex = post(server, {"guided_regex": "[0-9]{3}-[a-z]{2}", "max_tokens": 20, "seed": 2}).json()
    assert len(regex["choices"][0]["message"]["content"]) == 6
    choice = post(server, {"guided_choice": ["alpha", "beta"], "max_tokens": 20, "seed": 3}).json()
    assert choice["choices"][0]["message"]["content"] in ("alpha", "beta")
    completion = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": "Answer:", "max_tokens": 20, "guided_choice": ["left", "right"]}).json()
    assert completion["choices"][0]["text"] in ("left", "right")


def test_n_choices_share_the_prompt(server, client):
    """n=3: three different choices; the prompt is prefilled once and every choice then hits it."""
    prompt = [{"role": "user", "content": "Tell me a story about a robot. " * 8}]
    reply = client.chat.completions.create(model=model_id(client), messages=prompt, n=3, max_tokens=6, seed=11,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage.completion_tokens == 18
    records = [json.loads(line.split(" ", 1)[1]) for line in server.sink.lines() if line.startswith("kvsplice.request")]
    mine = [r for r in records if r["rid"].startswith(reply.id)]
    prefill = next(r for r in mine if r["rid"].endswith("-prompt"))
    choices = [r for r in mine if not r["rid"].endswith("-prompt")]
    assert len(choices) == 3
    prompt_tokens = reply.usage.prompt_tokens
    for record in choices:
        assert record["prefix_tokens"] == prompt_tokens - 1, record
    assert prefill["prefilled_tokens"] == reply.usage.model_extra["reuse"]["prefilled_tokens"]
    again = client.chat.completions.create(model=model_id(client), messages=prompt, n=3, max_tokens=6, seed=11,
                                           extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_n_choices_stream(client):
    stream = client.chat.completions.create(model=model_id(client), messages=USER, n=2, max_tokens=5, stream=True,
                                            extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    text, finished, usage = {0: "", 1: ""}, set(), None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and usage.completion_tokens == 10


def test_logit_bias_and_min_tokens(server, client):
    tokenizer = server.state.engine.tokenizer
    forced = tokenizer.encode("fox", add_special_tokens=False)[0]
    reply = client.chat.completions.create(model=model_id(client), messages=USER, max_tokens=5, temperature=0,
                                           logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == tokenizer.decode([forced] * 5)
    eos = tokenizer.eos_token_ids[0]
    short = client.chat.completions.create(model=model_id(client), messages=USER, max_tokens=20, temperature=0,
                                           logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "stop"


def test_penalties_change_greedy_output(client):
    base = dict(model=model_id(client), messages=USER, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**base).choices[0].message.content
    penalised = client.chat.completions.create(**{**base, "frequency_penalty": 2.0, "presence_penalty": 2.0})
    repeated = client.chat.completions.create(**{**base, "extra_body": {"ignore_eos": True, "repetition_penalty": 3.0}})
    assert penalised.choices[0].message.content != plain
    assert repeated.choices[0].message.content != plain


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format", "cannot compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format", "cannot compile"),
    ({"guided_regex": "((", "guided_choice": None}, "guided_regex", "cannot compile"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "cannot be combined"),
    ({"tools": [TOOLS[0]] * 129}, "tools", "at most 128"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"999999": 5, "5": 1, "888888": 2}}, "logit_bias", "888888, 999999 are outside"),
    ({"logit_bias": {"x": 5, "y": 1}}, "logit_bias", "'x', 'y'"),
    ({"logit_bias": {"1": 500, "2": -500}}, "logit_bias", "500.0 for token 1, -500.0 for token 2"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(server, body, param, needle):
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["param"] == param, error


def test_openai_client_surfaces_the_400(client):
    with pytest.raises(openai.BadRequestError, match="not among"):
        client.chat.completions.create(model=model_id(client), messages=USER, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_chat_template_and_tool_call_parser_settings(tiny_model_dir):
    """--chat-template (Llama 3.1's) and --tool-call-parser llama3_json: the forced call is written in
    Llama's JSON syntax and read back as tool_calls, the prompt is rendered by that template."""
    from kvsplice.config import EngineConfig
    from kvsplice.server.api import ServerSettings
    from kvsplice.server.launch import ServerThread, build_app
    from kvsplice.server.protocol import ChatMessage
    from kvsplice.server.request_log import RequestLog
    from tests.server.chat_templates import LLAMA31
    from tests.server.conftest import LineSink

    settings = ServerSettings(model_path=str(tiny_model_dir), chat_template=LLAMA31, tool_call_parser="llama3_json")
    app = build_app(EngineConfig(model=str(tiny_model_dir), num_slots=4096), settings, RequestLog(LineSink()))
    assert app.state.kvsplice.chat.parser.name == "llama3_json"
    assert "Cutting Knowledge Date" in app.state.kvsplice.chat.render([ChatMessage(**USER[0])], TOOLS)
    thread = ServerThread(app)
    thread.start()
    try:
        body = {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}},
                "max_tokens": 200, "seed": 1}
        reply = httpx.post(f"{thread.url}/v1/chat/completions", json=body, timeout=60).json()
        [call] = reply["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "search"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SEARCH)
    finally:
        thread.stop()
