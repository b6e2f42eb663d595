"""The match decision: plausibility thresholds, the winner, and the ambiguity rule."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import EqualRun
from kvsplice.reuse.session_match import Verified, choose, exclusive_tokens, implausible_reason, verify

CFG = ReuseConfig()  # match_min_tokens 64 (solid runs >= 16), ratio 0.5, coverage 0.3, margin 0.15


def candidate(name, runs, old_len=1000, evidence=500, continues=False, recency=0, first_hit=0):
    runs = tuple(EqualRun(new, new, length) for new, length in runs)
    kept = sum(run.length for run in runs)
    span = runs[-1].new_end if runs else 0
    return Verified(name, runs, runs, 0, continues, kept, evidence, kept / span if span else 0.0, kept / old_len,
                    first_hit, recency)


def runs_strategy():
    """Increasing disjoint runs inside [0, 400): sorted cut points taken in pairs."""
    return st.lists(st.integers(0, 400), max_size=12, unique=True).map(
        lambda cuts: [EqualRun(a, a, b - a) for a, b in zip(sorted(cuts)[::2], sorted(cuts)[1::2]) if b > a])


@settings(max_examples=200, deadline=None)
@given(runs_strategy(), runs_strategy())
def test_exclusive_tokens_is_a_set_difference(runs, others):
    covered = {offset for run in runs for offset in range(run.new_offset, run.new_end)}
    other = {offset for run in others for offset in range(run.new_offset, run.new_end)}
    assert exclusive_tokens(runs, others) == len(covered - other)


def test_verify_counts_solid_runs_after_the_prefix_outside_common_content():
    old, new = list(range(1000)), list(range(1000))
    runs = [EqualRun(0, 0, 100), EqualRun(200, 150, 10), EqualRun(300, 300, 400)]   # the 10-token run is noise
    common = [EqualRun(600, 600, 50)]
    checked = verify("s", old[:900], 900, new[:100] + [-1] * 50 + new[150:800] + [-2] * 300, common, 0, 7,
                     lambda a, b: runs, CFG)
    assert checked.solid == (runs[0], runs[2]) and checked.lcp == 100 and checked.kept == 500
    assert checked.evidence == 400 - 50 and not checked.continues
    assert checked.overlap == 500 / 700 and checked.coverage == 500 / 900   # the 300 appended tokens are free
    appended = verify("s", old[:900], 890, old[:890] + [-1] * 500, [], 0, 7, lambda a, b: [EqualRun(0, 0, 890)], CFG)
    assert appended.continues and appended.evidence == 0 and appended.overlap == 1.0
    tiny = verify("s", old[:40], 40, old[:40] + [-1] * 50, [], 0, 7, lambda a, b: [EqualRun(0, 0, 40)], CFG)
    assert not tiny.continues  # a prefix shorter than match_min_tokens proves nothing


def test_thresholds_give_their_reasons():
    assert implausible_reason(candidate("a", [(0, 900)]), CFG) is None
    assert implausible_reason(candidate("a", [(0, 900)], evidence=63), CFG) == "no_candidate"
    assert implausible_reason(candidate("a", [(0, 900)], evidence=0, continues=True), CFG) is None
    assert implausible_reason(candidate("a", [(0, 390), (900, 100)]), CFG) == "low_overlap"  # 49% of 1000
    assert implausible_reason(candidate("a", [(0, 200), (800, 100)]), CFG) == "low_overlap"  # 30% of 900
    assert implausible_reason(candidate("a", [(0, 900)], old_len=5000), CFG) == "low_overlap"  # 18% of the session
    assert choose([candidate("a", [(0, 900)], evidence=10)], 1000, CFG) == (None, "no_candidate")
    assert choose([candidate("a", [(0, 900)], evidence=10), candidate("b", [(0, 100), (600, 50)])], 1000, CFG) \
        == (None, "low_overlap")


def test_the_session_keeping_the_most_wins_when_clearly_ahead():
    best, far = candidate("best", [(0, 950)]), candidate("far", [(0, 700)])
    assert choose([far, best], 1000, CFG) == (best, "matched")
    newest, older = candidate("newest", [(0, 900), (920, 70)]), candidate("older", [(0, 900)])
    assert choose([older, newest], 1000, CFG) == (newest, "matched")  # a copy 70 tokens behind: no block


def test_a_session_the_prompt_continues_wins():
    continued = candidate("continued", [(0, 300)], old_len=310, evidence=0, continues=True)
    sharing_more = candidate("sharing_more", [(0, 300), (500, 400)])
    assert choose([sharing_more, continued], 1000, CFG) == (continued, "matched")


def test_equally_plausible_sessions_give_no_match():
    same_a, same_b = candidate("a", [(0, 900)], recency=1), candidate("b", [(0, 900)], recency=2)
    assert choose([same_a, same_b], 1000, CFG) == (None, "ambiguous")  # nothing tells them apart
    near = candidate("near", [(0, 850)])
    assert choose([same_a, near], 1000, CFG) == (None, "ambiguous")   # 50 tokens ahead: under 64
    assert choose([same_a, near], 300, CFG) == (same_a, "matched")    # but more than 15% of a short prompt
