"""ToolParser: one model family's tool-call syntax, read back from the reply text.

Every parser implements `parse_partial(text, final)`: the reply's content and its calls as far as
`text` (the reply so far) shows them. It must be monotone: for a longer text the content and each
call's arguments only grow (the streamed deltas are the differences, so streaming and the final
answer agree wherever the text is split). `parse(text)` is the final answer: only complete calls
whose arguments are a JSON object count; if one is malformed the whole text is content (vLLM's
behaviour), so a reply is never lost.

A parser also says how its family writes calls (`syntax`, for grammar-forced calls), renders calls
and tool definitions as text for chat templates that cannot (`render_calls`, `tools_prompt`), and
makes call ids (`new_call_id`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from kvsplice.server.tool_parsers.json_scan import MalformedJSON, PartialCall
from kvsplice.structured.spec import ToolCallSyntax


@dataclass(frozen=True)
class ParsedCall:
    """A complete call: the function name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into its text content (None when there is none) and its tool calls."""

    content: str | None
    calls: tuple[ParsedCall, ...]


@dataclass(frozen=True)
class PartialReply:
    """What the reply so far shows: `content` safe to emit, the calls begun (in order), and
    `malformed` when the text can no longer become valid calls."""

    content: str
    calls: tuple[PartialCall, ...] = ()
    malformed: bool = False


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (text that must be
    held back: it may be the start of the marker)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def arguments_object(call: dict[str, Any]) -> Any:
    """An OpenAI tool call's arguments as a JSON value (the API sends them as a JSON string)."""
    arguments = call.get("function", {}).get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


class ToolParser:
    """Base class; subclasses set `name`, `markers` and implement `parse_partial`, `syntax`,
    `render_calls`."""

    name: ClassVar[str]
    # strings that start tool-call text; a marker that is a special token needs the reply decoded
    # with special tokens kept
    markers: ClassVar[tuple[str, ...]] = ()

    def parse_partial(self, text: str, final: bool = False) -> PartialReply:
        raise NotImplementedError

    def syntax(self, vocab: dict[str, int] | None = None) -> ToolCallSyntax:
        """How calls are written, for grammar-forced calls; `vocab` lets a format whose marker is a
        special token match it as that token."""
        raise NotImplementedError

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """OpenAI `tool_calls` entries as this family's text (for templates that drop tool_calls)."""
        raise NotImplementedError

    def parse(self, text: str, complete_only: bool = False) -> ParsedReply:
        """The final reply: content (None if blank) and complete, valid calls; the whole text as
        content when any call is malformed or unfinished. `complete_only` (grammar-forced replies,
        which can only be cut short, never malformed): keep the complete calls before an unfinished
        one instead."""
        try:
            partial = self.parse_partial(text, final=True)
        except MalformedJSON:
            return ParsedReply(text if text.strip() else None, ())
        calls = []
        for call in partial.calls:
            if partial.malformed or call.end is None or call.name is None or not _is_object(call.arguments):
                if complete_only and calls:
                    break
                return ParsedReply(text if text.strip() else None, ())
            calls.append(ParsedCall(call.name, call.arguments))
        content = partial.content if partial.content.strip() else None
        return ParsedReply(content, tuple(calls))

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def normalise_call_id(self, call_id: str) -> str:
        """The id as this family's template wants it (unchanged here)."""
        return call_id

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """System-prompt text offering `tools`, for chat templates that ignore the tools argument:
        the Hermes / Qwen 2.5 wording, which the other formats adapt through `call_example`."""
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listing}\n</tools>\n\n"
                f"For each function call, {self.call_example()}")

    def call_example(self) -> str:
        raise NotImplementedError


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except json.JSONDecodeError:
        return False
