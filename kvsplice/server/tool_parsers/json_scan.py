"""Incremental JSON scanning for tool calls that are still being written.

A streamed call is a prefix of `{"name": "get_weather", "arguments": {"city": "Par`. These
helpers find where complete values end (strings, objects and arrays are bracketed, so their extent
is known without a full parse) and read a call object's name and the raw text of its arguments,
so that the text streamed so far is always a prefix of the final arguments text.

    scan_value(text, start)   -> offset past the value at `start`, or None if it is not complete yet
    scan_call(text, start)    -> PartialCall(name, arguments prefix, end) of the object at `start`

MalformedJSON: the text can never become the expected JSON (e.g. `{"name" 5`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")
# regexes keep the scans at C speed: a streamed reply is re-read after every token
_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*"', re.S)   # the rest of a string, through its closing quote
_STRUCTURAL = re.compile(r'[\[\]{}"]')                # the next character that matters inside a container


class MalformedJSON(ValueError):
    """The text is not (a prefix of) the JSON a tool call needs."""


def skip_whitespace(text: str, offset: int) -> int:
    while offset < len(text) and text[offset] in WHITESPACE:
        offset += 1
    return offset


def _scan_string(text: str, start: int) -> int | None:
    """Offset past the string whose opening quote is at `start`, or None if it is unterminated."""
    match = _STRING_REST.match(text, start + 1)
    return match.end() if match else None


def _scan_bracketed(text: str, start: int) -> int | None:
    """Offset past the object / array opening at `start`, or None if it is not closed yet."""
    closers = []
    offset = start
    while True:
        found = _STRUCTURAL.search(text, offset)
        if found is None:
            return None
        offset, char = found.start(), found.group()
        if char == '"':
            end = _scan_string(text, offset)
            if end is None:
                return None
            offset = end
            continue
        if char in "{[":
            closers.append("}" if char == "{" else "]")
        elif not closers or closers.pop() != char:
            raise MalformedJSON(f"unbalanced {char!r} at offset {offset}")
        elif not closers:
            return offset + 1
        offset += 1


def scan_value(text: str, start: int) -> int | None:
    """Offset just past the JSON value that begins at text[start], or None when `text` ends before
    the value is known to be complete (a number or literal at the very end may still grow)."""
    if start >= len(text):
        return None
    char = text[start]
    if char == '"':
        return _scan_string(text, start)
    if char in "{[":
        return _scan_bracketed(text, start)
    offset = start
    while offset < len(text) and text[offset] not in WHITESPACE + ",}]":
        offset += 1
    if offset == start:
        raise MalformedJSON(f"unexpected {char!r} at offset {start}")
    return offset if offset < len(text) else None


@dataclass(frozen=True)
class PartialCall:
    """A call object read so far. `name`: None until the name string is complete. `arguments`: a
    prefix of the final arguments JSON text ("" until the name is known); `end`: offset past the
    object once it is complete, else None."""

    name: str | None
    arguments: str
    end: int | None


def _members(text: str, start: int):
    """Yield (key, value_start, value_end or None) for the object at `start`; the last yielded
    member may be incomplete. Returns (StopIteration value) the offset past `}` or None."""
    if start >= len(text):
        return None
    if text[start] != "{":
        raise MalformedJSON(f"expected '{{' at offset {start}, got {text[start]!r}")
    offset = skip_whitespace(text, start + 1)
    while offset < len(text):
        if text[offset] == "}":
            return offset + 1
        if text[offset] != '"':
            raise MalformedJSON(f"expected a key at offset {offset}, got {text[offset]!r}")
        key_end = _scan_string(text, offset)
        if key_end is None:
            return None
        key = json.loads(text[offset:key_end])
        offset = skip_whitespace(text, key_end)
        if offset >= len(text):
            return None
        if text[offset] != ":":
            raise MalformedJSON(f"expected ':' after key {key!r}")
        value_start = skip_whitespace(text, offset + 1)
        value_end = scan_value(text, value_start)
        yield key, value_start, value_end
        if value_end is None:
            return None
        offset = skip_whitespace(text, value_end)
        if offset < len(text) and text[offset] == ",":
            offset = skip_whitespace(text, offset + 1)
        elif offset < len(text) and text[offset] != "}":
            raise MalformedJSON(f"expected ',' or '}}' at offset {offset}, got {text[offset]!r}")
    return None


def scan_call(text: str, start: int, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> PartialCall:
    """Read the call object `{"name": ..., "arguments": {...}}` that begins at text[start].

    The arguments come back as their raw JSON text (a growing prefix while incomplete), or decoded
    when the model wrote them as a JSON string (held back until that string is complete). A
    complete call without arguments has "{}". Extra keys (e.g. Mistral's "id") are skipped."""
    name, arguments, args_done = None, "", False
    members = _members(text, start)
    end = None
    while True:
        try:
            key, value_start, value_end = next(members)
        except StopIteration as stop:
            end = stop.value
            break
        if key == "name" and value_end is not None:
            name = json.loads(text[value_start:value_end])
            if not isinstance(name, str):
                raise MalformedJSON("the call's name is not a string")
        elif key in argument_keys:
            raw = text[value_start:value_end] if value_end is not None else text[value_start:]
            if raw.startswith('"'):
                raw = json.loads(raw) if value_end is not None else ""
            arguments, args_done = raw, value_end is not None
    if end is not None and not args_done:
        arguments = arguments or "{}"
    return PartialCall(name, arguments if name is not None else "", end)
