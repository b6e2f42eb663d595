"""Assistant prefill over HTTP: `continue_final_message` continues the final assistant message (no new
turn, no end-of-turn after it), `add_generation_prompt` opens the assistant's turn (default) or not; both
true, or continuing a message that is not the assistant's, is a 400 naming continue_final_message.
Through every template path: the model's template, tools given as a system section, a template that
renders tools itself, a template that hides the content."""

from __future__ import annotations

import json

import httpx
import pytest

from kvsplice.server.protocol import ChatMessage
from tests.server.conftest import assert_idle_without_leak, start_server

PREFILL = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(',') }}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDING_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message['role'] }}<|im_end|>{% endfor %}"


def chat(server, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions",
                      json={"messages": PREFILL, "max_tokens": 3, "temperature": 0, **fields}, timeout=60)


def render(server, tools=None, **fields) -> str:
    return server.state.chat.render([ChatMessage(**m) for m in PREFILL], tools, **fields)


def prompt_tokens(server, text: str) -> int:
    return len(server.state.engine.tokenizer.encode(text, add_special_tokens=False))


def test_continue_final_message_leaves_the_assistant_turn_open(server):
    response = chat(server, continue_final_message=True, add_generation_prompt=False)
    assert response.status_code == 200, response.text
    expected = "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\nOnce upon"
    assert render(server, add_generation_prompt=False, continue_final_message=True) == expected
    assert response.json()["usage"]["prompt_tokens"] == prompt_tokens(server, expected)
    assert response.json()["choices"][0]["message"]["role"] == "assistant"
    assert_idle_without_leak(server)


def test_add_generation_prompt_false_renders_the_messages_closed(server):
    response = chat(server, add_generation_prompt=False)
    assert response.status_code == 200, response.text
    closed = "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\nOnce upon<|im_end|>\n"
    assert response.json()["usage"]["prompt_tokens"] == prompt_tokens(server, closed)
    opened = chat(server).json()["usage"]["prompt_tokens"]
    assert opened == prompt_tokens(server, closed + "<|im_start|>assistant\n")


def test_an_empty_final_message_continues_where_its_turn_opens(server):
    messages = [PREFILL[0], {"role": "assistant", "content": ""}]
    response = chat(server, messages=messages, continue_final_message=True, add_generation_prompt=False)
    assert response.status_code == 200, response.text
    opened = "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\n"
    assert response.json()["usage"]["prompt_tokens"] == prompt_tokens(server, opened)


def test_continue_final_message_streams(server):
    body = {"messages": PREFILL, "max_tokens": 3, "temperature": 0, "stream": True,
            "continue_final_message": True, "add_generation_prompt": False}
    text = ""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    plain = chat(server, continue_final_message=True, add_generation_prompt=False).json()
    assert text == plain["choices"][0]["message"]["content"]


def test_tools_offered_in_a_system_section_keep_the_final_message_open(server):
    response = chat(server, tools=[TOOL], continue_final_message=True, add_generation_prompt=False)
    assert response.status_code == 200, response.text
    text = render(server, [TOOL], add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nOnce upon") and "lookup" in text


@pytest.mark.parametrize("fields, needle", [
    ({"continue_final_message": True}, "add_generation_prompt"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ({"continue_final_message": True, "add_generation_prompt": False,
      "messages": [{"role": "user", "content": "hi"}]}, "assistant"),
])
def test_bad_combinations_are_400s_naming_continue_final_message(server, fields, needle):
    response = chat(server, **fields)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "continue_final_message" and needle in error["message"], error


@pytest.mark.parametrize("field, value", [("continue_final_message", "yes"), ("add_generation_prompt", 1)])
def test_wrong_types_are_400s_naming_the_field(server, field, value):
    response = chat(server, **{field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_completions_refuse_continue_final_message(server):
    response = httpx.post(f"{server.url}/v1/completions",
                          json={"prompt": "hi", "max_tokens": 1, "continue_final_message": True}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"


@pytest.fixture(scope="module")
def tools_server(tiny_model_dir):
    running = start_server(tiny_model_dir, {"chat_template": TOOLS_TEMPLATE}, num_slots=512)
    yield running
    running.thread.stop()


def test_a_template_that_renders_tools_keeps_the_final_message_open(tools_server):
    response = chat(tools_server, tools=[TOOL], continue_final_message=True, add_generation_prompt=False)
    assert response.status_code == 200, response.text
    text = render(tools_server, [TOOL], add_generation_prompt=False, continue_final_message=True)
    assert text.startswith("<|im_start|>system\nTools: lookup") and text.endswith("assistant\nOnce upon")
    assert response.json()["usage"]["prompt_tokens"] == prompt_tokens(tools_server, text)


@pytest.fixture(scope="module")
def hiding_server(tiny_model_dir):
    running = start_server(tiny_model_dir, {"chat_template": HIDING_TEMPLATE}, num_slots=512)
    yield running
    running.thread.stop()


def test_a_template_that_hides_the_final_message_is_a_400(hiding_server):
    response = chat(hiding_server, continue_final_message=True, add_generation_prompt=False)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "continue_final_message"


def test_a_final_message_of_tool_calls_is_continued_after_the_calls(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [PREFILL[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    response = chat(server, messages=messages, tools=[TOOL], continue_final_message=True,
                    add_generation_prompt=False)
    assert response.status_code == 200, response.text
    text = server.state.chat.render([ChatMessage(**m) for m in messages], [TOOL], add_generation_prompt=False,
                                    continue_final_message=True)
    assert "lookup" in text.rsplit("<|im_start|>assistant\n", 1)[1] and not text.endswith("<|im_end|>\n")
    assert response.json()["usage"]["prompt_tokens"] == prompt_tokens(server, text)
