"""Chat messages -> prompt token ids through the model's chat template, and reasoning blocks in replies.

Messages reach the template as plain dicts, shaped the way HF chat templates expect them:
- list-valued `content` (text parts) is joined into one string;
- assistant `tool_calls[].function.arguments`, a JSON string in the OpenAI API, is parsed into an object
  (templates such as Qwen's and Llama 3's render it with `tojson`; vLLM does the same conversion);
  a string that is not JSON is passed through unchanged;
- `reasoning` (vLLM's newer name) is copied to `reasoning_content` (the name templates read).

Reasoning blocks in replies: with a reasoning parser (`<think>` ... `</think>`), `split_reasoning` moves the
block out of the reply text into `reasoning_content`, as vLLM's reasoning parsers and DeepSeek's API do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from kvsplice.message_offsets import message_offsets
from kvsplice.server.protocol import ChatMessage
from kvsplice.tokenizer import Tokenizer

THINK_START = "<think>"
THINK_END = "</think>"


def _content_text(content: Any) -> Optional[str]:
    """A message's content as one string (text parts joined) or None."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _tool_call_dict(call) -> dict[str, Any]:
    """One tool call as the template sees it: arguments parsed from JSON when they are JSON."""
    entry = call.model_dump(exclude_none=True)
    arguments = entry["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            entry["function"]["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return entry


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as template-ready dicts (see the module docstring for the conversions).

    Extra fields a client put on a message are kept; None-valued fields are dropped.
    """
    out = []
    for message in messages:
        entry = message.model_dump(exclude_none=True)
        entry["content"] = _content_text(message.content)
        if message.tool_calls:
            entry["tool_calls"] = [_tool_call_dict(call) for call in message.tool_calls]
        if message.reasoning is not None and message.reasoning_content is None:
            entry["reasoning_content"] = message.reasoning
        out.append(entry)
    return out


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[ChatMessage],
                    tools: Optional[list[dict[str, Any]]] = None, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
    """Token ids of the chat, rendered by the model's template (with the assistant's turn opened unless
    `add_generation_prompt` is False). The template writes the special tokens it wants;
    `add_special_tokens` adds the tokenizer's own (e.g. BOS) on top, as vLLM's /tokenize may.

    Raises ValueError when the model has no chat template or the template rejects the messages.
    """
    text = tokenizer.render_chat(message_dicts(messages), tools=tools or None,
                                 add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_message_offsets(tokenizer: Tokenizer, messages: list[ChatMessage], prompt_ids: list[int],
                         tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """Offsets into `prompt_ids` (this chat as `chat_prompt_ids` rendered it) where each message after
    the first and the reply start, each verified against the tokens (`kvsplice.message_offsets`)."""
    return message_offsets(tokenizer, message_dicts(messages), prompt_ids, tools or None)


@dataclass(frozen=True)
class SplitReply:
    """A reply split into its reasoning block (None if there was none) and the visible content."""

    reasoning_content: Optional[str]
    content: str


def split_reasoning(text: str, start: str = THINK_START, end: str = THINK_END) -> SplitReply:
    """Move a leading `start ... end` block out of `text`.

    The block may lack `start` (templates that open `<think>` in the prompt, e.g. Qwen3 / DeepSeek-R1):
    then everything before the first `end` is reasoning. No `end` at all: a text starting with `start` is
    all reasoning (the reply was cut off while thinking), any other text is all content.
    """
    stripped = text.lstrip()
    has_start = stripped.startswith(start)
    body = stripped[len(start):] if has_start else text
    cut = body.find(end)
    if cut < 0:
        return SplitReply(body, "") if has_start else SplitReply(None, text)
    return SplitReply(body[:cut].strip(), body[cut + len(end):].lstrip())


class ReasoningStream:
    """Incremental `split_reasoning` for streamed text: feed deltas, get (reasoning delta, content delta).

    Holds back text that could still be the beginning of `start`/`end` so a tag split across tokens is
    never emitted as content.
    """

    def __init__(self, start: str = THINK_START, end: str = THINK_END):
        self.start, self.end = start, end
        self._buffer = ""
        self._state = "undecided"  # -> "reasoning" -> "content"

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Add `delta`; return the (reasoning, content) text that is now safe to emit.
        `final=True` flushes everything held back."""
        self._buffer += delta
        reasoning, content = "", ""
        if self._state == "undecided":
            probe = self._buffer.lstrip()
            if probe.startswith(self.start):
                self._state, self._buffer = "reasoning", probe[len(self.start):]
            elif self.start.startswith(probe) and not final:
                return "", ""
            else:
                self._state = "content"
        if self._state == "reasoning":
            cut = self._buffer.find(self.end)
            if cut >= 0:
                reasoning = self._buffer[:cut]
                self._buffer = self._buffer[cut + len(self.end):].lstrip()
                self._state = "content"
            else:
                keep = 0 if final else _partial_suffix(self._buffer, self.end)
                reasoning, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                return reasoning, ""
        if self._state == "content":
            content, self._buffer = self._buffer, ""
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
