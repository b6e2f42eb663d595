"""OpenAI's Responses API (/v1/responses) through the real `openai` client on the tiny random model: plain
answers, a forced tool loop, streaming events, `previous_response_id` chains attached to their SCR
session, stored responses per tenant, and bad input answered 4xx naming the field."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from kvsplice.reuse.config import ReuseConfig
from kvsplice.server.auth import ApiKeys
from kvsplice.server.response_store import ResponseStore, StoredResponse
from kvsplice.server.responses_protocol import ResponseRequest
from tests.server.conftest import assert_idle_without_leak, start_server
from tests.server.test_tool_parsers import WEATHER

DOC = Path(__file__).resolve().parents[2] / "docs" / "COMPATIBILITY.md"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}]
SMALL_PROMPT_SCR = ReuseConfig(match_min_tokens=32, min_span=8, tail=4)
KEYS = ("sk-resp-tenant-a-0123456789", "sk-resp-tenant-b-0123456789")


@pytest.fixture(scope="module")
def resp_server(tiny_model_dir):
    """A server of its own (chained sessions hold K/V), with two API keys (two tenants)."""
    running = start_server(tiny_model_dir, settings_kwargs={"api_keys": ApiKeys(KEYS)}, num_slots=8192,
                           max_batch_tokens=512, reuse=SMALL_PROMPT_SCR)
    yield running
    running.thread.stop()


def make_client(server, key: str = KEYS[0]):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def rclient(resp_server):
    return make_client(resp_server)


def post(server, body: dict, key: str = KEYS[0]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def check_usage(usage) -> dict:
    reuse = usage.model_extra["reuse"]
    assert usage.input_tokens == reuse["prefix_tokens"] + reuse["relocated_tokens"] + reuse["prefilled_tokens"]
    assert usage.input_tokens_details.cached_tokens == reuse["prefix_tokens"] + reuse["relocated_tokens"]
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # SGLang's names for the same counts, which its clients read
    assert (usage.model_extra["prompt_tokens"], usage.model_extra["completion_tokens"]) == (
        usage.input_tokens, usage.output_tokens)
    return reuse


def test_plain_string_input_answers_a_response(rclient):
    response = rclient.responses.create(input="Say hello.", instructions="Be brief.", max_output_tokens=6,
                                        temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.usage.output_tokens <= 6
    check_usage(response.usage)
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    messages = [item for item in response.output if item.type == "message"]
    assert response.output_text == "".join(part.text for item in messages for part in item.content)


def test_items_input_with_parts_and_reasoning(rclient):
    response = rclient.responses.create(
        input=[{"role": "developer", "content": "Be brief."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               {"type": "reasoning", "summary": [{"type": "summary_text", "text": "greet back"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
               {"role": "user", "content": "Again"}],
        max_output_tokens=4, store=False)
    assert response.store is False and response.usage.input_tokens > 0


def test_forced_tool_loop_function_call_then_output_then_answer(rclient):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = rclient.responses.create(input=[question], tools=TOOLS, tool_choice="required", max_output_tokens=200,
                                     temperature=1.0, parallel_tool_calls=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the client runs the tool and sends the whole loop back (no previous_response_id)
    loop = [question, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                       "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}]
    answer = rclient.responses.create(input=loop, tools=TOOLS, tool_choice="none", max_output_tokens=8)
    assert not [item for item in answer.output if item.type == "function_call"]
    assert answer.usage.input_tokens > first.usage.input_tokens
    # chained instead: the stored call is the history, only its output is sent
    chained = rclient.responses.create(previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                                       max_output_tokens=8, input=[loop[2]])
    assert chained.previous_response_id == first.id
    assert check_usage(chained.usage)["session"] == "matched"


def test_named_tool_choice_calls_that_function(rclient):
    response = rclient.responses.create(input="weather?", tools=TOOLS, max_output_tokens=200,
                                        tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]


def test_json_schema_text_format_matches(rclient):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"],
              "additionalProperties": False}
    response = rclient.responses.create(input="answer in JSON", max_output_tokens=60, temperature=1.0,
                                        text={"format": {"type": "json_schema", "name": "out", "schema": schema,
                                                         "strict": True}})
    if response.status == "completed":
        jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_streamed_text_events_in_order_and_stored(rclient):
    events = list(rclient.responses.create(input="Tell me a story.", max_output_tokens=8, stream=True,
                                           temperature=0))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text
    if deltas:
        order = [k for k in kinds if k.startswith("response.output_item") or k.startswith("response.content_part")
                 or k == "response.output_text.done"]
        assert order == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                         "response.content_part.done", "response.output_item.done"]
    stored = rclient.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.usage.input_tokens == final.usage.input_tokens


def test_streamed_forced_call_arguments_add_up(rclient):
    events = list(rclient.responses.create(input="weather in Rome?", tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_output_tokens=200, stream=True))
    kinds = [event.type for event in events]
    assert kinds[-1] == "response.completed"
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == arguments
    jsonschema.validate(json.loads(arguments), WEATHER)
    final = events[-1].response.output
    assert final[0].arguments == arguments and final[0].status == "completed"


def test_previous_response_id_chain_of_five_turns_reuses_the_session(rclient):
    response = rclient.responses.create(
        input="You are a careful agent. Agents edit their own context: they delete tool results and rewrite notes "
              "in place. Task: read the documentation and summarise it.", max_output_tokens=6, temperature=0)
    assert check_usage(response.usage)["session"] == "new"
    for turn in range(4):
        previous = response.usage.input_tokens
        response = rclient.responses.create(previous_response_id=response.id, max_output_tokens=6, temperature=0,
                                            input=f"Next file: {turn}.")
        reuse = check_usage(response.usage)
        assert reuse["session"] == "matched", (turn, reuse)
        # the previous turn's prompt comes from the cache; only its reply's tail and the new message are computed
        assert response.usage.input_tokens_details.cached_tokens >= previous
        assert response.previous_response_id is not None


def test_edited_full_input_relocates_what_follows_the_edit(rclient):
    system = {"role": "system", "content": "You are a careful research agent. Agents edit their own context: "
                                           "they delete tool results and rewrite notes in place. " * 3}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    result = {"type": "function_call_output", "call_id": "call_1",
              "output": "def main():\n    print('hello world')\n\nThe function returns None. " * 6}
    notes = {"role": "user", "content": "Working notes: Once upon a time there was a little robot who liked to "
                                        "read documentation. Tool results are long; notes are short. " * 3}
    # stored (the default) but not chained: the client sends its whole, edited conversation again
    first = rclient.responses.create(input=[system, call, result, notes], max_output_tokens=4, temperature=0,
                                     extra_body={"cache_salt": "edited"})
    second = rclient.responses.create(input=[system, notes, {"role": "user", "content": "Continue."}],
                                      max_output_tokens=4, temperature=0, extra_body={"cache_salt": "edited"})
    reuse = check_usage(second.usage)
    assert first.usage.input_tokens > second.usage.input_tokens
    assert reuse["session"] == "matched" and reuse["relocated_tokens"] > 0, reuse


def test_stored_responses_are_per_tenant(resp_server, rclient):
    response = rclient.responses.create(input="Hi", max_output_tokens=2)
    other = make_client(resp_server, KEYS[1])
    for call in (lambda: other.responses.retrieve(response.id),
                 lambda: other.responses.create(previous_response_id=response.id, input="x", max_output_tokens=2),
                 lambda: other.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert rclient.responses.retrieve(response.id).id == response.id
    rclient.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        rclient.responses.retrieve(response.id)
    reply = post(resp_server, {"input": "x", "previous_response_id": "resp_missing"})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "previous_response_id"


def test_a_malformed_previous_response_id_is_a_400_and_penalties_apply(resp_server):
    """SGLang's Responses tests: an id without OpenAI's `resp_` prefix is a 400 with OpenAI's error
    body; frequency_penalty (an SGLang extra) is honoured as on chat."""
    reply = post(resp_server, {"input": "x", "previous_response_id": "bad"})
    assert reply.status_code == 400 and {"message", "type", "code"} <= set(reply.json()["error"])
    base = {"input": "Say the same word again and again.", "max_output_tokens": 12, "temperature": 0}
    plain, penalized = (post(resp_server, {**base, **extra}).json() for extra in ({}, {"frequency_penalty": 2.0}))
    assert penalized["object"] == "response" and penalized["status"] in ("completed", "incomplete")
    text = [r["output"][-1]["content"][0]["text"] for r in (plain, penalized)]
    assert text[0] != text[1], text


def test_store_false_is_not_kept(resp_server, rclient):
    response = rclient.responses.create(input="Hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{resp_server.url}/v1/responses/{response.id}",
                     headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=10).status_code == 404


def test_the_store_evicts_a_tenants_oldest_first():
    store = ResponseStore(max_per_tenant=2)
    for name in ("a", "b", "c"):
        store.put("t1", StoredResponse(name, name, (), {}))
    store.put("t2", StoredResponse("x", "x", (), {}))
    assert store.get("t1", "a") is None and store.get("t1", "b") and store.get("t1", "c")
    assert store.get("t2", "x") and store.get("t1", "x") is None and store.count("t1") == 2
    assert store.delete("t1", "b") and not store.delete("t1", "b") and store.count("t1") == 1


def test_the_store_bounds_each_tenants_characters_and_keeps_the_newest():
    store = ResponseStore(max_chars_per_tenant=10)
    turn = ({"role": "user", "content": "12345"},)
    store.put("t", StoredResponse("a", "a", turn, {}))
    store.put("t", StoredResponse("b", "a", turn * 2, {}))
    assert store.get("t", "a") is None and store.get("t", "b")
    store.put("t", StoredResponse("c", "a", turn * 5, {}))   # alone over the bound: still kept
    assert store.count("t") == 1 and store.get("t", "c")


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "x", "model": "nope"}, "model"),
    ({"input": "x", "previous_response_id": "bad"}, "previous_response_id"),
    ({"input": "x", "frequency_penalty": 3}, "frequency_penalty"),
    ({"input": "x", "presence_penalty": "high"}, "presence_penalty"),
])
def test_bad_input_is_a_4xx_naming_the_field(resp_server, body, param):
    reply = post(resp_server, body)
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert param.split(".")[0] in error["message"], error   # the message speaks of the same field


def test_codex_cli_request_shape_is_answered(resp_server):
    """Codex CLI's own fields: a reasoning summary asked for (none is written: the reasoning text itself
    is the item's content), encrypted reasoning included (never made), a prompt cache key and its client
    metadata; its hosted web_search tool and a namespace of tools are a 400 naming the tool."""
    body = {"input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}],
            "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
            "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1",
            "client_metadata": {"thread_id": "thread-1"}, "max_output_tokens": 3}
    reply = post(resp_server, body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["status"] in ("completed", "incomplete")
    for tool in ({"type": "web_search", "external_web_access": False},
                 {"type": "namespace", "name": "agents", "description": "d", "tools": [TOOLS[0]]}):
        reply = post(resp_server, {**body, "tools": TOOLS + [tool]})
        assert reply.status_code == 400 and reply.json()["error"]["param"].startswith("tools.1"), reply.text
    reply = post(resp_server, {**body, "reasoning": {"summary": "auto", "effort": "low"}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "reasoning.effort", reply.text


def test_missing_key_is_401(resp_server):
    reply = httpx.post(f"{resp_server.url}/v1/responses", json={"input": "x"}, timeout=10)
    assert reply.status_code == 401


def test_server_idle_without_leak(resp_server):
    assert_idle_without_leak(resp_server)


# ----- docs/COMPATIBILITY.md ----------------------------------------------------------------------------


def documented_fields(heading: str) -> dict[str, str]:
    """{field: status} of the tables under `heading` (up to the next `## ` heading)."""
    fields, inside = {}, False
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            inside = line.strip() == heading
        row = re.match(r"\| `([a-z_]+)` \| ([a-z ]+) \|", line)
        if inside and row:
            assert row.group(1) not in fields, f"{row.group(1)} listed twice"
            fields[row.group(1)] = row.group(2)
    return fields


def test_every_responses_field_is_listed_and_declared():
    from openai.types.responses import response_create_params

    fields = documented_fields("## /v1/responses (OpenAI Responses API)")
    sdk = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    assert not sdk - set(fields), sorted(sdk - set(fields))
    declared = {info.alias or name for name, info in ResponseRequest.model_fields.items()}
    assert set(fields) == declared, set(fields) ^ declared


FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
# A value for each documented field (with the fields it needs), as in test_compatibility.py.
ACCEPTED = {
    "input": {}, "model": {"model": None}, "instructions": {"instructions": "Be brief."},
    "max_output_tokens": {"max_output_tokens": 2}, "max_tool_calls": {"tools": [FUNCTION], "max_tool_calls": 1},
    "temperature": {"temperature": 0.5}, "top_p": {"top_p": 0.9}, "tools": {"tools": [FUNCTION]},
    "tool_choice": {"tools": [FUNCTION], "tool_choice": "required"},
    "parallel_tool_calls": {"tools": [FUNCTION], "parallel_tool_calls": False},
    "text": {"text": {"format": {"type": "json_object"}}}, "store": {"store": False},
    "previous_response_id": {"previous_response_id": None}, "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_obfuscation": False}},
    "include": {"include": ["reasoning.encrypted_content"]}, "metadata": {"metadata": {"k": "v"}},
    "user": {"user": "u"}, "safety_identifier": {"safety_identifier": "s"},
    "prompt_cache_key": {"prompt_cache_key": "k"}, "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "prompt_cache_options": {"prompt_cache_options": {}},
    "client_metadata": {"client_metadata": {"thread_id": "t"}}, "cache_salt": {"cache_salt": "salt"},
    "session_id": {"session_id": "conv"}, "scr": {"scr": "off"},
    "frequency_penalty": {"frequency_penalty": 1.0}, "presence_penalty": {"presence_penalty": 0.5},
}
REFUSED = {"top_logprobs": 2, "conversation": "conv_1", "prompt": {"id": "p"},
           "background_options": {}, "context_management": [{}], "access_programs": {}, "image": {},
           "moderation": {}}
DEFAULT_ONLY = {"background": (False, True), "service_tier": ("auto", "flex"), "truncation": ("disabled", "auto"),
                "reasoning": ({"summary": "auto"}, {"effort": "high"})}


def test_each_responses_field_behaves_as_its_status_says(resp_server):
    base = {"input": "hi", "max_output_tokens": 2}
    stored = post(resp_server, base).json()["id"]
    for field, status in documented_fields("## /v1/responses (OpenAI Responses API)").items():
        if status in ("supported", "ignored"):
            body = {**base, **ACCEPTED[field]}
            body["model"] = body.get("model", "") or resp_server.state.model_name
            if field == "previous_response_id":
                body["previous_response_id"] = stored
            reply = post(resp_server, body)
            assert reply.status_code == 200, (field, reply.text)
        elif status == "refused":
            reply = post(resp_server, {**base, field: REFUSED[field]})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (field, reply.text)
        else:
            default, other = DEFAULT_ONLY[field]
            assert post(resp_server, {**base, field: default}).status_code == 200, field
            reply = post(resp_server, {**base, field: other})
            assert reply.status_code == 400 and reply.json()["error"]["param"].startswith(field), (field, reply.text)


def test_a_failure_mid_stream_ends_both_protocols_streams_with_their_error_event(tiny_model_dir):
    from kvsplice.config import EngineConfig
    from kvsplice.engine.failpoints import Failpoints
    from kvsplice.server.api import ServerSettings
    from kvsplice.server.launch import ServerThread, build_app
    from kvsplice.server.request_log import RequestLog
    from tests.server.conftest import LineSink

    failpoints = Failpoints()
    app = build_app(EngineConfig(model=str(tiny_model_dir), num_slots=2048), ServerSettings(model_path=str(tiny_model_dir)),
                    RequestLog(LineSink()), failpoints=failpoints)
    thread = ServerThread(app)
    thread.start()
    try:
        failpoints.fail("detokenize", after=3)
        with httpx.stream("POST", f"{thread.url}/v1/responses", timeout=60, json={
                "input": "weather?", "tools": TOOLS, "tool_choice": "required", "stream": True,
                "max_output_tokens": 200}) as reply:
            assert reply.status_code == 200
            kinds = [line.removeprefix("event: ") for line in reply.iter_lines() if line.startswith("event: ")]
        assert kinds[0] == "response.created" and kinds[-1] == "response.failed", kinds
        failpoints.fail("detokenize", after=3)
        with httpx.stream("POST", f"{thread.url}/v1/messages", timeout=60, json={
                "model": app.state.kvsplice.model_name, "max_tokens": 200, "stream": True,
                "messages": [{"role": "user", "content": "weather?"}],
                "tools": [{"name": "get_weather", "input_schema": WEATHER}], "tool_choice": {"type": "any"}}) as reply:
            assert reply.status_code == 200
            lines = list(reply.iter_lines())
        kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
        assert kinds[0] == "message_start" and kinds[-1] == "error", kinds
        error = json.loads(lines[-1].removeprefix("data: ") if lines[-1] else lines[-2].removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
    finally:
        failpoints.clear()
        thread.stop()


def test_reasoning_text_and_a_call_stream_as_three_items_in_order():
    from types import SimpleNamespace

    from kvsplice.server.chat_turn import CallArguments, CallStart, Finished, Usage
    from kvsplice.server.responses import ResponseEvents, ResponseHead, _message_of

    events = ResponseEvents(ResponseHead(SimpleNamespace(model_name="m", engine=SimpleNamespace(
        tokenizer=SimpleNamespace(sampling_defaults={}))), ResponseRequest(input="x"), "resp_1"))
    lines = (events.start() + events.text("let me think", "reasoning") + events.text("Hi", "message")
             + events.call_start(CallStart(0, "call_1", "f", '{"a"')) + events.call_arguments(CallArguments(0, ": 1}")))
    sent, body = events.finish(Finished("tool_calls", (), Usage(5, 3, 2, {})))
    kinds = [line.split("\n", 1)[0].removeprefix("event: ") for line in lines + sent]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == 2 and body["status"] == "completed"
    assert _message_of(body["output"]) == {
        "role": "assistant", "content": "Hi", "reasoning_content": "let me think",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}


def test_input_items_make_one_assistant_turn_per_run():
    from kvsplice.server.responses import input_messages

    body = ResponseRequest(input=[
        {"role": "user", "content": "q"}, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}])
    messages = input_messages(body.input)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    turn = messages[1]
    assert turn["content"] == "a" and turn["reasoning_content"] == "r"
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"] and messages[3]["content"] == "two"
