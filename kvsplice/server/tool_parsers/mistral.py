"""Mistral tool calls (vLLM's `mistral`, the v0.3 format): after the `[TOOL_CALLS]` token, a JSON
array of call objects (an object without the array is accepted too):

    optional text[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

`[TOOL_CALLS]` is a special token in Mistral tokenizers, so replies are decoded with special tokens
kept while tools are offered. Mistral's chat templates want call ids of exactly 9 letters and digits:
new ids are made so, and other ids are mapped to 9 characters when the history is rendered.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from typing import Any

from kvsplice.server.tool_parsers.base import PartialReply, ToolParser, arguments_object, partial_suffix
from kvsplice.server.tool_parsers.json_scan import MalformedJSON, scan_call, skip_whitespace
from kvsplice.structured.spec import ToolCallSyntax

TOOL_CALLS = "[TOOL_CALLS]"
ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 9


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)

    def parse_partial(self, text: str, final: bool = False) -> PartialReply:
        first = text.find(TOOL_CALLS)
        if first < 0:
            held = 0 if final else partial_suffix(text, TOOL_CALLS)
            return PartialReply(text[:len(text) - held])
        start = skip_whitespace(text, first + len(TOOL_CALLS))
        in_array = start < len(text) and text[start] == "["
        if in_array:
            start = skip_whitespace(text, start + 1)
        calls = []
        while start < len(text):
            call = scan_call(text, start)
            calls.append(call)
            if call.end is None:
                break
            start = skip_whitespace(text, call.end)
            if start < len(text) and text[start] == ",":
                start = skip_whitespace(text, start + 1)
            elif start < len(text) and not (in_array and text[start] == "]"):
                raise MalformedJSON(f"expected ',' or ']' between calls at offset {start}")
            else:
                break
        return PartialReply(text[:first], tuple(calls))

    def syntax(self, vocab: dict[str, int] | None = None) -> ToolCallSyntax:
        as_token = vocab is not None and TOOL_CALLS in vocab
        return ToolCallSyntax(call_prefix='{"name": "', name_suffix='", "arguments": ', call_suffix="}",
                              separator=", ", opener="[" if as_token else TOOL_CALLS + "[", closer="]",
                              opener_token=TOOL_CALLS if as_token else None)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        entries = [{"name": call["function"]["name"], "arguments": arguments_object(call)} for call in calls]
        return TOOL_CALLS + json.dumps(entries, ensure_ascii=False)

    def new_call_id(self) -> str:
        return "".join(random.choices(ID_ALPHABET, k=ID_LENGTH))

    def normalise_call_id(self, call_id: str) -> str:
        """9 letters and digits: the id itself when it already is, else derived from its hash (the
        same id always maps to the same 9 characters, so a call and its result still match)."""
        if len(call_id) == ID_LENGTH and call_id.isalnum():
            return call_id
        digest = int(hashlib.sha256(call_id.encode()).hexdigest(), 16)
        chars = []
        for _ in range(ID_LENGTH):
            digest, index = divmod(digest, len(ID_ALPHABET))
            chars.append(ID_ALPHABET[index])
        return "".join(chars)

    def call_example(self) -> str:
        return ('respond with [TOOL_CALLS] followed by a JSON list of objects '
                '[{"name": <function-name>, "arguments": <args-json-object>}].')
