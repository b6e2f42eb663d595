"""OpenAI's `usage` of an answer, with kvsplice's `reuse` (where the prompt's K/V came from): the prompt
counted once (the prefill request's, when `n` choices shared it), the completion tokens of all choices."""

from __future__ import annotations

from typing import Any, Optional

from kvsplice.engine.request import RequestOutput
from kvsplice.server import protocol as p
from kvsplice.server.choices import Choice, usage_totals
from kvsplice.server.tracking import RequestTracker


def usage(out: RequestOutput, completion_tokens: Optional[int] = None) -> dict[str, Any]:
    """`usage` of a finished request (`completion_tokens`: instead of the output's); `reuse` is
    ReuseStats.as_dict()."""
    reuse = out.reuse.as_dict()
    completion = out.completion_tokens if completion_tokens is None else completion_tokens
    return p.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=completion,
                   total_tokens=out.prompt_tokens + completion,
                   prompt_tokens_details=p.PromptTokensDetails(
                       cached_tokens=out.reuse.prefix_tokens + out.reuse.relocated_tokens),
                   reuse=reuse).model_dump()


def choices_usage(choices: list[Choice], prefill: Optional[RequestTracker],
                  completion_tokens: Optional[int] = None) -> dict[str, Any]:
    """`usage` of a request's choices (`prefill`: the tracker of the request that prefilled their prompt,
    None for one choice); `completion_tokens` overrides their sum (0 when the prompt was only scored)."""
    first, completion = usage_totals(choices, prefill)
    return usage(first, completion if completion_tokens is None else completion_tokens)


def wants_stream_usage(body) -> bool:
    """Whether a stream ends with a `usage` chunk (OpenAI's `stream_options.include_usage`)."""
    return bool(body.stream_options and body.stream_options.include_usage)
