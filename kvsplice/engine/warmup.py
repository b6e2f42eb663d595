"""warm_up: run the kernels and shapes the first requests will use before the server says it is
ready, so that the first user request does not pay for them.

Why: the first forward of each shape pays one-time costs (oneDNN primitives created for the row
count, the packed kernels' first calls, the prefill lane thread's first parallel region, the
allocator growing its pools): on a fresh server the first 64-token reply took 14.5 s, the next ones
a fraction of it. One throwaway request is prefilled (a long prompt: many rows), and while it
decodes a second, short one is added (few rows: the small-batch kernels, and the prefill lane where
there is one); both decode a few tokens, one row and then two. They finish as any request does
(their slots freed); their SCR sessions and prefixes are then dropped (`RadixCache.reset`) where
the radix tree and the session store held nothing before them, so the pool is as it was, and the engine's counters (/metrics) are
restored. Bounded: a few forwards of at most
`max_batch_tokens` rows, a second or two on 2 cores for the default model.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from kvsplice.engine.engine import Engine
from kvsplice.sampling_params import SamplingParams

_log = logging.getLogger(__name__)
SALT = "kvsplice-warm-up"        # its own cache namespace: no user prefix ever matches it
LONG_PROMPT, SHORT_PROMPT = 96, 5
NEW_TOKENS = 4


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What `warm_up` ran: its wall time, the forwards (steps) and the tokens it generated."""

    seconds: float
    steps: int
    tokens: int


def _prompt(length: int, vocab_size: int) -> list[int]:
    """`length` token ids spread over the vocabulary (their content does not matter)."""
    return [(97 * i + 11) % vocab_size for i in range(length)]


def warm_up(engine: Engine, long_prompt: int = LONG_PROMPT, short_prompt: int = SHORT_PROMPT,
            new_tokens: int = NEW_TOKENS) -> WarmUp:
    """Run the throwaway requests of the module docstring through `engine` (on the thread that
    steps it, before it serves) and return what ran. The engine must have no requests; after it,
    it has none, and nothing of them stays cached where nothing was before."""
    if engine.has_work():
        raise RuntimeError("warm_up runs on an idle engine only")
    started = time.perf_counter()
    untouched = engine.cache.radix.cached_size() == 0 and not engine.reuse.sessions.sessions()
    counters = dataclasses.replace(engine.counters)   # /metrics counts users' requests only
    limit = min(engine.max_model_len, engine.config.num_slots) - new_tokens
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    first = engine.add_request(_prompt(max(1, min(long_prompt, limit)), vocab), params, cache_salt=SALT)
    pending, steps, tokens, second = {first}, 0, 0, None
    while pending:
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                pending.discard(out.rid)
                if out.error is not None:
                    _log.warning("warm-up: request %s failed: %s", out.rid, out.error)
        steps += 1
        if second is None and first in pending and tokens:   # the first one decodes from now on
            second = engine.add_request(_prompt(max(1, min(short_prompt, limit)), vocab), params, cache_salt=SALT)
            pending.add(second)
    if untouched:   # then everything cached now is theirs: their SCR sessions, then their prefixes
        engine.reuse.drop_idle_sessions()
        engine.cache.radix.reset()
    engine.counters = counters
    engine.check_integrity()
    done = WarmUp(time.perf_counter() - started, steps, tokens)
    _log.info("warm-up: %d steps, %d tokens in %.2f s", done.steps, done.tokens, done.seconds)
    return done
