"""A real agent loop against `kvsplice serve` (a ServerThread) through the `openai` client and through
LangChain (langchain-openai): the model is offered tools, returns tool_calls, receives the tool
results, edits its context between turns (drops an old tool result) and finishes with a text answer;
the edited turn reports relocated tokens.

The tiny random model cannot choose tools by itself, so the loop is scripted with tool_choice
(named, then required), which grammar-constrained decoding turns into valid calls whatever the
weights; the last turn answers freely (tool_choice "none"). Prompts are long enough for SCR's
default spans (min_span 64, tail 16).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.conftest import start_server

READ_FILE = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}}, "required": ["path"],
             "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 24},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["query", "limit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": READ_FILE}},
         {"type": "function", "function": {"name": "search", "description": "Search the docs", "parameters": SEARCH}}]
SCHEMAS = {"read_file": READ_FILE, "search": SEARCH}

SYSTEM = ("You are a careful research agent. Agents edit their own context: they delete tool results and "
          "rewrite notes in place. Tool results are long; notes are short. ") * 6
TASK = "Task: read the documentation and summarise it. The quick brown fox jumps over the lazy dog. " * 3


def run_tool(name: str, arguments: str) -> str:
    """The tools, scripted: long results (what makes an agent's context grow)."""
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    if name == "read_file":
        return ("def main():\n    print('hello world')\n\nThe function returns None when nothing is found. " * 12)
    return ("Once upon a time there was a little robot who liked to read documentation. " * 10)


@pytest.fixture(scope="module")
def agent_server(tiny_model_dir):
    running = start_server(tiny_model_dir, num_slots=16384, max_batch_tokens=1024)
    yield running
    running.thread.stop()


def relocated(usage: dict) -> int:
    reuse = usage["reuse"]
    assert usage["prompt_tokens"] == reuse["prefix_tokens"] + reuse["relocated_tokens"] + reuse["prefilled_tokens"]
    return reuse["relocated_tokens"]


def test_agent_loop_through_the_openai_client(agent_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{agent_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    extra = {"session_id": "openai-agent"}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    turns = []
    for choice in ({"type": "function", "function": {"name": "read_file"}}, "required"):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                               parallel_tool_calls=False, max_tokens=120, extra_body=extra)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls
        turns.append(reply.usage.model_dump())
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [call.model_dump() for call in message.tool_calls]})
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    # the agent edits its context: the first tool result is dropped (its call stays, answered briefly)
    first_result = next(i for i, m in enumerate(messages) if m["role"] == "tool")
    messages[first_result] = {**messages[first_result], "content": "(read earlier; dropped from context)"}
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=12, extra_body={**extra, "ignore_eos": True})
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    usage = final.usage.model_dump()
    assert relocated(usage) > 0, usage["reuse"]
    assert usage["reuse"]["session"] == "matched" and usage["reuse"]["fallback"] is None
    assert relocated(turns[1]) == 0       # an appended turn is served by the prefix cache alone


def test_agent_loop_through_langchain(agent_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    llm = langchain_openai.ChatOpenAI(base_url=f"{agent_server.url}/v1", api_key="unused",
                                      model=agent_server.state.engine.name, max_tokens=120, temperature=0.7,
                                      max_retries=0, timeout=120, extra_body={"session_id": "langchain-agent"})
    history = [SystemMessage(SYSTEM), HumanMessage(TASK)]
    for tool_name in ("read_file", "search"):
        ai = llm.bind_tools(TOOLS, tool_choice=tool_name, parallel_tool_calls=False).invoke(history)
        assert ai.tool_calls and ai.tool_calls[0]["name"] == tool_name
        jsonschema.validate(ai.tool_calls[0]["args"], SCHEMAS[tool_name])
        history.append(ai)
        for call in ai.tool_calls:
            history.append(ToolMessage(run_tool(call["name"], json.dumps(call["args"])), tool_call_id=call["id"]))
    # edit: drop the first tool result's text
    index = next(i for i, m in enumerate(history) if isinstance(m, ToolMessage))
    history[index] = ToolMessage("(dropped)", tool_call_id=history[index].tool_call_id)
    answer = llm.bind(extra_body={"session_id": "langchain-agent", "ignore_eos": True}, max_tokens=12).invoke(history)
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
    usage = answer.response_metadata["token_usage"]
    assert relocated(usage) > 0, usage
