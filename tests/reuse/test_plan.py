"""make_plan / SpanPlan: selection, invariants (validate), breakdown and the accounting identity."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.reuse.accounting import ReuseStats
from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import diff_tokens
from kvsplice.reuse.diff import common_prefix_len
from kvsplice.reuse.plan import Keep, PlanError, SpanPlan, make_plan, prefill_breakdown


def seq(start, count):
    return list(range(start, start + count))


def plan_for(old, new, prefix_len, cfg=ReuseConfig(), old_kv_len=None):
    runs = diff_tokens(old, new)
    return make_plan(old, new, runs, prefix_len=prefix_len,
                     old_kv_len=len(old) if old_kv_len is None else old_kv_len, cfg=cfg)


def test_design_example_a_bprime_c1_x_c2_d():
    a, b, b2, c1, x, c2, d = seq(0, 100), seq(1000, 50), seq(2000, 30), seq(3000, 200), seq(4000, 20), seq(5000, 300), seq(6000, 40)
    old, new = a + b + c1 + x + c2, a + b2 + c1 + c2 + d
    result = plan_for(old, new, prefix_len=100)
    plan = result.plan
    assert result.reason is None
    assert plan.keeps == (Keep(150, 130, 184), Keep(370, 330, 284))
    assert [keep.delta for keep in plan.keeps] == [-20, -40]
    assert plan.computed_ranges == ((100, 130), (314, 330), (614, 670))
    assert (plan.relocated_tokens, plan.prefilled_tokens, plan.exact_len) == (468, 102, 130)
    assert (result.breakdown.changed, result.breakdown.span_tails) == (70, 32)
    plan.validate(old, new, len(old))


def test_edit_at_token_zero_still_plans():
    old = seq(0, 300)
    new = [9999] + old[1:]
    plan = plan_for(old, new, prefix_len=0).plan
    assert plan.keeps == (Keep(1, 1, 283),) and plan.computed_ranges == ((0, 1), (284, 300))
    plan.validate(old, new, len(old))


def test_k_longest_executed_in_new_order_ties_to_the_later():
    runs_lengths = [100, 200, 100, 150]
    old, new = [], []
    for number, length in enumerate(runs_lengths):
        old += seq(10_000 * (number + 1), length) + [7] * 10  # deleted separator
        new += seq(10_000 * (number + 1), length) + [8] * 5  # new separator
    cfg = ReuseConfig(max_spans=3)
    plan = plan_for(old, new, prefix_len=0, cfg=cfg).plan
    # lengths after the tail: 84, 184, 84, 134 -> the 184, 134 and the later 84
    assert [keep.length for keep in plan.keeps] == [184, 84, 134]
    assert [keep.dst_pos for keep in plan.keeps] == [105, 310, 415]
    plan.validate(old, new, len(old))
    result = plan_for(old, new, prefix_len=0, cfg=ReuseConfig(max_spans=0))
    assert result.plan is None and result.reason == "no_spans"


def test_the_span_limit_grows_with_the_prompt_per_span_scale_tokens():
    # 12 surviving runs of 100 tokens, each after an edited separator: 1,260 new tokens
    old, new = [], []
    for number in range(12):
        old += seq(10_000 * (number + 1), 100) + [7] * 10
        new += seq(10_000 * (number + 1), 100) + [8] * 5
    short = ReuseConfig(max_spans=3, span_scale_tokens=2048)
    assert len(plan_for(old, new, prefix_len=0, cfg=short).plan.keeps) == 3  # one started 2,048 tokens
    scaled = ReuseConfig(max_spans=3, span_scale_tokens=512)
    assert scaled.span_limit(len(new)) == 9  # ceil(1260 / 512) = 3 -> 3 x 3
    plan = plan_for(old, new, prefix_len=0, cfg=scaled).plan
    assert len(plan.keeps) == 9
    plan.validate(old, new, len(old))
    fixed = ReuseConfig(max_spans=3, span_scale_tokens=0)
    assert fixed.span_limit(10**6) == 3
    assert ReuseConfig(max_spans=1000, span_scale_tokens=1).span_limit(10**6) == 1024  # max_spans' bound
    assert ReuseConfig().span_limit(10**6) == 6   # the default: K whatever the length
    assert ReuseConfig(span_scale_tokens=2048).span_limit(2049) == 12


def test_minimum_span_is_min_span_plus_tail():
    for length, expect in ((79, None), (80, 64)):
        body = seq(100, length)
        old, new = [7] + body + [1], [500] + body + [2] * 20
        result = plan_for(old, new, prefix_len=0, cfg=ReuseConfig(min_span=64, tail=16))
        got = result.plan.keeps[0].length if result.plan else None
        assert got == expect


def test_old_kv_len_clips_the_relocated_part():
    old = seq(0, 400)
    new = [77] + old
    plan = plan_for(old, new, prefix_len=0, old_kv_len=300).plan
    assert plan.keeps == (Keep(0, 1, 300),)
    plan.validate(old, new, 300)
    with pytest.raises(PlanError):
        plan.validate(old, new, 299)


def test_radix_shorter_than_common_prefix_relocates_with_delta_zero():
    old = seq(0, 300) + seq(1000, 200)
    new = seq(0, 300) + [5] * 10 + seq(1000, 200)
    result = plan_for(old, new, prefix_len=100)
    assert result.plan.keeps == (Keep(100, 100, 184), Keep(300, 310, 184))
    assert result.breakdown.uncached_unchanged == 0 and result.breakdown.span_tails == 32
    few = plan_for(old, new, prefix_len=250)  # only 50 of A left: too short, recomputed
    assert few.plan.keeps == (Keep(300, 310, 184),)
    assert few.breakdown.uncached_unchanged == 50 and few.breakdown.changed == 10


def test_reasons_without_plan():
    old, new = seq(0, 300), [1] + seq(0, 300)
    assert plan_for(old, new, 0, cfg=ReuseConfig(enabled=False)).reason == "disabled"
    assert plan_for([], new, 0).reason == "no_session_tokens"
    assert plan_for(old, new, 0, old_kv_len=0).reason == "no_session_tokens"
    empty = plan_for([], new, 0)
    assert empty.breakdown.changed == len(new) and empty.plan is None
    with pytest.raises(ValueError):
        plan_for(old, new, prefix_len=len(new) + 1)


def test_validate_rejects_broken_plans():
    old = seq(0, 300)
    new = [9] + old
    good = SpanPlan(301, 0, (Keep(0, 1, 100), Keep(120, 121, 100)), 16)
    good.validate(old, new, 300)
    broken = [
        SpanPlan(300, 0, good.keeps, 16),  # wrong prompt_len
        SpanPlan(301, 5, good.keeps, 16),  # keep inside the prefix
        SpanPlan(301, 0, (Keep(0, 1, 100), Keep(110, 111, 100)), 16),  # short tail between keeps
        SpanPlan(301, 0, (Keep(120, 121, 100), Keep(0, 1, 100)), 16),  # out of order
        SpanPlan(301, 0, (Keep(0, 2, 100),), 16),  # tokens differ
        SpanPlan(301, 0, (Keep(0, 1, 290),), 16),  # no tail before the prompt's end
        SpanPlan(301, 0, (Keep(0, 1, 0),), 16),  # empty keep
        SpanPlan(301, 0, good.keeps, 0),  # tail 0
    ]
    for plan in broken:
        with pytest.raises(PlanError):
            plan.validate(old, new, 300)
    with pytest.raises(PlanError):
        good.validate(old, new, 150)  # second keep beyond old_kv_len


@st.composite
def planning_case(draw):
    vocab = draw(st.sampled_from([3, 8, 50]))
    old = draw(st.lists(st.integers(0, vocab - 1), max_size=250))
    new = list(old)
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["insert", "delete", "replace", "append", "edit_at_zero"]))
        at = 0 if kind == "edit_at_zero" else draw(st.integers(0, len(new)))
        piece = draw(st.lists(st.integers(0, vocab + 5), min_size=1, max_size=30))
        if kind == "insert":
            new[at:at] = piece
        elif kind == "delete":
            del new[at : at + len(piece)]
        elif kind in ("replace", "edit_at_zero"):
            new[at : at + len(piece)] = piece
        else:
            new += piece
    cfg = ReuseConfig(max_spans=draw(st.integers(0, 4)), tail=draw(st.integers(1, 4)), min_span=draw(st.integers(1, 10)))
    prefix_len = draw(st.integers(0, len(new)))
    old_kv_len = draw(st.integers(0, len(old)))
    fast = draw(st.booleans())
    return old, new, cfg, prefix_len, old_kv_len, fast


def brute_breakdown(old, new, runs, plan_keeps, prefix_len, tail, recomputed=()):
    relocated = {keep.dst_pos + k for keep in plan_keeps for k in range(keep.length)} - set(recomputed)
    tails = {keep.dst_end + k for keep in plan_keeps for k in range(tail)}
    in_runs = {run.new_offset + k for run in runs for k in range(run.length)}
    common = common_prefix_len(old, new)
    counts = {"changed": 0, "span_tails": 0, "unchosen_spans": 0, "uncached_unchanged": 0, "recomputed": 0}
    for offset in range(prefix_len, len(new)):
        if offset in relocated:
            continue
        name = ("recomputed" if offset in recomputed else "span_tails" if offset in tails else "uncached_unchanged" if offset < common
                else "unchosen_spans" if offset in in_runs else "changed")
        counts[name] += 1
    return counts


@settings(max_examples=200, deadline=None)
@given(planning_case())
def test_every_plan_validates_and_accounts(case):
    old, new, cfg, prefix_len, old_kv_len, fast = case
    runs = diff_tokens(old, new, fastdiff_min=0 if fast else 10**9, cdc_target=4)
    result = make_plan(old, new, runs, prefix_len=prefix_len, old_kv_len=old_kv_len, cfg=cfg)
    keeps = result.plan.keeps if result.plan else ()
    if result.plan is not None:
        result.plan.validate(old, new, old_kv_len)
        assert len(keeps) <= cfg.max_spans and all(keep.length >= cfg.min_span for keep in keeps)
    else:
        assert result.reason in ("no_session_tokens", "no_spans")
    breakdown = result.breakdown
    assert breakdown.__dict__ == brute_breakdown(old, new, runs, keeps, prefix_len, cfg.tail)
    stats = ReuseStats.from_plan_result(result, prompt_len=len(new), prefix_len=prefix_len, session="matched")
    stats.check(len(new))
    assert breakdown.total == stats.prefilled_tokens
    if result.plan is not None:
        _check_recomputed_plan(old, new, runs, result.plan, old_kv_len)


def _check_recomputed_plan(old, new, runs, plan, old_kv_len):
    """Every third relocated offset recomputed: still valid, the breakdown counts them, and the
    computed ranges are the complement of what stays relocated."""
    relocated = [o for keep in plan.keeps for o in range(keep.dst_pos, keep.dst_end)]
    amended = plan.with_recomputed(relocated[::3])
    amended.validate(old, new, old_kv_len)
    breakdown = prefill_breakdown(old, new, runs, prefix_len=plan.prefix_len, keeps=plan.keeps, tail=plan.tail,
                                  recomputed=amended.recomputed)
    assert breakdown.__dict__ == brute_breakdown(old, new, runs, plan.keeps, plan.prefix_len, plan.tail,
                                                 amended.recomputed)
    computed = {o for start, end in amended.computed_ranges for o in range(start, end)}
    assert computed == set(range(plan.prefix_len, len(new))) - (set(relocated) - set(amended.recomputed))
    assert amended.relocated_tokens == plan.relocated_tokens - len(amended.recomputed)
    assert breakdown.total == amended.prefilled_tokens
    first_kept = min(set(relocated) - set(amended.recomputed), default=len(new))
    assert amended.exact_len == first_kept


def test_recomputed_offsets_must_lie_in_keeps_and_increase():
    plan = SpanPlan(100, 10, (Keep(20, 20, 30), Keep(60, 60, 20)), tail=4)
    ids = list(range(100))
    plan.with_recomputed([49, 20, 60]).validate(ids, ids, 100)
    for bad in ((25, 25), (30, 25), (55,), (80,)):
        with pytest.raises(PlanError, match="recomputed"):
            dataclasses.replace(plan, recomputed=bad).validate(ids, ids, 100)
    assert plan.with_recomputed([20, 21]).exact_len == 22
    assert plan.with_recomputed(range(20, 50)).exact_len == 60
    assert plan.with_recomputed(range(20, 50)).relocated_tokens == 20


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=300), st.lists(st.integers(0, 5), max_size=100))
def test_no_edit_and_pure_append_relocate_nothing(old, appended):
    cfg = ReuseConfig(min_span=1, tail=1)
    for new in (list(old), old + appended):
        runs = diff_tokens(old, new, fastdiff_min=0, cdc_target=4)
        result = make_plan(old, new, runs, prefix_len=common_prefix_len(old, new), old_kv_len=len(old), cfg=cfg)
        assert result.plan is None
        assert result.breakdown.unchosen_spans == result.breakdown.span_tails == 0


def test_removed_before_counts_the_old_text_each_keep_lost():
    """Per keep, the old tokens between the previous keep and it that are in no equal run: B before
    C1 (50), x before C2 (20; C1's tail is still there); a pure insertion removes nothing."""
    a, b, b2, c1, x, c2, d = seq(0, 100), seq(1000, 50), seq(2000, 30), seq(3000, 200), seq(4000, 20), seq(5000, 300), seq(6000, 40)
    plan = plan_for(a + b + c1 + x + c2, a + b2 + c1 + c2 + d, prefix_len=100).plan
    assert plan.removed == (50, 20)
    inserted = plan_for(a + c1 + c2, a + b + c1 + x + c2 + d, prefix_len=100).plan
    assert len(inserted.keeps) == 2 and inserted.removed == (0, 0)
    # an equal run in the gap that is not relocated (shorter than min_span) is not removed text
    short = seq(7000, 10)
    kept_in_gap = plan_for(a + b + short + x + c1, a + short + c1 + d, prefix_len=100).plan
    assert kept_in_gap.keeps[0].src_pos == 100 + 50 + 10 + 20 and kept_in_gap.removed == (70,)


def test_removed_spans_say_where_the_counted_removed_text_was():
    """The old ranges of the text `removed` counts: B (100..150) and x (350..370) in the design
    example; around an unrelocated equal run in the gap, the two pieces either side of it; none
    for a pure insertion. Their lengths add up to the counts."""
    a, b, b2, c1, x, c2, d = seq(0, 100), seq(1000, 50), seq(2000, 30), seq(3000, 200), seq(4000, 20), seq(5000, 300), seq(6000, 40)
    old, new = a + b + c1 + x + c2, a + b2 + c1 + c2 + d
    plan = plan_for(old, new, prefix_len=100).plan
    assert plan.removed_spans == ((100, 150), (350, 370))
    plan.validate(old, new, len(old))
    assert plan_for(a + c1 + c2, a + b + c1 + x + c2 + d, prefix_len=100).plan.removed_spans == ()
    short = seq(7000, 10)
    kept_in_gap = plan_for(a + b + short + x + c1, a + short + c1 + d, prefix_len=100).plan
    assert kept_in_gap.removed_spans == ((100, 150), (160, 180))
    assert sum(end - start for start, end in kept_in_gap.removed_spans) == sum(kept_in_gap.removed)


def test_validate_rejects_removed_spans_that_do_not_fit():
    a, b, b2, c1, x, c2, d = seq(0, 100), seq(1000, 50), seq(2000, 30), seq(3000, 200), seq(4000, 20), seq(5000, 300), seq(6000, 40)
    old, new = a + b + c1 + x + c2, a + b2 + c1 + c2 + d
    plan = plan_for(old, new, prefix_len=100).plan
    for bad in (((350, 370), (100, 150)),            # out of order
                ((100, 100),),                       # empty
                ((100, 160),),                       # overlaps the first keep (150..334)
                ((100, 150), (600, 610))):           # after the last keep's start (370)
        with pytest.raises(PlanError, match="removed span"):
            dataclasses.replace(plan, removed_spans=bad).validate(old, new, len(old))


def test_validate_rejects_a_removed_count_per_keep_that_does_not_fit():
    a, b, c1, d = seq(0, 100), seq(1000, 50), seq(3000, 200), seq(6000, 40)
    old, new = a + b + c1, a + c1 + d
    plan = plan_for(old, new, prefix_len=100).plan
    plan.validate(old, new, len(old))
    for bad in ((50, 3), (-1,)):
        with pytest.raises(PlanError, match="removed"):
            dataclasses.replace(plan, removed=bad).validate(old, new, len(old))
