"""The vLLM and SGLang extras of an answer, shared by chat and completions:

    stop_reason / matched_stop   what ended a choice (vLLM: the stop string or stop token id, None at EOS
                                 or length; SGLang: the same, EOS's id included)
    prompt_logprobs              vLLM's shape: per prompt position None (the first) or
                                 {token id: {logprob, rank, decoded_token}}, the prompt's token first
    token ids                    `return_token_ids`: the prompt's, and each choice's generated ids
    running usage                `stream_options.continuous_usage_stats`: the counts so far, per chunk
    delta.reasoning_content      on every streamed chat delta, null where there is none (SGLang's deltas
                                 always carry it, and its clients read it from the openai SDK's delta,
                                 which has no such attribute unless the JSON names it)
"""

from __future__ import annotations

from typing import Any, Optional, Union

from kvsplice.engine.request import RequestOutput
from kvsplice.sampling_params import SamplingParams
from kvsplice.structured.stop_patterns import StopPatterns


def stop_reason(tokenizer, params: SamplingParams, prompt_ids: list[int], token_ids: list[int],
                finish_reason: Optional[str]) -> Union[str, int, None]:
    """vLLM's `stop_reason`: the stop string or stop token id that ended the output; None when it ended
    at EOS, at its length, or was aborted. The stop string is found in the output decoded after the
    prompt's last ids, as the engine's detokenizer saw it: the earliest, the longer on a tie."""
    if finish_reason != "stop" or not token_ids:
        return None
    last = token_ids[-1]
    if not params.ignore_eos and last in tokenizer.eos_token_ids:
        return None
    if last in params.stop_token_ids:
        return last
    if not params.stop and not params.stop_regex:
        return None
    context = list(prompt_ids[-5:])

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    text = decode(context + list(token_ids))[len(decode(context)):]
    found = [(text.find(stop), -len(stop), stop) for stop in params.stop if stop in text]
    if params.stop_regex:   # SGLang's matched_stop for a regex is the pattern itself
        matched = StopPatterns(params.stop_regex).first_match("", text)
        found += [(matched[0], 0, matched[1])] if matched is not None else []
    return min(found)[2] if found else None


def matched_stop(stop: Union[str, int, None], token_ids: list[int],
                 finish_reason: Optional[str]) -> Union[str, int, None]:
    """SGLang's `matched_stop`: the stop string or token that ended the output, EOS included (its id);
    None when it ended at its length or was aborted."""
    if stop is not None or finish_reason != "stop" or not token_ids:
        return stop
    return token_ids[-1]


def finish_fields(tokenizer, params: SamplingParams, prompt_ids: list[int], outputs: list[RequestOutput],
                  finish_reason: Optional[str]) -> dict[str, Any]:
    """A finished choice's `stop_reason` (vLLM) and `matched_stop` (SGLang)."""
    ids = generated_ids(outputs)
    stop = stop_reason(tokenizer, params, prompt_ids, ids, finish_reason)
    return {"stop_reason": stop, "matched_stop": matched_stop(stop, ids, finish_reason)}


def generated_ids(outputs: list[RequestOutput]) -> list[int]:
    """Every token id a choice generated, a stopping token included."""
    return [token for out in outputs for token in out.new_token_ids]


def prompt_logprobs(tokenizer, prompt_ids: list[int], lps, top_n: int) -> list[Optional[dict[str, Any]]]:
    """vLLM's `prompt_logprobs`: for each prompt position, None (the first: nothing predicts it) or
    {token id: {logprob, rank, decoded_token}} with the prompt's own token first, then the `top_n` most
    likely."""
    out: list[Optional[dict[str, Any]]] = []
    for token_id, lp in zip(prompt_ids, lps or (None,) * len(prompt_ids)):
        if lp is None:
            out.append(None)
            continue
        entry = {str(token_id): _logprob_entry(tokenizer, token_id, lp.logprob, lp.rank)}
        for rank, (top_id, value) in enumerate(lp.top[:top_n], start=1):
            entry.setdefault(str(top_id), _logprob_entry(tokenizer, top_id, value, rank))
        out.append(entry)
    return out


def _logprob_entry(tokenizer, token_id: int, logprob: float, rank: Optional[int]) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_str(token_id)}


def wants_continuous_usage(body) -> bool:
    """Whether every chunk carries the usage so far (vLLM: `include_usage` and `continuous_usage_stats`)."""
    options = body.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def running_usage(out: RequestOutput) -> dict[str, int]:
    """A chunk's usage: its choice's prompt and completion tokens so far."""
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def with_reasoning_slot(delta: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat delta with `reasoning_content` present (None where it has none), as SGLang sends."""
    return {**delta, "reasoning_content": delta.get("reasoning_content")}
