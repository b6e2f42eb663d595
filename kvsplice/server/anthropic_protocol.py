"""Request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as pydantic
models, and its error body.

As in protocol.py, every field the API defines is declared (docs/COMPATIBILITY.md lists each with its
status) and any other is refused with a 400 naming it. Content blocks are text, tool_use, tool_result
and thinking (an earlier turn's reasoning); image, document and server-tool blocks are refused (the
server is text only). `cache_control` is accepted wherever Anthropic allows it and changes nothing:
kvsplice caches every prompt.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator

from kvsplice.server.protocol import (FUNCTION_NAME, _check_id, _check_stop, _refuse_unless_neutral, check_tool_count,
                                      request_limits)
from kvsplice.structured.spec import check_schema, check_tool_schema


class _Strict(BaseModel):
    """Unknown fields are refused (400 naming them)."""

    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    """Accepted and ignored: every prompt is cached."""

    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None
    citations: Optional[list[Any]] = None

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, value: Optional[list[Any]]) -> Optional[list[Any]]:
        return _refuse_unless_neutral("citations", value, (None, []))


class ToolUseBlock(_Strict):
    """A call the model made earlier: its id, the tool's name and its input object."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolResultBlock(_Strict):
    """A tool's result for the call `tool_use_id`; `is_error` marks a failed call (its text is given to
    the model prefixed with "Error: ")."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: Optional[StrictBool] = None
    cache_control: Optional[CacheControl] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            text = "\n".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Strict):
    """An earlier turn's reasoning (passed to the chat template as the assistant's reasoning_content)."""

    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


class Message(_Strict):
    """A turn of the conversation. `system` (which Claude Code sends mid-conversation, e.g. for a
    reminder) holds text only; anthropic.py gives it to the chat template as a system turn, folded into
    the neighbouring user turn where the template cannot show one there (chat.py)."""

    role: Literal["user", "assistant", "system"]
    content: Union[str, list[ContentBlock]]

    @field_validator("content")
    @classmethod
    def _system_is_text(cls, content: Any, info: ValidationInfo) -> Any:
        if info.data.get("role") == "system" and not isinstance(content, str):
            kinds = sorted({block.type for block in content if not isinstance(block, TextBlock)})
            if kinds:
                raise ValueError(f"a system message holds text blocks only, got {', '.join(kinds)}")
        return content


class Tool(_Strict):
    """A client tool: its name, what it does, the JSON schema of its input."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    strict: Optional[StrictBool] = None
    cache_control: Optional[CacheControl] = None

    @field_validator("input_schema")
    @classmethod
    def _bounded(cls, schema: dict[str, Any]) -> dict[str, Any]:
        check_tool_schema(schema, "input_schema")
        return schema


class ToolChoice(_Strict):
    """auto (the model decides), any (at least one call), tool (that tool, once), none (no call)."""

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[StrictBool] = None


class Metadata(_Strict):
    user_id: Optional[str] = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, schema: dict[str, Any]) -> dict[str, Any]:
        check_schema(schema, "schema")
        return schema


class OutputConfig(_Strict):
    """`format`: the reply is JSON matching the schema (constrained decoding); `effort` only at
    Anthropic's default, `high` (the served models have no effort control)."""

    format: Optional[JsonOutputFormat] = None
    effort: Optional[str] = None

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, value: Optional[str]) -> Optional[str]:
        return _refuse_unless_neutral(f"effort {value!r}", value, (None, "high"))


class ContextEdit(_Strict):
    """One server-side context edit. Only `clear_thinking_20251015` keeping every thinking turn (`keep:
    "all"`) is accepted: it edits nothing. An edit that would clear content is refused."""

    type: str
    keep: Optional[Any] = None
    model_config = ConfigDict(extra="allow")

    def is_neutral(self) -> bool:
        return self.type.startswith("clear_thinking_") and self.keep == "all" and not self.model_extra


class ContextManagement(_Strict):
    """`context_management`: server-side edits of the prompt; only edits that change nothing."""

    edits: list[ContextEdit] = Field(default_factory=list)

    @field_validator("edits")
    @classmethod
    def _neutral_edits(cls, edits: list[ContextEdit]) -> list[ContextEdit]:
        for edit in edits:
            if not edit.is_neutral():
                raise ValueError(f"context edit {edit.type!r} (other than clear_thinking with keep \"all\") is not "
                                 f"supported by this server (see docs/COMPATIBILITY.md)")
        return edits


class _MessagesFields(_Strict):
    """Fields shared by /v1/messages and /v1/messages/count_tokens."""

    model: str
    messages: list[Message] = Field(json_schema_extra={"minItems": 1})
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[CacheControl] = None
    thinking: Optional[dict[str, Any]] = None
    context_management: Optional[ContextManagement] = None
    speed: Optional[str] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None

    @field_validator("messages", mode="before")
    @classmethod
    def _message_count(cls, messages: Any, info: ValidationInfo) -> Any:
        limit = request_limits(info).max_messages
        if isinstance(messages, list) and limit is not None and len(messages) > limit:
            raise ValueError(f"at most {limit} messages are allowed, got {len(messages)}")
        if isinstance(messages, list) and not messages:
            raise ValueError("must contain at least one message")
        return messages

    @field_validator("tools")
    @classmethod
    def _tool_count(cls, tools: Optional[list[Tool]]) -> Optional[list[Tool]]:
        return check_tool_count(tools)

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        return _refuse_unless_neutral("thinking (other than disabled or adaptive)", value,
                                      (None, {"type": "disabled"}, {"type": "adaptive"}))

    @field_validator("speed")
    @classmethod
    def _standard(cls, value: Optional[str]) -> Optional[str]:
        return _refuse_unless_neutral(f"speed {value!r}", value, (None, "standard"))

    @field_validator("user_profile_id", "workspace_id")
    @classmethod
    def _refused(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        return _refuse_unless_neutral(info.field_name, value)


class MessagesRequest(_MessagesFields):
    """POST /v1/messages. `max_tokens` is required, as in Anthropic's API."""

    max_tokens: StrictInt
    stop_sequences: Optional[list[str]] = None
    stream: StrictBool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None
    metadata: Optional[Metadata] = None
    service_tier: Optional[str] = None
    container: Optional[Any] = None
    diagnostics: Optional[Any] = None
    inference_geo: Optional[Any] = None
    # kvsplice extras
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    scr: Union[str, dict[str, Any], None] = None

    _stop_limits = field_validator("stop_sequences")(_check_stop)
    _id_limits = field_validator("cache_salt", "session_id")(_check_id)

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("temperature")
    @classmethod
    def _unit_temperature(cls, value: Optional[float]) -> Optional[float]:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"must be in [0, 1], got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _positive_top_k(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("service_tier")
    @classmethod
    def _tier(cls, value: Optional[str]) -> Optional[str]:
        return _refuse_unless_neutral(f"service_tier {value!r}", value, (None, "auto", "standard_only"))

    @field_validator("container", "diagnostics", "inference_geo")
    @classmethod
    def _refused_extra(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_neutral(info.field_name, value)


class CountTokensRequest(_MessagesFields):
    """POST /v1/messages/count_tokens: the prompt a /v1/messages request of these fields would have."""


class ErrorDetail(BaseModel):
    """Anthropic's error object, plus the field at fault (`param`) and kvsplice's `code`."""

    type: str
    message: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class AnthropicError(BaseModel):
    """The body of every 4xx and 5xx on the Messages routes: {"type": "error", "error": {...}}."""

    type: Literal["error"] = "error"
    error: ErrorDetail
