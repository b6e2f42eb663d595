"""Request fields -> what the engine runs: the completion budget, the prompt ids' check, SamplingParams
from OpenAI's sampling fields (and from SGLang's `sampling_params`), and the structured constraint on
the reply (tools forced by grammar, response_format, guided_*). Every refusal is a 400 naming the
field it came from."""

from __future__ import annotations

from typing import Optional

from kvsplice.sampling_params import SamplingParams
from kvsplice.server import protocol as p
from kvsplice.server.constraints import ConstraintError, reply_constraint
from kvsplice.server.errors import ApiError, bad_request
from kvsplice.server.state import ServerState
from kvsplice.server.tools import ToolPlan, ToolRequestError, plan_tools
from kvsplice.structured.grammar import GrammarBusyError
from kvsplice.structured.spec import StructuredSpec

# The fields a constraint on the reply may come from, in the order they are looked for.
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "regex", "guided_choice", "guided_grammar",
                     "structured_outputs")


def max_tokens(state: ServerState, prompt_len: int, requested: Optional[int], prompt_param: str,
               budget_param: str = "max_tokens") -> int:
    """The completion budget: `requested`, or the rest of the context (at most the model's generation_config
    `max_new_tokens`, where it sets one); 400 (with the numbers) if the prompt
    does not fit (naming `prompt_param`, the field that holds the prompt) or prompt + requested exceeds
    the context (naming `budget_param`, the field that holds `requested`)."""
    limit = state.context_limit
    if prompt_len >= limit:
        raise ApiError(400, f"the prompt has {prompt_len} tokens but this model's context limit is {limit} "
                            f"tokens (prompt + completion); shorten the prompt", param=prompt_param,
                       code="context_length_exceeded")
    if requested is None:
        default = state.engine.tokenizer.max_new_tokens
        return limit - prompt_len if default is None else min(limit - prompt_len, default)
    if prompt_len + requested > limit:
        raise ApiError(400, f"the prompt ({prompt_len} tokens) plus {budget_param} ({requested}) exceeds this "
                            f"model's context limit of {limit} tokens", param=budget_param,
                       code="context_length_exceeded")
    return requested


def check_prompt_ids(state: ServerState, prompt_ids: list[int], param: str) -> None:
    """400 naming `param` for an empty prompt or a token id outside the vocabulary (the engine checks
    too, but cannot say which field the ids came from)."""
    if not prompt_ids:
        raise ApiError(400, f"{param}: must not be empty", param=param)
    vocab = state.engine.model_config.vocab_size
    bad = next((token for token in prompt_ids if not 0 <= token < vocab), None)
    if bad is not None:
        raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)


def check_vocab_ids(state: ServerState, ids: Optional[list[int]], param: str) -> None:
    """400 naming `param` for a token id outside the vocabulary (a stop token id that could never be
    sampled, an allowed or logprob token id that does not exist)."""
    vocab = state.engine.model_config.vocab_size
    bad = next((token for token in ids or () if not 0 <= token < vocab), None)
    if bad is not None:
        raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)


def check_token_id_fields(state: ServerState, body: p._SamplingFields) -> None:
    """`check_vocab_ids` on each field of `body` that holds token ids: stop_token_ids, allowed_token_ids
    and logprob_token_ids."""
    for param in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
        check_vocab_ids(state, getattr(body, param), param)


def truncate_prompt(state: ServerState, prompt_ids: list[int], keep: Optional[int],
                    side: Optional[str] = None) -> tuple[list[int], int]:
    """vLLM's `truncate_prompt_tokens`: `keep` ids of the prompt (-1: the context limit) and how many
    were cut from its start. `side` (vLLM's `truncation_side`) "left" (the default) cuts from the start
    and keeps the prompt's end; "right" keeps its start (nothing cut from the start: 0). 400 when `keep`
    exceeds the context limit."""
    if keep is None:
        return prompt_ids, 0
    limit = state.context_limit
    if keep > limit:
        raise ApiError(400, f"truncate_prompt_tokens: {keep} exceeds this model's context limit of {limit} tokens",
                       param="truncate_prompt_tokens")
    keep = limit if keep == -1 else keep
    cut = max(0, len(prompt_ids) - keep)
    return (prompt_ids[:keep], 0) if side == "right" else (prompt_ids[cut:], cut)


def openai_sampling(fields: p._SamplingFields, max_tokens: int, logprobs: Optional[int],
                    prompt_logprobs: Optional[int], structured: Optional[StructuredSpec] = None,
                    keep_special_tokens: bool = False, defaults: Optional[dict[str, float]] = None) -> SamplingParams:
    """SamplingParams from the OpenAI fields; a field left unset takes the model's generation_config.json
    value (`defaults`: temperature, top_p, top_k, min_p, repetition_penalty, as vLLM), else OpenAI's default
    (temperature 1, top_p 1). An invalid combination is a 400 naming the field."""
    defaults = defaults or {}

    def unset(name: str, fallback):
        value = getattr(fields, name)
        return defaults.get(name, fallback) if value is None else value

    top_k = unset("top_k", None)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=unset("temperature", 1.0),
            top_p=unset("top_p", 1.0),
            top_k=int(top_k) if top_k not in (None, 0, -1) else None,
            min_p=unset("min_p", 0.0),
            seed=fields.seed,
            stop=fields.stop or (),
            stop_regex=fields.stop_regex or (),
            stop_token_ids=tuple(fields.stop_token_ids or ()),
            ignore_eos=fields.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=fields.skip_special_tokens and not keep_special_tokens,
            presence_penalty=fields.presence_penalty or 0.0,
            frequency_penalty=fields.frequency_penalty or 0.0,
            repetition_penalty=unset("repetition_penalty", 1.0),
            logit_bias=fields.logit_bias or (),
            min_tokens=fields.min_tokens,
            structured=structured,
            allowed_token_ids=fields.allowed_token_ids,
            logprob_token_ids=fields.logprob_token_ids,
        )
    except ValueError as error:
        name = str(error).split(":")[0].split(" ")[0]
        raise ApiError(400, str(error), param=name if name in type(fields).model_fields else None) from error


def sglang_sampling(sp: p.GenerateSamplingParams, max_tokens: int) -> SamplingParams:
    """SamplingParams from SGLang's `sampling_params` (its own defaults, in protocol.py); an invalid
    value is a 400 naming `sampling_params.<field>`."""
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                              top_k=sp.top_k if sp.top_k not in (None, 0, -1) else None, min_p=sp.min_p,
                              seed=sp.seed, stop=sp.stop or (), stop_regex=sp.stop_regex or (),
                              stop_token_ids=tuple(sp.stop_token_ids or ()),
                              ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens)
    except ValueError as exc:
        raise bad_request(exc, "sampling_params.") from exc


async def compile_constraint(state: ServerState, spec: Optional[StructuredSpec], param: str) -> None:
    """Compile `spec` in a worker thread (the engine's compile is then a cache hit): a constraint
    that cannot compile, or not within the time limit, is a 400 naming `param` before the request
    is queued; a 503 when slow compiles hold every compile slot."""
    if spec is None:
        return
    try:
        await state.workers.run(state.engine.grammars.compile, spec)
    except ValueError as error:            # GrammarTimeoutError included: the limit ran out
        raise ApiError(400, str(error), param=param) from error
    except GrammarBusyError as error:
        raise ApiError(503, str(error), error_type="ServiceUnavailableError", code="grammar_busy",
                       headers={"Retry-After": "1"}) from error


async def compile_reply_constraints(state: ServerState, body: p.ChatCompletionRequest, tools: ToolPlan,
                                    constraint: Optional[StructuredSpec], param: str) -> None:
    """`compile_constraint` of the reply's constraint, and of a format set beside a forced tool call
    (which the call wins over, `reply_constraint`): a format that cannot compile is a 400 naming its
    field whether or not this reply uses it."""
    await compile_constraint(state, constraint, param)
    if tools.forced is not None:
        await compile_constraint(state, text_constraint(body), constraint_field(body))


def reply_plan(state: ServerState, body: p.ChatCompletionRequest) -> tuple[ToolPlan, Optional[StructuredSpec], str]:
    """The request's ToolPlan, the constraint on its reply, and the field that constraint came from."""
    try:
        tools = plan_tools(body, state.chat.parser, state.vocab, state.special_tokens, reply_chars(state, body))
        return tools, reply_constraint(body, tools.forced), "tools" if tools.forced else constraint_field(body)
    except (ToolRequestError, ConstraintError) as error:
        raise ApiError(400, str(error), param=error.param) from error


def reply_chars(state: ServerState, body: p.ChatCompletionRequest) -> Optional[int]:
    """The most characters `body`'s reply can have: its budget at most (max_tokens, else the default
    budget of `max_tokens()` for an empty prompt, which a real prompt only shortens) times the longest
    token's characters (None without a vocabulary)."""
    if state.longest_token_chars is None:
        return None
    budget = body.max_tokens
    if budget is None:
        default = state.engine.tokenizer.max_new_tokens
        budget = state.context_limit if default is None else min(state.context_limit, default)
    return budget * state.longest_token_chars


def text_constraint(body: p._SamplingFields) -> Optional[StructuredSpec]:
    """The constraint on a reply without tools (response_format, guided_*); 400 naming the field."""
    try:
        return reply_constraint(body)
    except ConstraintError as error:
        raise ApiError(400, str(error), param=error.param) from error


def constraint_field(body: p._SamplingFields) -> str:
    """The field the request's constraint comes from (response_format when none is set)."""
    for name in CONSTRAINT_FIELDS:
        if getattr(body, name) is not None:
            return name
    return "response_format"
