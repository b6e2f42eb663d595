"""Tool schemas with a bound above the grammar limit (MAX_SCHEMA_REPEAT) on the OpenAI routes, over HTTP on the
tiny model: accepted while the schema only describes the tool, dropped from a forced call's grammar where the
reply cannot reach it, refused (400 naming the field) where it could or where the schema is not a tool's."""

from __future__ import annotations

import httpx

BIG = 524_288
CONTENT = {"type": "object", "properties": {"content": {"type": "string", "maxLength": BIG}}, "required": ["content"]}
TOOL = {"type": "function", "function": {"name": "write", "description": "Write a file", "parameters": CONTENT}}
ASK = [{"role": "user", "content": "Write hello."}]


def chat(server, **fields) -> httpx.Response:
    body = {"model": server.state.model_name, "messages": ASK, "max_tokens": 4, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_chat_tools_with_a_large_bound_are_accepted_and_forced_when_unreachable(server):
    assert chat(server, tools=[TOOL]).status_code == 200
    forced = chat(server, tools=[TOOL], tool_choice="required", max_tokens=8)
    assert forced.status_code == 200, forced.text


def test_chat_forced_call_that_could_reach_the_bound_is_refused_naming_tools(server):
    near = {"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"content": {"type": "string", "maxLength": 10_001}}}}}
    budget = 10_001 // server.state.longest_token_chars + 1
    reply = chat(server, tools=[near], tool_choice={"type": "function", "function": {"name": "write"}},
                 max_tokens=budget)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tools" and "maxLength 10001" in reply.text


def test_a_large_bound_in_response_format_stays_refused(server):
    reply = chat(server, response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": CONTENT}})
    assert reply.status_code == 400 and f"maxLength {BIG} is above" in reply.text, reply.text


def test_responses_function_tools_with_a_large_bound_are_accepted(server):
    body = {"model": server.state.model_name, "input": "Write hello.", "max_output_tokens": 8,
            "tools": [{"type": "function", **TOOL["function"]}]}
    assert httpx.post(f"{server.url}/v1/responses", json=body, timeout=60).status_code == 200
    forced = httpx.post(f"{server.url}/v1/responses", json={**body, "tool_choice": "required"}, timeout=60)
    assert forced.status_code == 200, forced.text


def test_a_large_lower_bound_in_a_tool_is_refused(server):
    hostile = {"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"content": {"type": "string", "minLength": 10**9}}}}}
    reply = chat(server, tools=[hostile])
    assert reply.status_code == 400 and "minLength 1000000000 is above" in reply.text, reply.text
