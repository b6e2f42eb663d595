"""Request and response bodies of the HTTP API (OpenAI, vLLM extras, SGLang `/generate`), as pydantic models.

Requests ignore unknown fields (clients such as the `openai` package send fields we have no use for, e.g.
`user`), but fields we know and cannot honour are declared and rejected when set to anything other than
their neutral value (`n > 1`, penalties, `logit_bias`, `best_of > 1`, `suffix`): the caller learns at once
that the answer would not be what they asked for. Counts are `StrictInt` so that `"5"` or `5.5` is a type
error (HTTP 400), not silently coerced.

kvsplice extras on both OpenAI endpoints: `cache_salt` (cache namespace), `session_id` (names the
conversation for SCR session matching), `scr` ("on", "off" or an object of per-request settings).
`message_offsets` (completions and /generate): token offsets where the prompt's messages start, so a
hybrid model saves its linear layers' state there; chat completions compute them from the template and
refuse the field.

Size limits (kvsplice.server.limits.RequestLimits) come in through the validation context
(`Model.model_validate(obj, context={"limits": limits})`); without one the static defaults apply and
the message count is unbounded. A message count over the limit is refused before the messages are
validated one by one. An empty stop string is refused whether it comes alone (`"stop": ""`) or in a
list (`"stop": [""]`), as vLLM does: it would match before the first token.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator,
                      model_validator)

from kvsplice.server.limits import RequestLimits


class _Request(BaseModel):
    """Base of request bodies: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


def request_limits(info: ValidationInfo) -> RequestLimits:
    """The limits passed in the validation context, or the static defaults."""
    return (info.context or {}).get("limits") or RequestLimits()


def _check_stop(stop: Union[str, list[str], None], info: ValidationInfo) -> Union[str, list[str], None]:
    """`stop`: at most max_stop entries, each non-empty and at most max_stop_chars characters."""
    if stop is None:
        return stop
    limits = request_limits(info)
    entries = [stop] if isinstance(stop, str) else stop
    if len(entries) > limits.max_stop:
        raise ValueError(f"at most {limits.max_stop} stop strings are allowed, got {len(entries)}")
    for entry in entries:
        if entry == "":
            raise ValueError("stop strings must be non-empty (an empty one would match before the first token)")
        if len(entry) > limits.max_stop_chars:
            raise ValueError(f"a stop string may have at most {limits.max_stop_chars} characters, "
                             f"got {len(entry)}")
    return stop


def _check_stop_token_ids(ids: Optional[list[int]], info: ValidationInfo) -> Optional[list[int]]:
    limit = request_limits(info).max_stop
    if ids is not None and len(ids) > limit:
        raise ValueError(f"at most {limit} stop token ids are allowed, got {len(ids)}")
    return ids


def _check_id(value: Optional[str], info: ValidationInfo) -> Optional[str]:
    """An identifier (`session_id`, `cache_salt`, `rid`): at most max_id_chars characters."""
    limit = request_limits(info).max_id_chars
    if value is not None and len(value) > limit:
        raise ValueError(f"may have at most {limit} characters, got {len(value)}")
    return value


class StreamOptions(_Request):
    """OpenAI `stream_options`: `include_usage` adds a final chunk with `usage` and no choices."""

    include_usage: StrictBool = False


class FunctionCall(BaseModel):
    """`tool_calls[].function`: the name and the JSON-encoded arguments (OpenAI sends a string)."""

    model_config = ConfigDict(extra="allow")
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(BaseModel):
    """One entry of an assistant message's `tool_calls`."""

    model_config = ConfigDict(extra="allow")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    """A part of a list-valued `content`; only text parts are supported (this is a text-only server)."""

    # The document says what is accepted (a text part); validation keeps the clearer error for the rest.
    model_config = ConfigDict(extra="allow", json_schema_extra={"required": ["type", "text"]})
    type: str = Field(json_schema_extra={"enum": ["text"]})
    text: Optional[str] = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text content parts are supported, got a part of type {self.type!r}")
        return self


class ChatMessage(BaseModel):
    """One chat message. Extra fields (e.g. template-specific ones) are kept and passed to the template.

    `reasoning_content` (or `reasoning`) on an assistant message is an earlier turn's reasoning block;
    it is passed to the chat template, which decides whether the rendered history keeps it.
    """

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class _SamplingFields(_Request):
    """Sampling fields shared by chat and completions (OpenAI names plus vLLM extras)."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = None
    max_tokens: Optional[StrictInt] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    scr: Union[str, dict[str, Any], None] = None

    _stop_limits = field_validator("stop")(_check_stop)
    _stop_id_limits = field_validator("stop_token_ids")(_check_stop_token_ids)
    _id_limits = field_validator("cache_salt", "session_id")(_check_id)

    @model_validator(mode="after")
    def _supported(self) -> "_SamplingFields":
        if self.n != 1:
            raise ValueError(f"n: only n=1 is supported, got {self.n}")
        if self.presence_penalty != 0 or self.frequency_penalty != 0:
            raise ValueError("presence_penalty / frequency_penalty: penalties are not supported (use 0)")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens: must be >= 0, got {self.max_tokens}")
        return self


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `max_completion_tokens` (newer OpenAI name) wins over `max_tokens`."""

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Any = None
    message_offsets: Any = None   # refused: the server computes them from the messages

    @field_validator("messages", mode="before")
    @classmethod
    def _message_count(cls, messages: Any, info: ValidationInfo) -> Any:
        limit = request_limits(info).max_messages
        if isinstance(messages, list) and limit is not None and len(messages) > limit:
            raise ValueError(f"at most {limit} messages are allowed, got {len(messages)}")
        return messages

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    @model_validator(mode="after")
    def _chat_checks(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 0:
                raise ValueError(f"max_completion_tokens: must be >= 0, got {self.max_completion_tokens}")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.message_offsets is not None:
            raise ValueError("message_offsets: not accepted on chat completions (the server computes them "
                             "from the messages)")
        return self


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a one-element list of either
    (several prompts in one request are refused with 400: send one request per prompt)."""

    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
        {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "maxItems": 1,
         "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}}]})
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[str] = None
    message_offsets: Optional[list[StrictInt]] = None

    @model_validator(mode="after")
    def _completion_checks(self) -> "CompletionRequest":
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of: only 1 is supported, got {self.best_of}")
        if self.suffix:
            raise ValueError("suffix: not supported")
        return self

    def single_prompt(self) -> Union[str, list[int]]:
        """The one prompt of the request; ValueError for an empty or multi-prompt list."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if isinstance(prompt[0], int):
            return list(prompt)
        if len(prompt) != 1:
            raise ValueError(f"prompt: one prompt per request is supported, got a list of {len(prompt)}")
        return prompt[0]


class GenerateSamplingParams(_Request):
    """SGLang's `sampling_params` object (the subset kvsplice serves)."""

    max_new_tokens: StrictInt = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[StrictInt] = None
    min_p: float = 0.0
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    seed: Optional[StrictInt] = Field(default=None, alias="sampling_seed")

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    _stop_limits = field_validator("stop")(_check_stop)
    _stop_id_limits = field_validator("stop_token_ids")(_check_stop_token_ids)


class GenerateRequest(_Request):
    """SGLang POST /generate: exactly one of `text` or `input_ids`, `sampling_params`, `stream`."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"oneOf": [
        {"required": ["text"], "properties": {"text": {"type": "string"}}},
        {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}}]})

    text: Optional[str] = None
    input_ids: Optional[list[StrictInt]] = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: StrictBool = False
    rid: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    scr: Union[str, dict[str, Any], None] = None
    message_offsets: Optional[list[StrictInt]] = None

    _id_limits = field_validator("rid", "cache_salt", "session_id")(_check_id)

    @model_validator(mode="after")
    def _one_input(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids is required")
        return self


# ----- responses ----------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str = "invalid_request_error"
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer: `{"error": {...}}`."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: cached_tokens = prefix-cached + relocated (SCR) tokens."""

    cached_tokens: int


class Usage(BaseModel):
    """`usage` with kvsplice's `reuse` object (ReuseStats.as_dict(), breakdown also flattened)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    reuse: Optional[dict[str, Any]] = None


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvsplice"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
