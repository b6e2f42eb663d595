"""`n` choices for one request, sharing the prompt's K/V.

    n == 1   the request itself.
    n > 1    1. a prefill request (max_tokens 1, greedy; it also computes the prompt logprobs if asked)
                puts the prompt's K/V in the cache: its exact part in the radix tree, the part SCR
                relocated in the conversation's session;
             2. the n choices are then submitted together; each finds the prompt cached (a prefix hit,
                or SCR relocating the session's K/V) and computes only its last prompt token (plus the
                SCR span tails) before decoding.

Choice i samples with seed + i (reproducible, and the choices differ). The answer's usage counts the
prompt once, with the prefill request's `reuse` (where the prompt's K/V came from), and the completion
tokens of all choices.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Optional

from kvsplice.engine.request import RequestOutput
from kvsplice.sampling_params import SamplingParams

_SEED_MAX = 2**64 - 1


@dataclass
class Choice:
    """One choice: its index, the tracker that collects its outputs (`.outputs`, `.last`), and the
    iterator of its outputs."""

    index: int
    tracker: Any
    outputs: AsyncIterator[RequestOutput]


# start(rid suffix, params) -> (tracker, outputs): submits one engine request (tracking.submit)
StartFn = Callable[[str, SamplingParams], Awaitable[tuple[Any, AsyncIterator[RequestOutput]]]]
DrainFn = Callable[[AsyncIterator[RequestOutput]], Awaitable[None]]


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The prefill request's params: one greedy token, the prompt logprobs the request asked for."""
    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=params.prompt_logprobs)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s params: seed + index (kept in range), no prompt logprobs (the prefill has them)."""
    seed = params.seed
    if seed is not None:
        seed = seed + index if seed + index <= _SEED_MAX else seed - index
    return dataclasses.replace(params, seed=seed, prompt_logprobs=None)


async def start_choices(start: StartFn, drain: DrainFn, params: SamplingParams,
                        n: int) -> tuple[list[Choice], Optional[Any]]:
    """Submit the request's choices; returns them and the prefill request's tracker (None for n == 1).
    Raises what `start` raises (bad input, a full queue) before any choice runs."""
    if n == 1:
        tracker, outputs = await start("", params)
        return [Choice(0, tracker, outputs)], None
    prefill, outputs = await start("-prompt", prefill_params(params))
    await drain(outputs)
    choices = []
    try:
        for index in range(n):
            tracker, outputs = await start(f"-{index}", choice_params(params, index))
            choices.append(Choice(index, tracker, outputs))
    except BaseException:
        for choice in choices:
            await choice.outputs.aclose()
        raise
    return choices, prefill


async def merge(choices: list[Choice]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all choices as they come. Closing it closes every choice (which
    aborts the ones still running)."""
    if len(choices) == 1:
        async for out in choices[0].outputs:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for out in choice.outputs:
                await queue.put((choice.index, out))
        except BaseException as error:  # handed to the consumer, which raises it
            await queue.put((choice.index, error))
        finally:
            await queue.put((choice.index, None))

    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    try:
        remaining = len(choices)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for choice in choices:
            await choice.outputs.aclose()


def usage_totals(choices: list[Choice], prefill: Optional[Any]) -> tuple[RequestOutput, int]:
    """(the output whose prompt counts and reuse describe the prompt, completion tokens of all choices)."""
    first = prefill.last if prefill is not None else choices[0].tracker.last
    return first, sum(choice.tracker.last.completion_tokens for choice in choices)
