"""Request and response bodies of the HTTP API (OpenAI, vLLM extras, SGLang `/generate`), as pydantic models.

The OpenAI endpoints declare every field they know (docs/COMPATIBILITY.md lists each with its status) and
refuse any other with a 400 naming it: a field that is not honoured is never accepted silently. A known
field kvsplice cannot honour is refused when set to anything but its neutral value (`audio`, `functions`,
`suffix`, ...); a few that change nothing about the answer are accepted and ignored (`user`, `metadata`,
`store: false`). Counts are `StrictInt` so that `"5"` or `5.5` is a type error (HTTP 400), not silently
coerced.

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

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StringConstraints, ValidationInfo,
                      field_validator, model_validator)

from kvsplice.sampling_params import MAX_LOGPROBS
from kvsplice.server.limits import RequestLimits

from kvsplice.structured.spec import canonical_json, check_tool_schema, nesting_depth
from kvsplice.structured.stop_patterns import compile_stop_regex

MAX_N = 16              # choices per request (n, best_of)
MAX_TOOLS = 128         # OpenAI's limit on `tools`
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"   # OpenAI's rule for function and json_schema names
MAX_TEMPLATE_KWARGS = 16   # chat_template_kwargs entries
# variables a chat template gets from the server itself (chat_template_kwargs may not replace them)
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "chat_template",
                                     "tokenize", "continue_final_message", "return_dict"})


class _Request(BaseModel):
    """Base of request bodies: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


def request_limits(info: ValidationInfo) -> RequestLimits:
    """The limits passed in the validation context, or the static defaults."""
    return (info.context or {}).get("limits") or RequestLimits()


def _stop_entries(value: Union[str, list[str]], info: ValidationInfo, noun: str) -> list[str]:
    """`value` (one entry or a list) as a list, each within max_stop_chars and at most max_stop of them."""
    limits = request_limits(info)
    entries = [value] if isinstance(value, str) else value
    if len(entries) > limits.max_stop:
        raise ValueError(f"at most {limits.max_stop} {noun}s are allowed, got {len(entries)}")
    for entry in entries:
        if len(entry) > limits.max_stop_chars:
            raise ValueError(f"a {noun} may have at most {limits.max_stop_chars} characters, got {len(entry)}")
    return entries


def _check_stop(stop: Union[str, list[str], None], info: ValidationInfo) -> Union[str, list[str], None]:
    """`stop`: at most max_stop entries, each non-empty and at most max_stop_chars characters."""
    if stop is not None and "" in _stop_entries(stop, info, "stop string"):
        raise ValueError("stop strings must be non-empty (an empty one would match before the first token)")
    return stop


def _check_stop_regex(patterns: Union[str, list[str], None], info: ValidationInfo) -> Union[str, list[str], None]:
    """SGLang's `stop_regex`: at most max_stop patterns of at most max_stop_chars characters, each one
    that compiles and cannot match the empty string."""
    for entry in _stop_entries(patterns, info, "stop regex") if patterns is not None else ():
        compile_stop_regex(entry)
    return patterns


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


class _OpenAIRequest(_Request):
    """Base of the OpenAI request bodies: a field that is not declared is refused (400 naming it)."""

    model_config = ConfigDict(extra="forbid")


def check_tool_count(tools: Optional[list]) -> Optional[list]:
    """`tools` unchanged; ValueError past MAX_TOOLS (every protocol's `tools` has the same bound)."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    return tools


def _refuse_unless_neutral(name: str, value: Any, neutral: tuple = (None,)) -> Any:
    if value not in neutral:
        raise ValueError(f"{name} is not supported by this server (see docs/COMPATIBILITY.md)")
    return value


class StreamOptions(_OpenAIRequest):
    """OpenAI `stream_options`: `include_usage` adds a final chunk with `usage` and no choices;
    `include_obfuscation` (random padding against side channels) is accepted and not needed here;
    vLLM's `continuous_usage_stats` (with include_usage) puts the usage so far on every chunk too."""

    include_usage: StrictBool = False
    include_obfuscation: Optional[StrictBool] = None
    continuous_usage_stats: StrictBool = False


class FunctionDefinition(_OpenAIRequest):
    """`tools[].function`: the name, what it does, the JSON schema of its arguments, `strict`
    (arguments always match the schema when the call is grammar-forced, strict or not)."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, parameters: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if parameters is not None:
            check_tool_schema(parameters, "parameters")
        return parameters


class Tool(_OpenAIRequest):
    """One entry of `tools` (function tools only)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_OpenAIRequest):
    name: str


class NamedToolChoice(_OpenAIRequest):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call exactly that function."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_OpenAIRequest):
    """`response_format.json_schema`: a name, the schema, `strict` (enforced either way)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(_OpenAIRequest):
    """`response_format`: text (no constraint), any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        return self


class StructuredOutputs(_OpenAIRequest):
    """vLLM's `structured_outputs` object: exactly one of its constraints."""

    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[StrictBool] = None
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


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
    # the five OpenAI roles, or a custom one (vLLM passes any role name to the chat template, which
    # renders it or refuses it: a template error is a 400)
    role: Union[Literal["system", "developer", "user", "assistant", "tool"],
                Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class _SamplingFields(_OpenAIRequest):
    """Fields shared by chat and completions (OpenAI names, vLLM extras, kvsplice extras)."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = None
    max_tokens: Optional[StrictInt] = None
    min_tokens: StrictInt = 0
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    seed: Optional[StrictInt] = Field(default=None, ge=-2**63, le=2**63 - 1)   # int64, as OpenAI and vLLM
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[ResponseFormat] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[Literal["xgrammar", "auto"]] = None
    structured_outputs: Optional[StructuredOutputs] = None
    user: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    scr: Union[str, dict[str, Any], None] = None
    # vLLM extras on the prompt and the answer
    truncate_prompt_tokens: Optional[StrictInt] = None
    truncation_side: Optional[Literal["left", "right"]] = None  # left (default): keep the prompt's end
    prompt_logprobs: Optional[StrictInt] = None
    return_token_ids: StrictBool = False
    # vLLM extras on sampling and logprobs: a whitelist of the tokens sampled, the tokens whose logprobs are
    # reported (in place of the most likely ones), logprob tokens written "token_id:N"; no beam search
    allowed_token_ids: Optional[list[StrictInt]] = None
    logprob_token_ids: Optional[list[StrictInt]] = None
    return_tokens_as_token_ids: StrictBool = False
    use_beam_search: Optional[StrictBool] = None
    # SGLang extras: `regex` is guided_regex under SGLang's name; regex stops are not supported
    regex: Optional[str] = None
    stop_regex: Union[str, list[str], None] = None
    # SGLang fields sglang-router adds to every request it forwards, at their defaults (those are what
    # kvsplice does); any other value is refused
    no_stop_trim: Optional[StrictBool] = None
    continue_final_message: Optional[StrictBool] = None
    separate_reasoning: Optional[StrictBool] = None
    stream_reasoning: Optional[StrictBool] = None
    return_hidden_states: Optional[StrictBool] = None

    _stop_limits = field_validator("stop")(_check_stop)
    _stop_id_limits = field_validator("stop_token_ids")(_check_stop_token_ids)
    _id_limits = field_validator("cache_salt", "session_id")(_check_id)

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, value: Optional[bool]) -> Optional[bool]:
        return _refuse_unless_neutral("use_beam_search: true (beam search)", value, (None, False))

    @field_validator("no_stop_trim", "return_hidden_states")
    @classmethod
    def _sglang_off(cls, value: Optional[bool], info) -> Optional[bool]:
        return _refuse_unless_neutral(f"{info.field_name}: true", value, (None, False))

    @field_validator("separate_reasoning", "stream_reasoning")
    @classmethod
    def _sglang_on(cls, value: Optional[bool], info) -> Optional[bool]:
        return _refuse_unless_neutral(f"{info.field_name}: false", value, (None, True))

    _stop_regex_limits = field_validator("stop_regex")(_check_stop_regex)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, tokens: Optional[int]) -> Optional[int]:
        if tokens is not None and tokens != -1 and tokens < 1:
            raise ValueError(f"must be -1 (the context limit) or an int >= 1, got {tokens}")
        return tokens

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_SamplingFields":
        # OpenAI and vLLM refuse them too: they would otherwise be accepted and do nothing
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> "_SamplingFields":
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream=true")
        return self

    @field_validator("n")
    @classmethod
    def _n_in_range(cls, n: int) -> int:
        if not 1 <= n <= MAX_N:
            raise ValueError(f"must be in [1, {MAX_N}], got {n}")
        return n

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_not_negative(cls, max_tokens: Optional[int]) -> Optional[int]:
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"must be >= 0, got {max_tokens}")
        return max_tokens


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `max_completion_tokens` (newer OpenAI name) wins over `max_tokens`.
    `add_generation_prompt` (default true) opens the assistant's turn after the messages;
    `continue_final_message` (vLLM) instead leaves the final message, an assistant one, open for the
    reply to continue (assistant prefill); both true is refused."""

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: StrictBool = True
    # accepted and ignored: they change nothing about the answer
    metadata: Optional[dict[str, str]] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    store: Optional[StrictBool] = None
    service_tier: Optional[str] = None
    modalities: Optional[list[str]] = None
    # refused unless null
    audio: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    verbosity: Optional[Any] = None
    web_search_options: Optional[Any] = None
    moderation: Optional[Any] = None
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

    @field_validator("tools")
    @classmethod
    def _tool_count(cls, tools: Optional[list[Tool]]) -> Optional[list[Tool]]:
        return check_tool_count(tools)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kwargs: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if kwargs is None:
            return kwargs
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_NAMES)
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be set here (the server sets them)")
        if len(kwargs) > MAX_TEMPLATE_KWARGS or nesting_depth(kwargs) > 4 or len(canonical_json(kwargs)) > 4096:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} variables, 4 levels deep, 4 KiB as JSON")
        return kwargs

    @field_validator("audio", "functions", "function_call", "prediction", "reasoning_effort", "verbosity",
                     "web_search_options", "moderation")
    @classmethod
    def _refused(cls, value: Any, info) -> Any:
        hint = {"functions": " (use tools)", "function_call": " (use tool_choice)"}.get(info.field_name, "")
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported by this server{hint} (see docs/COMPATIBILITY.md)")
        return value

    @field_validator("store")
    @classmethod
    def _no_store(cls, store: Optional[bool]) -> Optional[bool]:
        return _refuse_unless_neutral("store: true (stored completions)", store, (None, False))

    @field_validator("service_tier")
    @classmethod
    def _tier(cls, tier: Optional[str]) -> Optional[str]:
        return _refuse_unless_neutral(f"service_tier {tier!r}", tier, (None, "auto", "default"))

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, modalities: Optional[list[str]]) -> Optional[list[str]]:
        if modalities is not None and set(modalities) - {"text"}:
            raise ValueError("only the text modality is supported")
        return modalities

    @model_validator(mode="after")
    def _chat_checks(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 0:
                raise ValueError(f"max_completion_tokens: must be >= 0, got {self.max_completion_tokens}")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            # checked here, not by SamplingParams, which knows the count only as `logprobs`
            raise ValueError(f"top_logprobs: must be an int in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if self.message_offsets is not None:
            raise ValueError("message_offsets: not accepted on chat completions (the server computes them "
                             "from the messages)")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message: cannot be combined with add_generation_prompt: true "
                                 "(set add_generation_prompt to false to continue the final message)")
            if self.messages[-1].role != "assistant":
                raise ValueError(f"continue_final_message: the final message must be an assistant message, "
                                 f"got role {self.messages[-1].role!r}")
        return self


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of either (a batch: at
    most `max_prompts` prompts, each answered with its own `n` choices). `best_of` may only repeat `n`
    (choosing the best of more choices than are returned is not supported)."""

    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1,
         "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}}]})
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[str] = None
    message_offsets: Optional[list[StrictInt]] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_count(cls, prompt: Any, info: ValidationInfo) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("must not be empty")
        limit = request_limits(info).max_prompts
        if isinstance(prompt, list) and not isinstance(prompt[0], int) and len(prompt) > limit:
            raise ValueError(f"at most {limit} prompts per request are allowed, got {len(prompt)}")
        return prompt

    @field_validator("continue_final_message")
    @classmethod
    def _no_chat_message(cls, value: Optional[bool]) -> Optional[bool]:
        return _refuse_unless_neutral("continue_final_message: true (there is no chat message to continue)",
                                      value, (None, False))

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: Optional[str]) -> Optional[str]:
        return _refuse_unless_neutral("suffix (insertion)", suffix, (None, ""))

    @model_validator(mode="after")
    def _completion_checks(self) -> "CompletionRequest":
        if self.best_of not in (None, self.n):
            raise ValueError(f"best_of: only best_of == n is supported, got best_of={self.best_of}, n={self.n}")
        if self.message_offsets is not None and len(self.prompts()) > 1:
            raise ValueError("message_offsets: only with a single prompt (they index one prompt's tokens)")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """The request's prompts in order: one for a string or a list of token ids, else the list's entries."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


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
    stop_regex: Union[str, list[str], None] = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    _stop_limits = field_validator("stop")(_check_stop)
    _stop_regex_limits = field_validator("stop_regex")(_check_stop_regex)
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
