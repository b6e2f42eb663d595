"""Chat messages -> prompt token ids through a chat template, and reasoning blocks in replies.

    ChatMessages ─message_dicts─> plain dicts ─ChatRenderer._for_template─> what the template can take
        ─the chat template (the model's, or --chat-template)─> prompt text ─> token ids

Messages reach the template as plain dicts, shaped the way HF chat templates expect them
(`message_dicts`):
- list-valued `content` (text parts) is joined into one string;
- assistant `tool_calls[].function.arguments`, a JSON string in the OpenAI API, is parsed into an object
  (templates such as Qwen's and Llama 3's render it with `tojson`; vLLM does the same conversion);
  a string that is not JSON is passed through unchanged;
- `reasoning` (vLLM's newer name) is copied to `reasoning_content` (the name templates read).

Then `ChatRenderer` normalises what a template cannot take, judged from its source:
- `developer` (OpenAI's newer name for system) becomes `system`; content None becomes "";
- call ids are made what the tool parser's family wants (Mistral: 9 letters and digits), in both the
  assistant's `tool_calls` and the tool messages' `tool_call_id`;
- a template that never mentions `tool_calls` gets the calls written into the assistant's content in
  the tool parser's syntax; one that never mentions `tools` gets the tool definitions in the system
  message (the parser's instructions, Hermes-style by default);
- a template that rejects `tool` messages gets them as user turns wrapped in <tool_response>;
- a system message after the first message stays a system turn where the template renders it, else it
  is folded into the neighbouring user turn (late_system.py).
A template that still fails is a ChatTemplateError (HTTP 400) naming the first message it rejects.

Reasoning blocks in replies: with a reasoning parser (`<think>` ... `</think>`), `split_reasoning` moves the
block out of the reply text into `reasoning_content`, as vLLM's reasoning parsers and DeepSeek's API do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from kvsplice.message_offsets import message_offsets
from kvsplice.server.late_system import fold_late_systems, late_system_indices, shows_late_systems
from kvsplice.server.protocol import ChatMessage
from kvsplice.server.tool_parsers import ToolParser, detect_parser
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


class ChatTemplateError(ValueError):
    """The chat template rejected the messages; `param` names the first message it rejects
    (`messages[i]`), or is `messages` when no single message is to blame."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file's contents, or the value itself when it is a template (contains
    `{%` or `{{`). ValueError when it is neither, or is not valid Jinja."""
    import jinja2

    try:
        is_file = Path(value).expanduser().is_file()
    except (OSError, ValueError):  # a template too long, or with a NUL byte, to be a path
        is_file = False
    if is_file:
        source = Path(value).expanduser().read_text()
    elif "{%" in value or "{{" in value:
        source = value
    else:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"--chat-template: not a valid Jinja template: {error} (line {error.lineno})") from error
    return source


def _template_source(tokenizer: Tokenizer, override: Optional[str]) -> Optional[str]:
    """The template text that will render chats (a dict of named templates joined), or None."""
    if override is not None:
        return override
    template = getattr(tokenizer.backend, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template


@dataclass(frozen=True)
class _Rendering:
    """One chat as the template saw it: the normalised dicts, the tools and extra variables passed, the text."""

    dicts: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]]
    extra: dict[str, Any]
    text: str


class ChatRenderer:
    """Renders chats through one template: the model's, or `template` (--chat-template). `parser`:
    the tool-call syntax used where the template has none (default: detected from the template)."""

    def __init__(self, tokenizer: Tokenizer, template: Optional[str] = None, parser: Optional[ToolParser] = None):
        self.tokenizer = tokenizer
        self.template = template
        self.source = _template_source(tokenizer, template)
        self.parser = parser or detect_parser(self.source)
        self.renders_tools = "tools" in (self.source or "")
        self.renders_tool_calls = "tool_calls" in (self.source or "")

    def prompt_ids(self, messages: list[ChatMessage], tools: Optional[list[dict[str, Any]]] = None,
                   template_kwargs: Optional[dict[str, Any]] = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False) -> list[int]:
        """Token ids of the chat (the template adds any BOS): with the assistant's turn opened
        (`add_generation_prompt`), or with the final (assistant) message left open to be continued
        (`continue_final_message`: no end-of-turn after it, no new turn)."""
        text = self.render(messages, tools, template_kwargs, add_generation_prompt, continue_final_message)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(self, messages: list[ChatMessage], tools: Optional[list[dict[str, Any]]] = None,
               template_kwargs: Optional[dict[str, Any]] = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> str:
        """The prompt text; `template_kwargs` are extra template variables (e.g. Qwen 3's
        enable_thinking). Raises ValueError without a chat template, ChatTemplateError when the
        template rejects the messages (or, continuing the final message, does not show it)."""
        return self._rendering(messages, tools, template_kwargs, add_generation_prompt, continue_final_message).text

    def message_offsets(self, messages: list[ChatMessage], prompt_ids: list[int],
                        tools: Optional[list[dict[str, Any]]] = None,
                        template_kwargs: Optional[dict[str, Any]] = None, add_generation_prompt: bool = True,
                        continue_final_message: bool = False) -> list[int]:
        """Offsets into `prompt_ids` (this chat as `prompt_ids()` rendered it) where each message
        after the first and the reply start, verified against the tokens (`kvsplice.message_offsets`),
        rendered exactly as the prompt was: this template, the normalised messages, the same ending."""
        rendering = self._rendering(messages, tools, template_kwargs, add_generation_prompt, continue_final_message)

        def render(prefix, add_generation_prompt: bool) -> str:
            if add_generation_prompt and len(prefix) == len(rendering.dicts):
                return rendering.text     # the whole chat: as the prompt ends
            return self._apply(list(prefix), rendering.tools, {**rendering.extra,
                                                               "add_generation_prompt": add_generation_prompt})

        return message_offsets(self.tokenizer, rendering.dicts, prompt_ids, render=render)

    def _rendering(self, messages: list[ChatMessage], tools: Optional[list[dict[str, Any]]],
                   template_kwargs: Optional[dict[str, Any]], add_generation_prompt: bool,
                   continue_final_message: bool = False) -> "_Rendering":
        """The template-ready dicts that render (tool messages become user turns where the template
        rejects them), the tools and variables passed to the template, and the text (cut after the
        final message's content when it is continued)."""
        rendering = self._rendering_whole(messages, tools, template_kwargs,
                                          add_generation_prompt and not continue_final_message)
        if not continue_final_message:
            return rendering
        return dataclasses.replace(rendering, text=self._continued(rendering))

    def _continued(self, rendering: "_Rendering") -> str:
        """The chat's text up to the end of its final message's content (as transformers'
        continue_final_message cuts it: the last occurrence, else that of the stripped content); an
        empty final message continues from where its turn opens."""
        final = rendering.dicts[-1]["content"]
        if not final.strip():
            return self._apply(rendering.dicts[:-1], rendering.tools,
                               {**rendering.extra, "add_generation_prompt": True})
        for content in (final, final.strip()):
            cut = rendering.text.rfind(content)
            if cut >= 0:
                return rendering.text[:cut + len(content)]
        raise ChatTemplateError("continue_final_message: the chat template does not show the final message's "
                                "content, so it cannot be continued", param="continue_final_message")

    def _rendering_whole(self, messages: list[ChatMessage], tools: Optional[list[dict[str, Any]]],
                         template_kwargs: Optional[dict[str, Any]], add_generation_prompt: bool) -> "_Rendering":
        if self.source is None or not hasattr(self.tokenizer.backend, "apply_chat_template"):
            raise ValueError("this model has no chat template; use the completions endpoint with a raw prompt, "
                             "or give one with --chat-template")
        dicts, origins = self._for_template(message_dicts(messages), tools)
        template_tools = tools if (tools and self.renders_tools) else None
        extra = {**(template_kwargs or {}), "add_generation_prompt": add_generation_prompt}
        if not late_system_indices(dicts):
            return self._rendering_of(dicts, origins, template_tools, extra)
        with contextlib.suppress(ChatTemplateError):
            rendering = self._rendering_of(dicts, origins, template_tools, extra)
            if shows_late_systems(rendering.dicts, rendering.text):
                return rendering
        return self._rendering_of(*fold_late_systems(dicts, origins), template_tools, extra)

    def _rendering_of(self, dicts: list[dict[str, Any]], origins, template_tools, extra) -> "_Rendering":
        """The rendering of `dicts`, with tool messages as user turns where the template rejects them."""
        try:
            return _Rendering(dicts, template_tools, extra, self._apply(dicts, template_tools, extra))
        except ChatTemplateError as first_error:
            if not any(d["role"] == "tool" for d in dicts):
                raise self._blame(dicts, origins, template_tools, extra, first_error) from None
        dicts = [self._tool_as_user(d) if d["role"] == "tool" else d for d in dicts]
        try:
            return _Rendering(dicts, template_tools, extra, self._apply(dicts, template_tools, extra))
        except ChatTemplateError as error:
            raise self._blame(dicts, origins, template_tools, extra, error) from None

    def _apply(self, dicts: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]], extra: dict[str, Any]) -> str:
        try:
            return self.tokenizer.backend.apply_chat_template(
                dicts, tools=tools, chat_template=self.template, tokenize=False, **extra)
        except Exception as error:  # jinja2 raises TemplateError subclasses and plain exceptions
            raise ChatTemplateError(f"the chat template rejected the messages: {error}") from error

    def _blame(self, dicts, origins, tools, extra, error: ChatTemplateError) -> ChatTemplateError:
        """`error`, naming the first message whose addition makes the template fail the same way
        (a shorter chat may fail for another reason: a template that wants a user turn after the
        system one). Unchanged when no client message is to blame."""
        for count in range(1, len(dicts) + 1):
            try:
                self._apply(dicts[:count], tools, extra)
            except ChatTemplateError as prefix_error:
                if str(prefix_error) != str(error) or origins[count - 1] is None:
                    continue
                index, role = origins[count - 1]
                return ChatTemplateError(f"the chat template rejected messages[{index}] (role {role}): "
                                         f"{prefix_error.__cause__ or prefix_error}", param=f"messages[{index}]")
        return error

    def _for_template(self, dicts: list[dict[str, Any]], tools):
        """Normalised dicts and, for each, (index, role) of the client's message it came from (None
        for a system message added to carry the tools)."""
        out = [self._normalise(d) for d in dicts]
        origins: list[Optional[tuple[int, str]]] = [(i, d["role"]) for i, d in enumerate(dicts)]
        if tools and not self.renders_tools:
            prompt = self.parser.tools_prompt(tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + prompt).lstrip()}
            else:
                out.insert(0, {"role": "system", "content": prompt})
                origins.insert(0, None)
        return out, origins

    def _normalise(self, message: dict[str, Any]) -> dict[str, Any]:
        entry = dict(message)
        if entry["role"] == "developer":
            entry["role"] = "system"
        if entry.get("content") is None:
            entry["content"] = ""
        if entry.get("tool_call_id") is not None:
            entry["tool_call_id"] = self.parser.normalise_call_id(entry["tool_call_id"])
        calls = entry.get("tool_calls")
        if calls:
            calls = [{**call, "id": self.parser.normalise_call_id(call["id"])} if call.get("id") else call
                     for call in calls]
            if self.renders_tool_calls:
                entry["tool_calls"] = calls
            else:
                del entry["tool_calls"]
                entry["content"] += ("\n" if entry["content"] else "") + self.parser.render_calls(calls)
        return entry

    @staticmethod
    def _tool_as_user(message: dict[str, Any]) -> dict[str, Any]:
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[ChatMessage],
                    tools: Optional[list[dict[str, Any]]] = None, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
    """Token ids of the chat through the model's own template (see ChatRenderer), with the assistant's
    turn opened unless `add_generation_prompt` is False. The template writes the special tokens it
    wants; `add_special_tokens` adds the tokenizer's own (e.g. BOS) on top, as vLLM's /tokenize may."""
    text = ChatRenderer(tokenizer).render(messages, tools, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_message_offsets(tokenizer: Tokenizer, messages: list[ChatMessage], prompt_ids: list[int],
                         tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """Offsets into `prompt_ids` (this chat as `chat_prompt_ids` rendered it) where each message after
    the first and the reply start, each verified against the tokens (`kvsplice.message_offsets`)."""
    return ChatRenderer(tokenizer).message_offsets(messages, prompt_ids, tools or None)


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
