"""Request bodies of OpenAI's Responses API (POST /v1/responses), as pydantic models.

As in protocol.py, every field the API defines is declared (docs/COMPATIBILITY.md lists each with its
status) and any other is refused with a 400 naming it; a known field kvsplice cannot honour is refused
unless it has its neutral value.

`input` is a string (one user message) or a list of items:

    {"role": ..., "content": ...}  or  {"type": "message", ...}   a message (user, system, developer,
                                                                   assistant); content a string or
                                                                   input_text / output_text parts
    {"type": "function_call", "call_id", "name", "arguments"}    a call the model made earlier
    {"type": "function_call_output", "call_id", "output"}        its result
    {"type": "reasoning", "summary": [...], "content": [...]}     the model's earlier reasoning
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator

from kvsplice.server.protocol import (FUNCTION_NAME, FunctionDefinition, _check_id, _OpenAIRequest,
                                      _refuse_unless_neutral, check_tool_count, request_limits)
from kvsplice.structured.spec import check_schema


class _Item(BaseModel):
    """Base of input items and their parts: unknown fields are refused (400 naming them)."""

    model_config = ConfigDict(extra="forbid")


class InputText(_Item):
    type: Literal["input_text"]
    text: str


class OutputText(_Item):
    """An earlier reply's text (annotations and logprobs are accepted and not used)."""

    type: Literal["output_text"]
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


class Refusal(_Item):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[Union[InputText, OutputText, Refusal], Field(discriminator="type")]


class MessageItem(_Item):
    """A message; `id` and `status` (as the API echoes them back) are accepted."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.refusal if isinstance(part, Refusal) else part.text for part in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class SummaryText(_Item):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Item):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Item):
    """Earlier reasoning: its text is the content parts' (else the summary's). `encrypted_content`
    is accepted when null (kvsplice never makes it)."""

    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: Optional[list[ReasoningText]] = None
    id: Optional[str] = None
    status: Optional[str] = None
    encrypted_content: Optional[str] = None

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, value: Optional[str]) -> Optional[str]:
        return _refuse_unless_neutral("encrypted reasoning", value)

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "\n".join(part.text for part in parts)


InputItem = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem],
                      Field(discriminator="type")]


class FunctionTool(FunctionDefinition):
    """A function tool (the only kind served: hosted tools such as web search are not): chat's
    function definition, flattened into the tool as the Responses API sends it."""

    type: Literal["function"]


class FunctionChoice(_Item):
    """`tool_choice: {"type": "function", "name": ...}`: call exactly that function."""

    type: Literal["function"]
    name: str


class TextFormat(_Item):
    """`text.format`: plain text, any JSON object, or JSON matching a schema (enforced by grammar)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(default=None, pattern=FUNCTION_NAME)
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[str] = None
    strict: Optional[StrictBool] = None
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, schema: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if schema is not None:
            check_schema(schema, "schema")
        return schema

    def response_format(self) -> dict[str, Any]:
        """The chat `response_format` of this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None or self.name is None:
            raise ValueError("text.format: type json_schema needs a name and a schema")
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_,
                                                       "strict": self.strict}}


class TextConfig(_Item):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["medium"]] = None


class ReasoningConfig(_Item):
    """`reasoning`: `summary` (a summary of the model's reasoning) is accepted and none is written: a
    reasoning item carries the reasoning text itself, in `content` (with a reasoning parser). `effort`
    is refused unless null: the served models have no effort control."""

    effort: Optional[str] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, value: Optional[str]) -> Optional[str]:
        return _refuse_unless_neutral(f"reasoning.effort {value!r}", value)


class ResponsesStreamOptions(_Item):
    include_obfuscation: Optional[StrictBool] = None


class ResponseRequest(_OpenAIRequest):
    """POST /v1/responses."""

    input: Union[str, list[InputItem]]
    model: Optional[str] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[StrictInt] = None
    max_tool_calls: Optional[StrictInt] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[TextConfig] = None
    store: Optional[StrictBool] = None
    previous_response_id: Optional[str] = None
    stream: StrictBool = False
    stream_options: Optional[ResponsesStreamOptions] = None
    include: Optional[list[Literal["reasoning.encrypted_content"]]] = None
    metadata: Optional[dict[str, str]] = None
    reasoning: Optional[ReasoningConfig] = None
    # accepted and ignored: they change nothing about the answer
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    client_metadata: Optional[dict[str, str]] = None
    # accepted at their default
    background: Optional[StrictBool] = None
    service_tier: Optional[str] = None
    truncation: Optional[str] = None
    # refused unless null
    top_logprobs: Optional[Any] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    background_options: Optional[Any] = None
    context_management: Optional[Any] = None
    access_programs: Optional[Any] = None
    image: Optional[Any] = None
    moderation: Optional[Any] = None
    # SGLang extras: as for chat (range-checked there)
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    # kvsplice extras
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    scr: Union[str, dict[str, Any], None] = None

    _id_limits = field_validator("cache_salt", "session_id", "previous_response_id")(_check_id)

    @field_validator("previous_response_id")
    @classmethod
    def _response_id(cls, value: Optional[str]) -> Optional[str]:
        """A response id begins with "resp_" (a malformed one is a 400, as OpenAI answers; an unknown
        one is a 404 when it is looked up)."""
        if value is not None and not value.startswith("resp_"):
            raise ValueError(f"expected an id that begins with 'resp_', got {value!r}")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any, info: ValidationInfo) -> Any:
        """Messages may omit `type`; the item count is bounded like chat messages."""
        if not isinstance(value, list):
            return value
        limit = request_limits(info).max_messages
        if limit is not None and len(value) > limit:
            raise ValueError(f"at most {limit} items are allowed, got {len(value)}")
        return [{"type": "message", **item} if isinstance(item, dict) and "type" not in item else item
                for item in value]

    @field_validator("max_output_tokens")
    @classmethod
    def _positive_budget(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("max_tool_calls")
    @classmethod
    def _positive_calls(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("tools")
    @classmethod
    def _tool_count(cls, tools: Optional[list[FunctionTool]]) -> Optional[list[FunctionTool]]:
        return check_tool_count(tools)

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: Optional[bool]) -> Optional[bool]:
        return _refuse_unless_neutral("background: true", value, (None, False))

    @field_validator("service_tier")
    @classmethod
    def _tier(cls, value: Optional[str]) -> Optional[str]:
        return _refuse_unless_neutral(f"service_tier {value!r}", value, (None, "auto", "default"))

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: Optional[str]) -> Optional[str]:
        return _refuse_unless_neutral(f"truncation {value!r}", value, (None, "disabled"))

    @field_validator("top_logprobs", "conversation", "prompt", "background_options",
                     "context_management", "access_programs", "image", "moderation")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_neutral(info.field_name, value)
