"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the real `anthropic` client on the
tiny random model: plain and streamed messages, a forced tool loop (tool_use -> tool_result -> answer), stop
reasons, usage with the cache fields, `x-api-key` tenancy, and every error in Anthropic's shape."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import httpx
import jsonschema
import pytest

from kvsplice.server.anthropic_protocol import MessagesRequest
from kvsplice.server.auth import ApiKeys
from tests.server.conftest import assert_idle_without_leak, start_server
from tests.server.test_tool_parsers import WEATHER

anthropic = pytest.importorskip("anthropic")

DOC = Path(__file__).resolve().parents[2] / "docs" / "COMPATIBILITY.md"
KEY = "sk-ant-kvsplice-0123456789"
TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def ant_server(tiny_model_dir):
    running = start_server(tiny_model_dir, settings_kwargs={"api_keys": ApiKeys((KEY,))}, num_slots=4096,
                           max_batch_tokens=512)
    yield running
    running.thread.stop()


@pytest.fixture(scope="module")
def aclient(ant_server):
    return anthropic.Anthropic(base_url=ant_server.url, api_key=KEY, max_retries=0, timeout=60)


def model(server) -> str:
    return server.state.model_name


def post(server, body: dict, path: str = "/v1/messages", headers: dict | None = None) -> httpx.Response:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"} if headers is None else headers
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def check_usage(usage) -> dict:
    reuse = usage.model_extra["reuse"]
    prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert prompt == reuse["prefix_tokens"] + reuse["relocated_tokens"] + reuse["prefilled_tokens"]
    assert usage.cache_read_input_tokens == reuse["prefix_tokens"] + reuse["relocated_tokens"]
    return reuse


def test_plain_message(ant_server, aclient):
    message = aclient.messages.create(model=model(ant_server), max_tokens=6, system="Be brief.",
                                      messages=[{"role": "user", "content": "Say hello."}],
                                      extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9},
                                      metadata={"user_id": "u1"})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens <= 6
    check_usage(message.usage)
    # the same prompt again is served from the cache
    again = aclient.messages.create(model=model(ant_server), max_tokens=2, system="Be brief.",
                                    messages=[{"role": "user", "content": "Say hello."}])
    assert again.usage.cache_read_input_tokens > 0


def test_system_blocks_and_cache_control_are_accepted(ant_server, aclient):
    message = aclient.messages.create(
        model=model(ant_server), max_tokens=2,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}])
    assert message.usage.output_tokens <= 2


def test_stop_sequence_is_reported(ant_server, aclient):
    free = aclient.messages.create(model=model(ant_server), max_tokens=16, messages=[QUESTION],
                                   extra_body={"temperature": 0})
    text = "".join(block.text for block in free.content if block.type == "text")
    if len(text) < 4:
        pytest.skip("the random model stopped at once")
    stop = text[2:4]
    stopped = aclient.messages.create(model=model(ant_server), max_tokens=16, messages=[QUESTION],
                                      stop_sequences=[stop], extra_body={"temperature": 0})
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop


def test_forced_tool_loop(ant_server, aclient):
    first = aclient.messages.create(model=model(ant_server), max_tokens=200, messages=[QUESTION], tools=TOOLS,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    uses = [block for block in first.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER)
    loop = [QUESTION, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 C"},
                                         {"type": "text", "text": "Answer now."}]}]
    answer = aclient.messages.create(model=model(ant_server), max_tokens=8, messages=loop, tools=TOOLS,
                                     tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert not [block for block in answer.content if block.type == "tool_use"]
    failed = loop[:2] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                       "content": [{"type": "text", "text": "timeout"}],
                                                       "is_error": True}]}]
    retry = aclient.messages.create(model=model(ant_server), max_tokens=200, messages=failed, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"})
    assert [block.name for block in retry.content if block.type == "tool_use"] == ["get_weather"]


def test_streamed_tool_loop(ant_server, aclient):
    with aclient.messages.stream(model=model(ant_server), max_tokens=200, messages=[QUESTION], tools=TOOLS,
                                 tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        first = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and first.stop_reason == "tool_use"
    uses = [block for block in first.content if block.type == "tool_use"]
    assert len(uses) == 1
    jsonschema.validate(uses[0].input, WEATHER)
    partial = "".join(event.delta.partial_json for event in events
                      if event.type == "content_block_delta" and event.delta.type == "input_json_delta")
    assert json.loads(partial) == uses[0].input
    loop = [QUESTION, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 C"}]}]
    with aclient.messages.stream(model=model(ant_server), max_tokens=8, messages=loop, tools=TOOLS,
                                 tool_choice={"type": "auto"}) as stream:
        text = "".join(stream.text_stream)
        answer = stream.get_final_message()
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert text == "".join(block.text for block in answer.content if block.type == "text")
    check_usage(answer.usage)
    assert answer.usage.cache_read_input_tokens > 0


def test_raw_stream_event_sequence(ant_server):
    with httpx.stream("POST", f"{ant_server.url}/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                      json={"model": model(ant_server), "max_tokens": 6, "stream": True,
                            "messages": [{"role": "user", "content": "Tell me a story."}]}) as reply:
        kinds = [line.removeprefix("event: ") for line in reply.iter_lines() if line.startswith("event: ")]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = kinds[2:-2]
    assert blocks == [] or (blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
                            and set(blocks[1:-1]) == {"content_block_delta"})


def test_count_tokens_matches_the_prompt(ant_server, aclient):
    body = {"model": model(ant_server), "messages": [QUESTION], "tools": TOOLS, "system": "Be brief."}
    counted = aclient.messages.count_tokens(**body)
    message = aclient.messages.create(max_tokens=1, **body)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_bearer_and_x_api_key_are_one_tenant(ant_server):
    body = {"model": model(ant_server), "max_tokens": 1, "messages": [{"role": "user", "content": "tenant check"}]}
    assert post(ant_server, body).status_code == 200
    bearer = post(ant_server, body, headers={"Authorization": f"Bearer {KEY}"}).json()
    assert bearer["usage"]["cache_read_input_tokens"] > 0


@pytest.mark.parametrize("body, status, kind, param", [
    ({"max_tokens": 4, "messages": [QUESTION], "frobnicate": 1}, 400, "invalid_request_error", "frobnicate"),
    ({"messages": [QUESTION]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": "4", "messages": [QUESTION]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "messages"),
    ({"max_tokens": 4, "messages": [QUESTION], "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"max_tokens": 4, "messages": [QUESTION], "tool_choice": {"type": "any"}}, 400, "invalid_request_error",
     "tool_choice"),
    ({"max_tokens": 4, "messages": [QUESTION], "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "invalid_request_error", "thinking"),
    ({"max_tokens": 4, "messages": [QUESTION], "tools": [{"name": "x", "type": "bash_20250124"}]}, 400,
     "invalid_request_error", "tools"),
    ({"max_tokens": 10 ** 6, "messages": [QUESTION]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [QUESTION], "model": "nope"}, 404, "not_found_error", "model"),
    ({"max_tokens": 4, "messages": [QUESTION, {"role": "assistant", "content": "The"}]}, 400,
     "invalid_request_error", "messages.1"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}, QUESTION]}, 400, "invalid_request_error",
     "messages"),
])
def test_bad_input_is_an_anthropic_error_naming_the_field(ant_server, body, status, kind, param):
    reply = post(ant_server, {"model": model(ant_server), **body})
    assert reply.status_code == status, reply.text
    answer = reply.json()
    assert answer["type"] == "error" and answer["error"]["type"] == kind and answer["error"]["message"]
    assert (answer["error"]["param"] or "").startswith(param), answer


def test_sdk_raises_its_own_errors(ant_server, aclient):
    with pytest.raises(anthropic.BadRequestError) as caught:
        aclient.messages.create(model=model(ant_server), max_tokens=4, messages=[QUESTION],
                                extra_body={"frobnicate": 1})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=ant_server.url, api_key="wrong", max_retries=0).messages.create(
            model=model(ant_server), max_tokens=4, messages=[QUESTION])
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_malformed_json_and_count_tokens_errors_are_anthropic_shaped(ant_server):
    reply = httpx.post(f"{ant_server.url}/v1/messages", content=b"{nope", timeout=10,
                       headers={"x-api-key": KEY, "content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["type"] == "error"
    reply = post(ant_server, {"messages": [QUESTION]}, path="/v1/messages/count_tokens")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"


def test_server_idle_without_leak(ant_server):
    assert_idle_without_leak(ant_server)


def test_every_messages_field_is_listed_and_declared():
    from anthropic.types import message_create_params

    from tests.server.test_responses_api import documented_fields

    fields = documented_fields("## /v1/messages (Anthropic Messages API)")
    sdk = set(typing.get_type_hints(message_create_params.MessageCreateParamsBase)) | {
        "stream", "temperature", "top_p", "top_k"}
    assert not sdk - set(fields), sorted(sdk - set(fields))
    declared = {info.alias or name for name, info in MessagesRequest.model_fields.items()}
    assert set(fields) == declared, set(fields) ^ declared
    assert re.search(r"`cache_control` \| ignored", DOC.read_text())


TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}
ACCEPTED = {
    "model": {}, "max_tokens": {}, "messages": {}, "system": {"system": "Be brief."}, "tools": {"tools": [TOOL]},
    "tool_choice": {"tools": [TOOL], "tool_choice": {"type": "auto"}}, "stop_sequences": {"stop_sequences": ["zz"]},
    "stream": {"stream": True}, "temperature": {"temperature": 0.5}, "top_p": {"top_p": 0.9}, "top_k": {"top_k": 5},
    "output_config": {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
    "metadata": {"metadata": {"user_id": "u"}}, "cache_control": {"cache_control": {"type": "ephemeral"}},
    "cache_salt": {"cache_salt": "salt"}, "session_id": {"session_id": "conv"}, "scr": {"scr": "off"},
}
REFUSED = {"container": "c", "diagnostics": {"previous_message_id": "m"}, "inference_geo": "us",
           "user_profile_id": "u", "workspace_id": "w"}
DEFAULT_ONLY = {"service_tier": ("auto", "priority"), "speed": ("standard", "fast"),
                "thinking": ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}),
                "context_management": ({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                                       {"edits": [{"type": "clear_tool_uses_20250919"}]})}


def test_each_messages_field_behaves_as_its_status_says(ant_server):
    from tests.server.test_responses_api import documented_fields

    base = {"model": model(ant_server), "max_tokens": 2, "messages": [QUESTION]}
    for field, status in documented_fields("## /v1/messages (Anthropic Messages API)").items():
        if status in ("supported", "ignored"):
            reply = post(ant_server, {**base, **ACCEPTED[field]})
            assert reply.status_code == 200, (field, reply.text)
        elif status == "refused":
            reply = post(ant_server, {**base, field: REFUSED[field]})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (field, reply.text)
        else:
            default, other = DEFAULT_ONLY[field]
            assert post(ant_server, {**base, field: default}).status_code == 200, field
            reply = post(ant_server, {**base, field: other})
            assert reply.status_code == 400 and reply.json()["error"]["param"].startswith(field), (field, reply.text)


def test_thinking_text_and_tool_use_stream_as_three_blocks():
    from kvsplice.server.anthropic import MessageEvents
    from kvsplice.server.chat_turn import CallArguments, CallStart

    blocks = MessageEvents()
    lines = (blocks.text("hmm", "thinking") + blocks.text("Hi", "text") + blocks.call_start(CallStart(0, "c", "f", "{"))
             + blocks.call_arguments(CallArguments(0, "}")) + blocks.close())
    events = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "text_delta", "input_json_delta", "input_json_delta"]


def test_blocks_become_chat_messages_in_order():
    from kvsplice.server.anthropic import chat_messages

    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "system": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                          {"type": "text", "text": "x"},
                                          {"type": "tool_use", "id": "u1", "name": "f", "input": {"k": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u1", "content": "bad", "is_error": True},
                                     {"type": "text", "text": "go on"}]}]})
    messages = chat_messages(body)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[0]["content"] == "a\n\nb" and messages[2]["reasoning_content"] == "t"
    assert messages[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"k": 1}'}
    assert messages[3] == {"role": "tool", "tool_call_id": "u1", "content": "Error: bad"}


def test_claude_codes_own_fields_are_accepted_and_the_others_refused(ant_server):
    """What Claude Code sends by default: adaptive thinking, effort "high" (Anthropic's default), a context
    edit that clears nothing, and the beta query; a thinking budget, another effort or a clearing edit
    stays a 400 naming its field."""
    base = {"model": model(ant_server), "max_tokens": 2, "messages": [QUESTION]}
    claude_code = {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
                   "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    assert post(ant_server, {**base, **claude_code}, path="/v1/messages?beta=true").status_code == 200
    counted = post(ant_server, {key: value for key, value in {**base, **claude_code}.items() if key != "max_tokens"},
                   path="/v1/messages/count_tokens?beta=true")
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    for field, value in [("output_config", {"effort": "low"}),
                         ("context_management", {"edits": [{"type": "clear_thinking_20251015",
                                                             "keep": {"type": "thinking_turns", "value": 1}}]})]:
        reply = post(ant_server, {**base, field: value})
        assert reply.status_code == 400 and reply.json()["error"]["param"].startswith(field), (field, reply.text)


# ----- what Claude Code 2.1 sends: system-role messages mid-conversation, tool schemas with huge bounds -----

WRITE_SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string", "maxLength": 12},
                                                 "content": {"type": "string", "maxLength": 524_288}},
                "required": ["file_path"], "additionalProperties": False}
WRITE_TOOL = {"name": "Write", "description": "Write a file", "input_schema": WRITE_SCHEMA}


def test_a_system_message_mid_conversation_is_accepted_and_reaches_the_prompt(ant_server):
    """Claude Code sends a system-role message between turns; the tiny model's ChatML template renders it as a
    system turn where it stands (a template that cannot is folded into the next user turn: test_chat_render)."""
    reminder = {"role": "system", "content": [{"type": "text", "text": "Reminder: be brief."}]}
    chat = [QUESTION, {"role": "assistant", "content": "Let me check."}, reminder,
            {"role": "user", "content": "Go on."}]
    reply = post(ant_server, {"model": model(ant_server), "max_tokens": 2, "messages": chat})
    assert reply.status_code == 200, reply.text
    without = [m for m in chat if m is not reminder]
    counted = [post(ant_server, {"model": model(ant_server), "messages": m}, path="/v1/messages/count_tokens")
               for m in (chat, without)]
    assert counted[0].json()["input_tokens"] > counted[1].json()["input_tokens"]
    prompt = ant_server.state.chat.render(*_chat_of(chat))
    assert "<|im_start|>system\nReminder: be brief.<|im_end|>\n<|im_start|>user\nGo on." in prompt


def _chat_of(messages: list[dict]):
    from kvsplice.server.anthropic import chat_messages
    from kvsplice.server.protocol import ChatMessage

    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": messages})
    return ([ChatMessage(**m) for m in chat_messages(body)],)


def test_a_system_message_with_other_blocks_is_refused_naming_it(ant_server):
    chat = [QUESTION, {"role": "system", "content": [{"type": "tool_use", "id": "u", "name": "f", "input": {}}]},
            {"role": "user", "content": "Go on."}]
    reply = post(ant_server, {"model": model(ant_server), "max_tokens": 2, "messages": chat})
    assert reply.status_code == 400 and reply.json()["error"]["param"].startswith("messages.1"), reply.text
    assert "text blocks only" in reply.text


def test_a_tool_schema_bound_above_the_limit_is_accepted_while_it_only_describes_the_tool(ant_server):
    body = {"model": model(ant_server), "max_tokens": 4, "messages": [QUESTION], "tools": [*TOOLS, WRITE_TOOL]}
    assert post(ant_server, body).status_code == 200
    assert post(ant_server, {k: v for k, v in body.items() if k != "max_tokens"},
                path="/v1/messages/count_tokens").status_code == 200


def test_a_forced_call_drops_an_unreachable_bound_and_refuses_a_reachable_one(ant_server):
    """max_tokens 16: the reply cannot reach 524,288 characters, so the bound is dropped from the grammar; a
    bound just above the grammar limit that the budget could reach is a 400 naming tools."""
    forced = {"model": model(ant_server), "max_tokens": 16, "messages": [QUESTION], "tools": [WRITE_TOOL],
              "tool_choice": {"type": "tool", "name": "Write"}}
    reply = post(ant_server, forced)
    assert reply.status_code == 200, reply.text
    assert reply.json()["stop_reason"] in ("tool_use", "max_tokens")
    reachable = {**WRITE_TOOL, "input_schema": {**WRITE_SCHEMA, "properties": {
        "content": {"type": "string", "maxLength": 10_001}}}}
    budget = 10_001 // ant_server.state.longest_token_chars + 1
    refused = post(ant_server, {**forced, "tools": [reachable], "max_tokens": budget})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "tools" and "maxLength 10001" in error["message"], error
    small = post(ant_server, {**forced, "tools": [reachable], "max_tokens": 4})
    assert small.status_code == 200, small.text


def test_a_large_bound_outside_tools_stays_refused(ant_server):
    body = {"model": model(ant_server), "max_tokens": 4, "messages": [QUESTION],
            "output_config": {"format": {"type": "json_schema", "schema": WRITE_SCHEMA}}}
    reply = post(ant_server, body)
    assert reply.status_code == 400 and "maxLength 524288 is above" in reply.text, reply.text
