"""StepBudget: how many prefill tokens the next step may carry, sized by measured time.

Every token a decoding request produces waits for a whole step, prefill chunks of other requests
included. So while some request decodes, a step's prefill share is chosen to keep the step near
`ratio` times a decode-only step, from what the runner measured:

    decode_s   exponential average of decode-only steps (seconds)
    target_s = ratio * decode_s
    after a step with p prefill tokens that took t seconds:
        p_next = p * (target_s - decode_s) / (t - decode_s)     (clamped to [p/2, 2p])

If a step costs a + b p (the weights are read once per step, then each prefill token adds b),
the fixed point of this update is a + b p = target_s, and it converges there whenever one exists
(the update's slope at the fixed point is (a - decode_s) / (target_s - decode_s) < 1). When no
such p exists the share falls to `min_tokens`, which every step still gets (less the decode rows
when they are at most a quarter of it, so that the step's rows fit the share's row bucket: see
`_within_bucket`): prefill always makes progress, no request starves. With nothing decoding, the
share is `max_tokens` (throughput: nobody is waiting for a token).
"""

from __future__ import annotations

from kvsplice.layers.shape_bucket import bucket

_DECODE_AVERAGE = 0.2      # weight of the newest decode-only step in decode_s
_MAX_CHANGE = 2.0          # the share changes by at most this factor per step


def _within_bucket(share: int, decoding: int) -> int:
    """`share`, less the decode rows when they would push the step's rows into the next row bucket
    (kvsplice.layers.shape_bucket) and are at most a quarter of it: 16 prefill tokens next to 1
    decode row would run every bf16 matmul at 32 rows, 15 run at 16, measured cheaper (figures in
    docs/BENCHMARKS_HISTORY.md, "Figures formerly quoted in code")."""
    if bucket(share + decoding) > bucket(share) and 4 * decoding <= share:
        return bucket(share) - decoding
    return share


class StepBudget:
    """Owned by the scheduler (asks `prefill_tokens`), fed by the runner (`observe`)."""

    def __init__(self, max_tokens: int, ratio: float, min_tokens: int):
        self.max_tokens, self.ratio = max_tokens, ratio
        self.min_tokens = min(min_tokens, max_tokens)
        self.decode_s: float | None = None
        self.share = float(max(self.min_tokens, min(max_tokens, 4 * self.min_tokens)))

    def prefill_tokens(self, decoding: int) -> int:
        """Prefill tokens the next step may carry when `decoding` requests decode in it."""
        if decoding == 0:
            return self.max_tokens
        # a multiple of min_tokens: every new batch shape costs the bf16 matmul a kernel build
        # (oneDNN, measured per linear), so the shares a step can take stay few
        rounded = int(self.share) // self.min_tokens * self.min_tokens
        share = max(self.min_tokens, min(self.max_tokens, rounded))
        return _within_bucket(share, decoding)

    def observe(self, seconds: float, decode_rows: int, prefill_tokens: int) -> None:
        """Learn from one finished step: `decode_rows` one-token decode rows and
        `prefill_tokens` other tokens took `seconds`."""
        if decode_rows == 0:
            return
        if prefill_tokens == 0:
            self.decode_s = seconds if self.decode_s is None else (
                (1 - _DECODE_AVERAGE) * self.decode_s + _DECODE_AVERAGE * seconds)
            return
        if self.decode_s is None:
            return
        target_extra = (self.ratio - 1.0) * self.decode_s
        extra = seconds - self.decode_s
        factor = _MAX_CHANGE if extra <= 0 else min(_MAX_CHANGE, max(1 / _MAX_CHANGE, target_extra / extra))
        proposed = prefill_tokens * factor
        # a step that had fewer tokens to prefill than its share says nothing against the share
        self.share = max(self.share, proposed) if factor >= 1 else proposed
        self.share = max(float(self.min_tokens), min(float(self.max_tokens), self.share))
