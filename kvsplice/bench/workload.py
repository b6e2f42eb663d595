"""Synthetic context-editing agent conversations, written as traces (see `kvsplice.bench.trace`).

An agent loop: a system prompt, a task, a working-notes message, then per turn an assistant message
(a `<think>` reasoning block and a `read_doc` tool call) and the tool's result. Between turns the agent
manages its context the way context-managing agents do; each turn records the edit it made:

    first               [sys][task][notes]
    append              ... previous turn's [call][result] appended, nothing else changed
    delete_tool_result  an earlier [call][result] pair removed            (mid-context deletion)
    replace_with_note   an earlier result replaced by a one-line note     (mid-context replacement)
    update_note         the notes message (offset 2) rewritten in place   (edit near the start)
    strip_reasoning     <think> blocks removed from earlier assistant turns

Every edited turn also appends the previous turn's call and result. When the context would exceed
`max_tokens`, the agent compacts: it replaces (or deletes) its oldest results until it fits, and that turn
is marked with the compaction's edit kind.

With `edits="early"` every turn whose context has grown past 1024 tokens edits its start (before
token 1024, where a matcher that needs a long common prefix finds none) and appends its step; the
turns before only append:

    edit_system         the system prompt's first sentence (the session's date) changed  (token 0)
    move_message        the task and the notes messages swap places                 (a reordering)
    update_note         as above; the notes sit near the start
    strip_reasoning     as above; the first <think> block sits near the start
    replace_with_note   the oldest full result replaced by a note
    delete_tool_result  the oldest full result deleted with its call
    two_edits           update_note and replace_with_note (or edit_system) in one turn

Text comes from the docstrings of Python standard-library modules (`inspect.getdoc`, a fixed module list
in a fixed order), so traces are realistic English, need no download, and are deterministic for a seed
on a given Python build. Sizes are estimates: words * `tokens_per_word`.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import math
import random
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from kvsplice.bench.trace import Conversation, Turn

CORPUS_MODULES = (
    "abc", "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html", "http.client", "inspect", "io", "ipaddress", "itertools", "json",
    "logging", "math", "mimetypes", "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re",
    "sched", "secrets", "shlex", "shutil", "socket", "sqlite3", "statistics", "string", "struct", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "traceback", "typing",
    "unittest", "urllib.parse", "uuid", "warnings", "weakref", "zipfile", "zlib",
)
MIN_DOC_WORDS = 25
EDIT_WEIGHTS = (
    ("append", 0.40),
    ("delete_tool_result", 0.15),
    ("replace_with_note", 0.15),
    ("update_note", 0.15),
    ("strip_reasoning", 0.15),
)
EARLY_EDITS = ("edit_system", "move_message", "update_note", "strip_reasoning", "replace_with_note",
               "delete_tool_result", "two_edits")
EDIT_PROFILES = ("mixed", "early")
EARLY_LIMIT_TOKENS = 1024  # an early edit starts before this (estimated) token offset
THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
SYSTEM_PROMPT = (
    "You are a careful research agent. You answer questions about the Python standard library by reading "
    "its documentation with the read_doc tool. Think step by step inside <think> tags before each call. "
    "Keep your working notes short and remove results you no longer need to save context."
)
NOTES_HEADER = "Working notes:"


@dataclass(frozen=True)
class Document:
    """One docstring of the corpus: where it came from and its words."""

    title: str
    words: tuple[str, ...]


def load_corpus() -> tuple[Document, ...]:
    """Docstrings of CORPUS_MODULES and their public members, in a fixed order (modules that fail to import
    are skipped). Only docstrings of at least MIN_DOC_WORDS words are kept. Importing the modules is the
    only side effect."""
    documents: list[Document] = []
    seen_texts: set[str] = set()
    for module_name in CORPUS_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        members = [(module_name, module)]
        with warnings.catch_warnings():  # some public names are deprecated aliases (typing.re) that warn on access
            warnings.simplefilter("ignore")
            members += [(f"{module_name}.{name}", getattr(module, name, None)) for name in sorted(vars(module))
                        if not name.startswith("_")]
            texts = [(title, inspect.getdoc(member) if member is not None else None) for title, member in members]
        for title, text in texts:
            if not text or text in seen_texts:
                continue
            seen_texts.add(text)
            words = tuple(text.split())
            if len(words) >= MIN_DOC_WORDS:
                documents.append(Document(title=title, words=words))
    if not documents:
        raise RuntimeError("no standard-library docstrings found (running with -OO strips them)")
    return tuple(documents)


def _message_words(message: dict[str, Any]) -> int:
    words = len(message["content"].split()) if isinstance(message.get("content"), str) else 0
    for call in message.get("tool_calls") or ():
        words += len(call["function"]["name"].split()) + len(call["function"]["arguments"].split())
    return words


def estimate_tokens(messages: list[dict[str, Any]] | tuple[dict[str, Any], ...], tokens_per_word: float = 1.3) -> int:
    """Approximate prompt tokens of `messages`: words * tokens_per_word plus 4 per message (role markers)."""
    words = sum(_message_words(message) for message in messages)
    return math.ceil(words * tokens_per_word) + 4 * len(messages)


@dataclass(frozen=True)
class _Sizes:
    result_words: int
    reasoning_words: int
    max_tokens: int
    tokens_per_word: float
    max_output_tokens: int


def take_words(rng: random.Random, corpus: tuple[Document, ...], n_words: int) -> tuple[str, str]:
    """A title and `n_words` words starting at a random document, running on into the following ones."""
    start = rng.randrange(len(corpus))
    words: list[str] = []
    offset = start
    while len(words) < n_words:
        words.extend(corpus[offset % len(corpus)].words)
        offset += 1
    return corpus[start].title, " ".join(words[:n_words])


def _agent_step(rng: random.Random, corpus: tuple[Document, ...], sizes: _Sizes, step: int) -> list[dict[str, Any]]:
    """The assistant's reasoning + tool call and the tool's result for one step."""
    _, reasoning = take_words(rng, corpus, sizes.reasoning_words)
    title, result = take_words(rng, corpus, sizes.result_words)
    call_id = f"call_{step}"
    assistant = {
        "role": "assistant",
        "content": f"<think>I should check {title} next. {reasoning}</think>\nReading the documentation of {title}.",
        "tool_calls": [{"id": call_id, "type": "function",
                        "function": {"name": "read_doc", "arguments": json.dumps({"name": title})}}],
    }
    tool = {"role": "tool", "tool_call_id": call_id, "content": f"Documentation of {title}:\n{result}"}
    return [assistant, tool]


def _result_offsets(messages: list[dict[str, Any]], keep_last: int) -> list[int]:
    """Offsets of tool results that are still full text (not notes), excluding the last `keep_last` ones."""
    offsets = [offset for offset, message in enumerate(messages)
               if message["role"] == "tool" and not message["content"].startswith("[note]")]
    return offsets[: max(0, len(offsets) - keep_last)]


def _delete_result(messages: list[dict[str, Any]], tool_offset: int) -> list[dict[str, Any]]:
    # The result's assistant call goes with it: an OpenAI tool call must be answered by a tool message.
    assert messages[tool_offset - 1]["role"] == "assistant"
    return messages[: tool_offset - 1] + messages[tool_offset + 1:]


def _replace_with_note(messages: list[dict[str, Any]], tool_offset: int) -> list[dict[str, Any]]:
    old = messages[tool_offset]["content"]
    gist = " ".join(old.split()[:16])
    note = {**messages[tool_offset], "content": f"[note] Result removed to save context. It began: {gist} ..."}
    return messages[:tool_offset] + [note] + messages[tool_offset + 1:]


def _notes_offset(messages: list[dict[str, Any]]) -> int:
    return next(offset for offset, message in enumerate(messages)
                if message["role"] == "user" and message["content"].startswith(NOTES_HEADER))


def _update_note(rng: random.Random, corpus: tuple[Document, ...],
                 messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    title, gist = take_words(rng, corpus, 10)
    offset = _notes_offset(messages)
    notes = messages[offset]
    updated = {**notes, "content": f"{notes['content']}\n- {title}: {gist}"}
    return messages[:offset] + [updated] + messages[offset + 1:]


def _strip_reasoning(messages: list[dict[str, Any]], before_offset: int) -> list[dict[str, Any]]:
    return [
        {**message, "content": THINK_RE.sub("", message["content"])}
        if offset < before_offset and message["role"] == "assistant" else message
        for offset, message in enumerate(messages)
    ]


def _feasible_edits(messages: list[dict[str, Any]], appended_at: int) -> list[tuple[str, float]]:
    """Edit kinds that change something in messages[:appended_at] (the context before the new step)."""
    older = messages[:appended_at]
    feasible = [("append", EDIT_WEIGHTS[0][1]), ("update_note", EDIT_WEIGHTS[3][1])]
    if _result_offsets(older, keep_last=0):
        feasible += [("delete_tool_result", EDIT_WEIGHTS[1][1]), ("replace_with_note", EDIT_WEIGHTS[2][1])]
    if any(m["role"] == "assistant" and THINK_RE.search(m["content"]) for m in older):
        feasible.append(("strip_reasoning", EDIT_WEIGHTS[4][1]))
    return feasible


def _apply_edit(rng: random.Random, corpus: tuple[Document, ...], messages: list[dict[str, Any]], edit: str,
                appended_at: int) -> list[dict[str, Any]]:
    if edit == "append":
        return messages
    if edit == "update_note":
        return _update_note(rng, corpus, messages)
    if edit == "strip_reasoning":
        return _strip_reasoning(messages, appended_at)
    tool_offset = rng.choice(_result_offsets(messages[:appended_at], keep_last=0))
    if edit == "delete_tool_result":
        return _delete_result(messages, tool_offset)
    return _replace_with_note(messages, tool_offset)


def _edit_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system prompt's first sentence ("Session day N.") with N + 1: an edit at token 0."""
    first, rest = messages[0]["content"].split(". ", 1)
    day = int(first.rsplit(" ", 1)[1]) + 1
    return [{**messages[0], "content": f"Session day {day}. {rest}"}] + messages[1:]


def _move_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages 1 and 2 (the task and the notes) swap places."""
    return [messages[0], messages[2], messages[1]] + messages[3:]


def _oldest_early_result(messages: list[dict[str, Any]], appended_at: int, tokens_per_word: float) -> Optional[int]:
    """Offset of the oldest full result before `appended_at` if it starts before EARLY_LIMIT_TOKENS."""
    offsets = _result_offsets(messages[:appended_at], keep_last=0)
    if offsets and estimate_tokens(messages[: offsets[0] - 1], tokens_per_word) < EARLY_LIMIT_TOKENS:
        return offsets[0]
    return None


def _feasible_early_edits(messages: list[dict[str, Any]], appended_at: int, tokens_per_word: float) -> list[str]:
    """The EARLY_EDITS that change something before token EARLY_LIMIT_TOKENS of messages[:appended_at]."""
    feasible = ["edit_system", "move_message", "update_note", "two_edits"]
    think = [offset for offset, m in enumerate(messages[:appended_at])
             if m["role"] == "assistant" and THINK_RE.search(m["content"])]
    if think and estimate_tokens(messages[: think[0]], tokens_per_word) < EARLY_LIMIT_TOKENS:
        feasible.append("strip_reasoning")
    if _oldest_early_result(messages, appended_at, tokens_per_word) is not None:
        feasible += ["replace_with_note", "delete_tool_result"]
    return [kind for kind in EARLY_EDITS if kind in feasible]


def _apply_early_edit(rng: random.Random, corpus: tuple[Document, ...], messages: list[dict[str, Any]], edit: str,
                      appended_at: int, tokens_per_word: float) -> list[dict[str, Any]]:
    if edit == "edit_system":
        return _edit_system(messages)
    if edit == "move_message":
        return _move_message(messages)
    if edit == "update_note":
        return _update_note(rng, corpus, messages)
    if edit == "strip_reasoning":
        return _strip_reasoning(messages, appended_at)
    oldest = _oldest_early_result(messages, appended_at, tokens_per_word)
    if edit == "delete_tool_result":
        return _delete_result(messages, oldest)
    if edit == "replace_with_note":
        return _replace_with_note(messages, oldest)
    messages = _update_note(rng, corpus, messages)  # two_edits
    return _replace_with_note(messages, oldest) if oldest is not None else _edit_system(messages)


def _compact(messages: list[dict[str, Any]], sizes: _Sizes) -> tuple[list[dict[str, Any]], Optional[str]]:
    """Replace the oldest full results by notes (then delete notes' pairs) until the context fits."""
    edit: Optional[str] = None
    while estimate_tokens(messages, sizes.tokens_per_word) + sizes.max_output_tokens > sizes.max_tokens:
        offsets = _result_offsets(messages, keep_last=1)
        if offsets:
            messages, edit = _replace_with_note(messages, offsets[0]), "replace_with_note"
            continue
        note_offsets = [o for o, m in enumerate(messages[:-2]) if m["role"] == "tool"]
        if not note_offsets:
            break
        messages, edit = _delete_result(messages, note_offsets[0]), "delete_tool_result"
    return messages, edit


def _next_edit(rng: random.Random, corpus: tuple[Document, ...], messages: list[dict[str, Any]], appended_at: int,
               sizes: _Sizes, profile: str) -> tuple[list[dict[str, Any]], str]:
    """Draw this turn's edit kind for `profile` and apply it; (messages, edit kind)."""
    if profile == "early":
        if estimate_tokens(messages[:appended_at], sizes.tokens_per_word) < EARLY_LIMIT_TOKENS:
            return messages, "append"  # nothing to edit yet beyond the opening messages
        edit = rng.choice(_feasible_early_edits(messages, appended_at, sizes.tokens_per_word))
        return _apply_early_edit(rng, corpus, messages, edit, appended_at, sizes.tokens_per_word), edit
    kinds, weights = zip(*_feasible_edits(messages, appended_at))
    edit = rng.choices(kinds, weights=weights)[0]
    return _apply_edit(rng, corpus, messages, edit, appended_at), edit


def _conversation(rng: random.Random, corpus: tuple[Document, ...], conversation_id: str, n_turns: int,
                  sizes: _Sizes, cache_salt: Optional[str], profile: str) -> Conversation:
    _, task_words = take_words(rng, corpus, 12)
    system = SYSTEM_PROMPT if profile == "mixed" else f"Session day {rng.randint(1, 300)}. {SYSTEM_PROMPT}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Task: explain how these fit together, citing the docs. Context: {task_words}"},
        {"role": "user", "content": f"{NOTES_HEADER}\n- (none yet)"},
    ]
    turns = [Turn(tuple(copy.deepcopy(messages)), "first", rng.randint(max(1, sizes.max_output_tokens // 4),
                                                                         sizes.max_output_tokens))]
    for step in range(1, n_turns):
        appended_at = len(messages)
        messages = messages + _agent_step(rng, corpus, sizes, step - 1)
        messages, edit = _next_edit(rng, corpus, messages, appended_at, sizes, profile)
        messages, compaction = _compact(messages, sizes)
        edit = compaction or edit
        max_output = rng.randint(max(1, sizes.max_output_tokens // 4), sizes.max_output_tokens)
        turns.append(Turn(tuple(copy.deepcopy(messages)), edit, max_output))
    return Conversation(id=conversation_id, cache_salt=cache_salt, turns=tuple(turns))


def _check_arguments(n_conversations: int, min_tokens: int, max_tokens: int, min_turns: int, max_turns: int,
                     tokens_per_word: float, max_output_tokens: int, edits: str) -> None:
    if edits not in EDIT_PROFILES:
        raise ValueError(f"edits must be one of {', '.join(EDIT_PROFILES)}, got {edits!r}")
    if n_conversations < 1:
        raise ValueError(f"n_conversations must be >= 1, got {n_conversations}")
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"need 0 < min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}")
    if tokens_per_word <= 0:
        raise ValueError(f"tokens_per_word must be positive, got {tokens_per_word}")
    if not 1 <= max_output_tokens < min_tokens:
        raise ValueError(f"need 1 <= max_output_tokens < min_tokens, got {max_output_tokens}")


def generate_traces(n_conversations: int, seed: int, min_tokens: int = 2000, max_tokens: int = 32000,
                    min_turns: int = 4, max_turns: int = 40, tokens_per_word: float = 1.3,
                    max_output_tokens: int = 64, cache_salt: Optional[str] = None,
                    edits: str = "mixed") -> list[Conversation]:
    """Generate `n_conversations` synthetic context-editing agent conversations, deterministic for `seed`.

    Each conversation draws a peak context size in [min_tokens, max_tokens] (estimated tokens, see
    `estimate_tokens`) and a turn count in [min_turns, max_turns]; results are sized so the context grows
    towards the peak, and no turn's prompt plus its output budget exceeds `max_tokens` (compaction edits
    enforce it). Each turn's output budget is drawn in [max_output_tokens // 4, max_output_tokens].
    `edits`: "mixed" (the edit kinds above, appends included) or "early" (every later turn edits the
    context before token 1024; see the module docstring). Conversation ids are "w{seed}-{n}" ("e{seed}-{n}"
    for early edits). Raises ValueError for inconsistent bounds or an unknown `edits`.
    """
    _check_arguments(n_conversations, min_tokens, max_tokens, min_turns, max_turns, tokens_per_word,
                     max_output_tokens, edits)
    corpus = load_corpus()
    conversations = []
    for number in range(n_conversations):
        rng = random.Random(f"kvsplice-workload:{seed}:{number}")
        peak_tokens = rng.randint(min_tokens, max_tokens)
        n_turns = rng.randint(min_turns, max_turns)
        base_tokens = 120  # system prompt, task and notes
        # Growth per step, inflated by 1/0.7 because deletions and notes give back part of it.
        step_words = max(20.0, (peak_tokens - base_tokens - max_output_tokens) / max(1, n_turns - 1)
                         / tokens_per_word / 0.7)
        # One step must fit beside the base context, so compaction can always make room.
        step_words = min(step_words, (max_tokens - base_tokens - max_output_tokens) / tokens_per_word / 2)
        sizes = _Sizes(result_words=max(12, int(step_words * 0.8)), reasoning_words=max(6, int(step_words * 0.15)),
                       max_tokens=max_tokens, tokens_per_word=tokens_per_word, max_output_tokens=max_output_tokens)
        prefix = "w" if edits == "mixed" else "e"
        conversations.append(_conversation(rng, corpus, f"{prefix}{seed}-{number}", n_turns, sizes, cache_salt, edits))
    return conversations
