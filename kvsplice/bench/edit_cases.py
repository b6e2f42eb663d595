"""Edit cases for SCR fidelity: a two-turn agent chat whose second turn edits the middle of the first.

A case is (turn 1 messages, turn 2 messages). Turn 2 applies one or two context edits to turn 1's
messages plus turn 1's reply, then appends a new user message of >= 40 tokens, so the last 32 prompt
positions are always computed, never served from a cache:

    turn 1   [sys][task][notes][call 0][result 0][call 1][result 1] ... [call n][result n]
    turn 2   [sys][task][notes][call 0][result 0]  ...edited...         [call n][result n][REPLY][ask]

The assistant message whose content is REPLY_PLACEHOLDER stands for turn 1's generated reply; the
fidelity harness puts the reply it actually generated there (`fill_reply`). Text comes from stdlib
docstrings (`kvsplice.bench.workload.load_corpus`), so cases are deterministic on a Python build.

`workload_cases(seed)` draws fresh cases from the workload generator (`kvsplice.bench.workload`):
every edited turn of its conversations, with the turn before it as turn 1. Turn 2 is the edited
turn's context without the step it appended (the edit the workload made to turn 1's messages),
then turn 1's reply and a follow-up question, as in the built-in cases; when the edit removed a
tool result, the question asks about that document (ASK_DELETED), else it is FOLLOW_UP.
`leaves_content_to_relocate` tells the cases that give SCR something to move (`fidelity --relocating`).

JSONL format for `--cases FILE`, one case a line:
    {"name": "my_case", "turn1": [{"role": ..., "content": ...}, ...], "turn2": [...]}
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from kvsplice.bench.trace import UNEDITED_KINDS
from kvsplice.bench.workload import (SYSTEM_PROMPT, Document, estimate_tokens, generate_traces, load_corpus,
                                      take_words)

REPLY_PLACEHOLDER = "<<turn 1 reply>>"
THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
FOLLOW_UP = (
    "Thanks. Now, using only the documentation that is still in your context above, write a short summary "
    "of how these modules fit together, name the two functions you found most useful and say why, and "
    "list any open questions you still have before calling the next tool."
)
ASK_DELETED = (
    "Thanks. Now go back to the documentation of {title} that you read earlier: what did it say? Summarize it in "
    "two sentences, quote its first line exactly, and name one function or class it describes, before "
    "calling the next tool."
)
ROLES = ("system", "user", "assistant", "tool")


class CasesFileError(ValueError):
    """A malformed line in a cases file; the message names the file and line."""


@dataclass(frozen=True)
class EditCase:
    """One fidelity case: `turn1` messages, `turn2` messages (one may be the reply placeholder);
    `answer_prefix`: text that starts the assistant's answer after turn 2's generation prompt (the
    fact task's "The passphrase ... is"), empty for none."""

    name: str
    turn1: tuple[dict[str, Any], ...]
    turn2: tuple[dict[str, Any], ...]
    answer_prefix: str = ""


def fill_reply(messages: tuple[dict[str, Any], ...], reply: str) -> list[dict[str, Any]]:
    """`messages` with every REPLY_PLACEHOLDER content replaced by `reply` (new dicts; input untouched)."""
    return [{**m, "content": reply} if m.get("content") == REPLY_PLACEHOLDER else dict(m) for m in messages]


def _agent_turn1(rng: random.Random, corpus: tuple[Document, ...], n_steps: int,
                 result_words: int) -> list[dict[str, Any]]:
    """System prompt, task, notes, then `n_steps` of (assistant <think> + tool call, tool result)."""
    _, task = take_words(rng, corpus, 14)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Task: explain how these fit together, citing the docs. Context: {task}"},
        {"role": "user", "content": "Working notes:\n- (none yet)"},
    ]
    for step in range(n_steps):
        _, reasoning = take_words(rng, corpus, 40)
        title, result = take_words(rng, corpus, result_words)
        messages.append({"role": "assistant", "content": (
            f"<think>I should check {title} next. {reasoning}</think>\n"
            f"read_doc({json.dumps({'name': title})})")})
        messages.append({"role": "tool", "content": f"Documentation of {title}:\n{result}"})
    return messages


def _tool_offsets(messages: list[dict[str, Any]]) -> list[int]:
    return [offset for offset, m in enumerate(messages) if m["role"] == "tool"]


def _delete_result(messages: list[dict[str, Any]], tool_offset: int) -> list[dict[str, Any]]:
    # The call goes with its result, as an agent must do for OpenAI-style tool calls.
    return messages[: tool_offset - 1] + messages[tool_offset + 1:]


def _replace_with_note(messages: list[dict[str, Any]], tool_offset: int) -> list[dict[str, Any]]:
    gist = " ".join(messages[tool_offset]["content"].split()[:12])
    note = {**messages[tool_offset], "content": f"[note] Result removed to save context. It began: {gist} ..."}
    return messages[:tool_offset] + [note] + messages[tool_offset + 1:]


def _strip_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": THINK_RE.sub("", m["content"])} if m["role"] == "assistant" else m
            for m in messages]


def _insert_note(messages: list[dict[str, Any]], at: int) -> list[dict[str, Any]]:
    note = {"role": "user", "content": "Note: the result above is the most relevant one so far; keep it in mind."}
    return messages[:at] + [note] + messages[at:]


# the built-in cases' edits, in their order: each takes turn 1's messages plus the reply placeholder
_EDITS = {
    "delete_tool_result": lambda m: _delete_result(m, _tool_offsets(m)[1]),
    "replace_with_note": lambda m: _replace_with_note(m, _tool_offsets(m)[1]),
    "strip_reasoning": _strip_reasoning,
    "insert_note": lambda m: _insert_note(m, _tool_offsets(m)[1] + 1),
    "two_edits": lambda m: _replace_with_note(_delete_result(m, _tool_offsets(m)[2]), _tool_offsets(m)[0]),
}


def builtin_cases(seed: int = 0) -> list[EditCase]:
    """The five built-in cases (delete a tool result, replace one by a note, strip reasoning, insert a
    note, two edits at once) on 1.5K-4K-token chats; deterministic for `seed` on a Python build."""
    corpus = load_corpus()
    cases = []
    for number, (name, edit) in enumerate(_EDITS.items()):
        rng = random.Random(f"kvsplice-fidelity:{seed}:{number}")
        turn1 = _agent_turn1(rng, corpus, n_steps=5, result_words=rng.randint(220, 420))
        turn2 = edit(turn1 + [{"role": "assistant", "content": REPLY_PLACEHOLDER}])
        turn2 = turn2 + [{"role": "user", "content": FOLLOW_UP}]
        cases.append(EditCase(name, tuple(turn1), tuple(turn2)))
    return cases


LONG_CASE_EDITS = ("delete_tool_result", "replace_with_note", "insert_note", "strip_reasoning")


def long_cases(tokens: int, seed: int = 0, kinds: tuple[str, ...] = LONG_CASE_EDITS,
               count: Callable[[list[dict[str, Any]]], int] = estimate_tokens) -> list[EditCase]:
    """One case per edit kind of `kinds` (the built-in cases' edits) on an agent chat of at most
    `tokens` tokens by `count` (default `estimate_tokens`; a model's tokenizer and template for exact
    sizes): turn 1 grows step by step while it and turn 2 (turn 1, the reply placeholder, the edit and
    the question) stay within `tokens`. Named "{kind}-{tokens}". The edit hits the second tool result, as
    in the built-in cases, so almost all of the context after it is relocated. Deterministic for `seed`."""
    unknown = [kind for kind in kinds if kind not in _EDITS]
    if unknown:
        raise ValueError(f"unknown edit kind(s) {unknown}; known: {sorted(_EDITS)}")
    corpus = load_corpus()
    cases = []
    for number, kind in enumerate(kinds):
        rng = random.Random(f"kvsplice-fidelity-long:{seed}:{tokens}:{number}")
        case = None
        for turn1 in _growing_turn1(rng, corpus):
            turn2 = _EDITS[kind](turn1 + [{"role": "assistant", "content": REPLY_PLACEHOLDER}])
            turn2.append({"role": "user", "content": FOLLOW_UP})
            if case is not None and max(count(turn1), count(turn2)) > tokens:
                break
            case = EditCase(f"{kind}-{tokens}", tuple(turn1), tuple(turn2))
        cases.append(case)
    return cases


def _growing_turn1(rng: random.Random, corpus: tuple[Document, ...]) -> Iterator[list[dict[str, Any]]]:
    """`_agent_turn1`'s chat of three steps (the edits hit the second result and leave one after it),
    then one step longer each time (tool results of 220..420 words), without end."""
    messages = _agent_turn1(rng, corpus, n_steps=3, result_words=rng.randint(220, 420))
    while True:
        yield list(messages)
        messages += _agent_turn1(rng, corpus, n_steps=1, result_words=rng.randint(220, 420))[3:]


def workload_cases(seed: int, conversations: int = 8, min_tokens: int = 2000, max_tokens: int = 4000,
                   max_turns: int = 10) -> list[EditCase]:
    """Fresh edit cases from `conversations` generated agent conversations (`generate_traces`,
    deterministic for `seed`, 4..max_turns turns, contexts of min_tokens..max_tokens estimated
    tokens): one case per edited turn whose previous turn holds a tool result, named
    "{conversation}-t{turn}-{edit}" (see the module docstring)."""
    cases = []
    for conversation in generate_traces(conversations, seed, min_tokens=min_tokens, max_tokens=max_tokens,
                                        min_turns=4, max_turns=max_turns):
        for number, (previous, turn) in enumerate(zip(conversation.turns, conversation.turns[1:]), start=1):
            if turn.edit in UNEDITED_KINDS or not any(m["role"] == "tool" for m in previous.messages):
                continue
            turn1 = tuple({"role": m["role"], "content": m["content"]} for m in previous.messages)
            edited = [{"role": m["role"], "content": m["content"]} for m in turn.messages[:-2]]
            removed = _removed_titles(turn1, edited)
            question = ASK_DELETED.format(title=removed[0]) if removed else FOLLOW_UP
            turn2 = (*edited, {"role": "assistant", "content": REPLY_PLACEHOLDER}, {"role": "user", "content": question})
            cases.append(EditCase(f"{conversation.id}-t{number}-{turn.edit}", turn1, turn2))
    return cases


def leaves_content_to_relocate(case: EditCase) -> bool:
    """Whether turn 2 edits turn 1's messages and keeps turn 1's last message unchanged, so that
    something after the edit survives to be relocated. A case that edits only the last message,
    or only appends, is served by prefix caching alone (KL 0 for every SCR setting)."""
    turn1, turn2 = list(case.turn1), list(case.turn2)
    return turn2[:len(turn1)] != turn1 and turn1[-1] in turn2


def _removed_titles(before, after) -> list[str]:
    """Titles of the tool results ("Documentation of TITLE:") in `before` that `after` lacks."""
    kept = {m["content"] for m in after if m["role"] == "tool"}
    return [m["content"].split(":", 1)[0].removeprefix("Documentation of ")
            for m in before if m["role"] == "tool" and m["content"] not in kept
            and m["content"].startswith("Documentation of ")]


def _check_messages(value: Any, key: str, where: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise CasesFileError(f"{where}: {key!r} must be a non-empty list of messages")
    for number, message in enumerate(value):
        if (not isinstance(message, dict) or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)):
            raise CasesFileError(f"{where}: {key}[{number}] must be an object with a role in {ROLES} "
                                 f"and a string content")
    return tuple(value)


def parse_case_line(line: str, where: str) -> EditCase:
    """One JSONL line as an EditCase; raises CasesFileError prefixed with `where` (e.g. "cases.jsonl:3")."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CasesFileError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise CasesFileError(f"{where}: expected an object with name, turn1, turn2")
    missing = [key for key in ("name", "turn1", "turn2") if key not in obj]
    if missing:
        raise CasesFileError(f"{where}: missing {', '.join(missing)}")
    if not isinstance(obj["name"], str) or not obj["name"]:
        raise CasesFileError(f"{where}: 'name' must be a non-empty string")
    return EditCase(obj["name"], _check_messages(obj["turn1"], "turn1", where),
                    _check_messages(obj["turn2"], "turn2", where))


def load_cases(path: str | Path) -> list[EditCase]:
    """Cases from a JSONL file (blank lines skipped). Raises CasesFileError naming the first bad line,
    or saying the file holds no case; OSError if it cannot be read."""
    cases = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if line.strip():
                cases.append(parse_case_line(line, f"{path}:{line_number}"))
    if not cases:
        raise CasesFileError(f"{path}: no cases")
    return cases
