"""Hermes / Qwen 2.5 / Qwen 3 tool calls (vLLM's `hermes`), also what kvsplice offers models whose
chat template has no tool support (SmolLM2):

    optional text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {...}
    </tool_call>

Content is the text before the first `<tool_call>`; text after the last call is dropped (vLLM).
"""

from __future__ import annotations

import json
from typing import Any

from kvsplice.server.tool_parsers.base import PartialReply, ToolParser, arguments_object, partial_suffix
from kvsplice.server.tool_parsers.json_scan import scan_call, skip_whitespace
from kvsplice.structured.spec import ToolCallSyntax

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (START,)

    def parse_partial(self, text: str, final: bool = False) -> PartialReply:
        first = text.find(START)
        if first < 0:
            held = 0 if final else partial_suffix(text, START)
            return PartialReply(text[:len(text) - held])
        calls, start = [], first
        while start >= 0:
            call = scan_call(text, skip_whitespace(text, start + len(START)))
            calls.append(call)
            if call.end is None:
                break
            start = text.find(START, call.end)
        return PartialReply(text[:first], tuple(calls))

    def syntax(self, vocab: dict[str, int] | None = None) -> ToolCallSyntax:
        return ToolCallSyntax(call_prefix=START + '\n{"name": "', name_suffix='", "arguments": ',
                              call_suffix="}\n" + END, separator="\n")

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{START}\n" + json.dumps({"name": call["function"]["name"], "arguments": arguments_object(call)},
                                                   ensure_ascii=False) + f"\n{END}" for call in calls)

    def call_example(self) -> str:
        return ("return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
