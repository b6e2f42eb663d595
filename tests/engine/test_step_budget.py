"""StepBudget: the prefill share converges to the step-time target on a synthetic cost model,
never falls below the progress guarantee, and the scheduler applies it."""

from __future__ import annotations

from kvsplice.engine.step_budget import StepBudget


def _run(budget: StepBudget, decode_s: float, fixed_s: float, per_token_s: float, steps: int) -> list[int]:
    """Feed `budget` a step cost of fixed_s + per_token_s * p for mixed steps (decode_s alone)."""
    budget.observe(decode_s, decode_rows=1, prefill_tokens=0)
    shares = []
    for _ in range(steps):
        share = budget.prefill_tokens(decoding=1)
        shares.append(share)
        budget.observe(fixed_s + per_token_s * share, decode_rows=1, prefill_tokens=share)
    return shares


def test_nothing_decoding_gets_the_full_batch():
    assert StepBudget(2048, 2.5, 16).prefill_tokens(decoding=0) == 2048


def test_share_converges_to_the_step_time_target():
    budget = StepBudget(2048, 2.5, 16)
    shares = _run(budget, decode_s=0.010, fixed_s=0.012, per_token_s=0.0005, steps=30)
    # target 25 ms = 12 ms + 0.5 ms * p  ->  p = 26, taken in multiples of 16 less the decode row
    # (so that prefill + decode rows fill a row bucket: 15 + 1, 31 + 1)
    assert shares[-1] in (15, 31) and all((share + 1) % 16 == 0 for share in shares)
    assert 0.012 + 0.0005 * shares[-1] <= 2.5 * 0.010 * 1.05


def test_share_never_drops_below_the_progress_guarantee():
    budget = StepBudget(2048, 2.0, 16)
    shares = _run(budget, decode_s=0.010, fixed_s=0.030, per_token_s=0.001, steps=20)
    assert min(shares) >= 15 and shares[-1] == 15      # 16, less the one decode row (a quarter at most)
    assert budget.prefill_tokens(decoding=5) == 16     # more decode rows than a quarter: not trimmed


def test_cheap_steps_grow_the_share_at_most_twofold_per_step():
    budget = StepBudget(2048, 3.0, 16)
    shares = _run(budget, decode_s=0.010, fixed_s=0.010, per_token_s=0.00001, steps=12)
    assert all(b <= 2 * a + 1 for a, b in zip(shares, shares[1:]))
    assert 1983 <= shares[-1] <= 2000     # 20 ms of extra time at 0.01 ms per token


def test_without_a_decode_measurement_the_share_stays_put():
    budget = StepBudget(2048, 2.5, 16)
    before = budget.prefill_tokens(decoding=1)
    budget.observe(1.0, decode_rows=1, prefill_tokens=before)
    assert budget.prefill_tokens(decoding=1) == before
