"""Llama 3.1 / 3.2 JSON tool calls (vLLM's `llama3_json`): the whole reply is one or more call
objects, separated by `;`, optionally after the `<|python_tag|>` token:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ..., "parameters": ...}

A reply that does not start with `{` (after whitespace and the tag) is plain content.
"""

from __future__ import annotations

import json
from typing import Any

from kvsplice.server.tool_parsers.base import PartialReply, ToolParser, arguments_object
from kvsplice.server.tool_parsers.json_scan import MalformedJSON, scan_call, skip_whitespace
from kvsplice.structured.spec import ToolCallSyntax

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def parse_partial(self, text: str, final: bool = False) -> PartialReply:
        start = skip_whitespace(text, 0)
        rest = text[start:]
        if rest.startswith(PYTHON_TAG):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(rest) and rest and not final:
            return PartialReply("")            # may still become the tag
        if start >= len(text):
            return PartialReply(text if final else "")
        if text[start] != "{":
            return PartialReply(text)
        calls = []
        while True:
            call = scan_call(text, start)
            calls.append(call)
            if call.end is None:
                break
            start = skip_whitespace(text, call.end)
            if start >= len(text):
                break
            if text[start] != SEPARATOR:
                raise MalformedJSON(f"expected {SEPARATOR!r} between calls at offset {start}")
            start = skip_whitespace(text, start + 1)
            if start >= len(text):
                break
        return PartialReply("", tuple(calls))

    def syntax(self, vocab: dict[str, int] | None = None) -> ToolCallSyntax:
        return ToolCallSyntax(call_prefix='{"name": "', name_suffix='", "parameters": ', call_suffix="}",
                              separator=SEPARATOR + " ")

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return (SEPARATOR + " ").join(json.dumps({"name": call["function"]["name"], "parameters": arguments_object(call)},
                                                 ensure_ascii=False) for call in calls)

    def call_example(self) -> str:
        return ('respond with a JSON object in the format {"name": function name, "parameters": dictionary of '
                "argument name and its value}. Do not use variables.")
