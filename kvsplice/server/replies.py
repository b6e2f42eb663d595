"""A chat reply's text -> OpenAI's assistant message (content, reasoning_content, tool_calls, finish_reason),
whole or as stream deltas.

    reply text ─(reasoning parser: <think> block -> reasoning_content)─> content
               ─(tool plan: parse calls)─> content (None when only calls) + tool_calls

A reply with calls that stopped by itself finishes with "tool_calls" (OpenAI); one cut by max_tokens
keeps "length" (a forced reply cut inside a later call keeps its complete calls). The streamed deltas
of a reply add up to its whole message (ToolCallStream).
"""

from __future__ import annotations

from typing import Any, Optional

from kvsplice.server.chat import ReasoningStream, split_reasoning
from kvsplice.server.tool_parsers import ToolParser
from kvsplice.server.tool_parsers.stream import ToolCallStream
from kvsplice.server.tools import ToolPlan


def finish_reason(reason: Optional[str], has_calls: bool) -> Optional[str]:
    return "tool_calls" if has_calls and reason == "stop" else reason


class ReplyFormat:
    """How the replies of one request are shaped: `reasoning` (split <think> blocks), `tools` (the
    request's ToolPlan) and the tool `parser`."""

    def __init__(self, reasoning: bool, tools: ToolPlan, parser: ToolParser):
        self.reasoning, self.tools, self.parser = reasoning, tools, parser

    def message(self, text: str, reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """The assistant message of a whole reply and its finish_reason."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning:
            split = split_reasoning(text)
            message.update(content=split.content, reasoning_content=split.reasoning_content)
        if not self.tools.parse:
            return message, reason
        parsed = self.parser.parse(message["content"] or "", complete_only=self.tools.forced is not None)
        calls = parsed.calls[:self.tools.max_calls]
        if calls:
            message["content"] = parsed.content
            message["tool_calls"] = [{"id": self.parser.new_call_id(), "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
        return message, finish_reason(reason, bool(calls))

    def stream(self) -> "ReplyStream":
        return ReplyStream(self)


class ReplyStream:
    """One streamed reply: text deltas in, OpenAI `delta` objects out."""

    def __init__(self, fmt: ReplyFormat):
        self.reasoning = ReasoningStream() if fmt.reasoning else None
        self.calls = ToolCallStream(fmt.parser, fmt.tools.max_calls) if fmt.tools.parse else None

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """The delta for `text` (may be empty: nothing safe to show yet)."""
        thought, content = self.reasoning.feed(text, final=final) if self.reasoning else ("", text)
        delta: dict[str, Any] = {}
        if thought:
            delta["reasoning_content"] = thought
        if self.calls is None:
            if content:
                delta["content"] = content
            return delta
        parsed = self.calls.feed(content, final=final)
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = parsed.tool_calls
        return delta

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return finish_reason(reason, self.calls is not None and self.calls.has_calls)
