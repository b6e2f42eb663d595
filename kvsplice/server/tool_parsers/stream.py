"""ToolCallStream: a streamed reply's text deltas -> OpenAI chat deltas (content, tool_calls).

    feed("<tool_") -> nothing (may be a marker)      feed('call>\\n{"name": "f", "arg') -> call 0: id, name
    feed('uments": {"a": 1') -> call 0 arguments '{"a": 1'          feed("}}\\n</tool_call>", final) -> '}'

Each feed re-reads the whole reply with the parser's `parse_partial` (replies are short; this
keeps every format's streaming equal to its final parse) and emits what grew since the last feed:
content once it is more than whitespace, a call's id / type / name when its name is complete, then
its arguments text as it grows. Concatenating the deltas gives `parser.parse(text)` for any split
of the text. A reply that turns out malformed before any call was emitted comes out as content
(the final parse says so); after a call was emitted, the stream stops adding to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvsplice.server.tool_parsers.base import PartialReply, ToolParser
from kvsplice.server.tool_parsers.json_scan import MalformedJSON, PartialCall


@dataclass
class StreamDelta:
    """What one feed adds: content text and OpenAI `delta.tool_calls` entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _SentCall:
    call_id: str
    arguments_sent: int = 0


class ToolCallStream:
    """Incremental tool-call parsing of one reply. `max_calls`: calls beyond it are not emitted
    (parallel_tool_calls=false keeps the first)."""

    def __init__(self, parser: ToolParser, max_calls: Optional[int] = None):
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.content_sent = ""
        self.calls: list[_SentCall] = []
        self.broken = False

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        """Add `delta` to the reply; `final=True` for the last one (flushes held-back text)."""
        self.text += delta
        out = StreamDelta()
        partial = self._read(final)
        if partial is not None:
            out.content = self._content_delta(partial.content)
            out.tool_calls = self._call_deltas(partial.calls)
        if final and not self.calls:
            # no call was emitted: whatever the final parse calls content is content (a malformed
            # call included, as in the non-streamed answer)
            out.content += self._content_delta(self.parser.parse(self.text).content or "")
        return out

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def _read(self, final: bool) -> PartialReply | None:
        if self.broken:
            return None
        try:
            partial = self.parser.parse_partial(self.text, final)
        except MalformedJSON:
            partial = None
        if partial is None or partial.malformed:
            self.broken = True
            return None
        return partial

    def _content_delta(self, content: str) -> str:
        """The part of `content` not yet sent; nothing while it is only whitespace (a reply that is
        only calls has content None, not "\\n")."""
        if not content.strip() or not content.startswith(self.content_sent):
            return ""
        delta = content[len(self.content_sent):]
        self.content_sent = content
        return delta

    def _call_deltas(self, calls: tuple[PartialCall, ...]) -> list[dict[str, Any]]:
        deltas = []
        for index, call in enumerate(calls[:self.max_calls]):
            if call.name is None:
                break
            if index == len(self.calls):
                self.calls.append(_SentCall(self.parser.new_call_id()))
                sent = self.calls[index]
                sent.arguments_sent = len(call.arguments)
                deltas.append({"index": index, "id": sent.call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                continue
            sent = self.calls[index]
            if len(call.arguments) > sent.arguments_sent:
                deltas.append({"index": index, "function": {"arguments": call.arguments[sent.arguments_sent:]}})
                sent.arguments_sent = len(call.arguments)
        return deltas
