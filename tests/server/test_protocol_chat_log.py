"""Unit tests of the request models, chat message shaping, reasoning split and log lines (metrics: test_metrics.py)."""

from __future__ import annotations

import io
import json

import pytest
from pydantic import ValidationError

from kvsplice.config import EngineConfig
from kvsplice.server.chat import ReasoningStream, message_dicts, split_reasoning
from kvsplice.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from kvsplice.server.request_log import RequestLog, flatten_reuse, request_record, session_hash, start_record


def test_chat_request_max_completion_tokens_wins():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=7)
    assert body.max_tokens == 7


@pytest.mark.parametrize("fields", [
    {"messages": []}, {"messages": [{"role": "user", "content": "x"}], "n": 17},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5.5},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
])
def test_chat_request_rejects(fields):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(**fields)


def test_chat_request_accepts_harmless_fields_and_refuses_unknown_ones():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], user="someone", metadata={"a": "1"})
    assert body.n == 1
    with pytest.raises(ValidationError, match="unknown_thing"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], unknown_thing=1)


def test_completion_prompt_forms():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=["a"]).prompts() == ["a"]
    assert CompletionRequest(prompt=[[3, 4]]).prompts() == [[3, 4]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    with pytest.raises(ValueError, match="must not be empty"):
        CompletionRequest(prompt=[])


def test_generate_request_needs_exactly_one_input():
    with pytest.raises(ValidationError):
        GenerateRequest(text="a", input_ids=[1])
    assert GenerateRequest(input_ids=[1], sampling_params={"max_new_tokens": 4}).sampling_params.max_new_tokens == 4


def test_message_dicts_parse_tool_arguments_and_join_text_parts():
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "reasoning": "thought", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r", "custom_field": 5},
    ])
    user, assistant, tool = message_dicts(body.messages)
    assert user["content"] == "ab"
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert assistant["reasoning_content"] == "thought" and assistant["content"] is None
    assert tool["tool_call_id"] == "c1" and tool["custom_field"] == 5


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>plan</think>answer", "plan", "answer"),
    ("plan</think>\nanswer", "plan", "answer"),
    ("<think>still thinking", "still thinking", ""),
    ("just an answer", None, "just an answer"),
])
def test_split_reasoning(text, reasoning, content):
    split = split_reasoning(text)
    assert (split.reasoning_content, split.content) == (reasoning, content)


def test_reasoning_stream_matches_split_for_any_chunking():
    text = "<think>a plan with <b> tags</think>the answer"
    for size in (1, 2, 3, 7, len(text)):
        stream = ReasoningStream()
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        got = [stream.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        assert "".join(r for r, _ in got) == "a plan with <b> tags"
        assert "".join(c for _, c in got) == "the answer"


def test_request_record_flattens_and_hashes():
    reuse = {"prefix_tokens": 3, "relocated_tokens": 0, "prefilled_tokens": 2, "relocated_spans": 0,
             "session": "new", "fallback": None, "prefilled_breakdown": {"changed": 2, "span_tails": 0}}
    record = request_record("r1", 5, 1, reuse, 0.1234567, 0.5, "stop", "conv", "rep", "chat")
    assert record["changed"] == 2 and "prefilled_breakdown" not in record
    assert record["session_id"] == session_hash("conv") != "conv" and session_hash(None) is None
    assert record["replica"] == "rep" and record["ttft_s"] == 0.123457
    assert flatten_reuse({"a": 1, "n": {"a": 2, "b": 3}}) == {"a": 1, "b": 3}


def test_request_log_lines_parse_back():
    sink = io.StringIO()
    log = RequestLog(sink)
    log.start(start_record("m", "/p", EngineConfig(), 4096, None))
    log.request(request_record("r1", 5, 1, None, None, 0.5, "length", None, None, "completions"))
    start, request = sink.getvalue().splitlines()
    start_obj = json.loads(start.removeprefix("kvsplice.start "))
    assert start_obj["reuse"]["max_spans"] == EngineConfig().reuse.max_spans
    assert start_obj["engine"]["num_slots"] == EngineConfig().num_slots
    assert json.loads(request.removeprefix("kvsplice.request "))["finish_reason"] == "length"

