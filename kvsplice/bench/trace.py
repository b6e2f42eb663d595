"""The JSONL trace format for agent workloads: one conversation per line.

A line looks like::

    {"id": "conv-0", "cache_salt": null,
     "turns": [{"messages": [...], "edit": "first", "max_tokens": 128}, ...]}

Each turn's `messages` is the full OpenAI messages list the client sends for that turn (agents resend
the whole context every turn, edited or not). `edit` names how this turn's context was derived from the
previous turn's: "first", "append", "delete_tool_result", "replace_with_note", "update_note",
"strip_reasoning", or any other non-empty string a workload invents.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

KNOWN_EDITS = ("first", "append", "delete_tool_result", "replace_with_note", "update_note", "strip_reasoning")
# Turns whose context only grew at the end: a prefix cache serves them fully, so they are not "edited".
UNEDITED_KINDS = ("first", "append")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


class TraceError(ValueError):
    """A trace file line is malformed; the message names the file line number and what is wrong."""


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: the full messages list, how it was edited, and its output budget."""

    messages: tuple[dict[str, Any], ...]
    edit: str
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    """One agent conversation: its id, optional cache salt (isolates its cache), and its turns in order."""

    id: str
    cache_salt: Optional[str]
    turns: tuple[Turn, ...]

    @property
    def is_edited(self) -> tuple[bool, ...]:
        """Per turn: True when the turn's edit kind is not "first" or "append"."""
        return tuple(turn.edit not in UNEDITED_KINDS for turn in self.turns)


def _fail(line_number: int, what: str) -> TraceError:
    return TraceError(f"trace line {line_number}: {what}")


def _check_message(message: Any, where: str, line_number: int) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise _fail(line_number, f"{where} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise _fail(line_number, f"{where}.role must be one of {MESSAGE_ROLES}, got {role!r}")
    if "content" not in message:
        raise _fail(line_number, f"{where} has no 'content'")
    content = message["content"]
    if not (content is None or isinstance(content, (str, list))):
        raise _fail(line_number, f"{where}.content must be a string, a list of parts or null")
    if content is None and not message.get("tool_calls"):
        raise _fail(line_number, f"{where}.content is null without tool_calls")
    return message


def _check_turn(turn: Any, turn_offset: int, line_number: int) -> Turn:
    where = f"turns[{turn_offset}]"
    if not isinstance(turn, dict):
        raise _fail(line_number, f"{where} must be an object, got {type(turn).__name__}")
    for field in ("messages", "edit", "max_tokens"):
        if field not in turn:
            raise _fail(line_number, f"{where} is missing '{field}'")
    messages = turn["messages"]
    if not isinstance(messages, list) or not messages:
        raise _fail(line_number, f"{where}.messages must be a non-empty list")
    checked = tuple(
        _check_message(message, f"{where}.messages[{offset}]", line_number) for offset, message in enumerate(messages)
    )
    edit = turn["edit"]
    if not isinstance(edit, str) or not edit:
        raise _fail(line_number, f"{where}.edit must be a non-empty string, got {edit!r}")
    max_tokens = turn["max_tokens"]
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _fail(line_number, f"{where}.max_tokens must be a positive integer, got {max_tokens!r}")
    return Turn(messages=checked, edit=edit, max_tokens=max_tokens)


def conversation_from_json(obj: Any, line_number: int) -> Conversation:
    """Validate one decoded trace line and build its Conversation; raise TraceError naming `line_number`."""
    if not isinstance(obj, dict):
        raise _fail(line_number, f"a conversation must be a JSON object, got {type(obj).__name__}")
    for field in ("id", "turns"):
        if field not in obj:
            raise _fail(line_number, f"missing '{field}'")
    if not isinstance(obj["id"], str) or not obj["id"]:
        raise _fail(line_number, f"'id' must be a non-empty string, got {obj['id']!r}")
    cache_salt = obj.get("cache_salt")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise _fail(line_number, f"'cache_salt' must be a string or null, got {cache_salt!r}")
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns:
        raise _fail(line_number, "'turns' must be a non-empty list")
    checked = tuple(_check_turn(turn, offset, line_number) for offset, turn in enumerate(turns))
    return Conversation(id=obj["id"], cache_salt=cache_salt, turns=checked)


def conversation_to_json(conversation: Conversation) -> dict[str, Any]:
    """The JSON object of one trace line for `conversation` (inverse of conversation_from_json)."""
    return {
        "id": conversation.id,
        "cache_salt": conversation.cache_salt,
        "turns": [
            {"messages": list(turn.messages), "edit": turn.edit, "max_tokens": turn.max_tokens}
            for turn in conversation.turns
        ],
    }


def load_trace(path: str | Path) -> list[Conversation]:
    """Read and validate a JSONL trace; blank lines are skipped.

    Raises TraceError (a ValueError) naming the 1-based line number for bad JSON, missing fields, wrong
    types or a duplicate conversation id, and for a file with no conversation. OSError if unreadable.
    """
    conversations: list[Conversation] = []
    seen_ids: set[str] = set()
    with open(path, encoding="utf-8") as trace_file:
        for line_number, line in enumerate(trace_file, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as error:
                raise _fail(line_number, f"bad JSON: {error.msg} at column {error.colno}") from None
            conversation = conversation_from_json(obj, line_number)
            if conversation.id in seen_ids:
                raise _fail(line_number, f"duplicate conversation id {conversation.id!r}")
            seen_ids.add(conversation.id)
            conversations.append(conversation)
    if not conversations:
        raise TraceError(f"trace {path}: no conversations")
    return conversations


def dump_trace(conversations: Iterable[Conversation], path: str | Path) -> None:
    """Write `conversations` as a JSONL trace to `path` (overwritten), one conversation per line."""
    with open(path, "w", encoding="utf-8") as trace_file:
        for conversation in conversations:
            trace_file.write(json.dumps(conversation_to_json(conversation), ensure_ascii=False) + "\n")
