"""Selective recompute's pure parts: counts, the scoring pass's bookkeeping, the deviation, policies."""

import dataclasses

import pytest
import torch

from kvsplice.reuse.plan import Keep, SpanPlan
from kvsplice.reuse.recompute import (POLICIES, ScoringPass, edited_offsets, in_edited_keeps, kv_deviation,
                                      overlap_scores, recompute_count, relocated_offsets, scoring_pass, seam_lengths,
                                      seam_offsets)

PLAN = SpanPlan(200, 10, (Keep(30, 20, 40), Keep(100, 80, 60)), tail=8)


def pending_of(plan):
    return [o for start, end in plan.computed_ranges for o in range(start, end)]


def test_recompute_count_rounds_half_up_and_stays_within_the_relocated_tokens():
    assert PLAN.relocated_tokens == 100
    assert [recompute_count(PLAN, share) for share in (0.0, 0.004, 0.005, 0.1, 1.0)] == [0, 0, 1, 10, 100]


def test_scoring_pass_rows_are_the_candidates_and_the_computed_tokens_before_the_last():
    candidates = relocated_offsets(PLAN)
    scoring = scoring_pass(PLAN, pending_of(PLAN), count=5, depth=1, num_layers=30, candidates=candidates)
    # B' (10..19), span 1, its tail and the gap (60..79), span 2; not D after the last candidate
    assert scoring.rows == list(range(10, 140))
    assert scoring.all_rows == tuple(range(10, 140)) and not scoring.done
    only_second = scoring_pass(PLAN, pending_of(PLAN), 5, 1, 30, candidates=list(range(80, 90)))
    assert only_second.rows == list(range(10, 20)) + list(range(60, 90))


def test_scoring_chunks_cost_their_share_of_the_layers_and_record_in_order():
    scoring = ScoringPass(depth=2, num_layers=30, rows=list(range(100)), candidates=frozenset(range(50, 100)),
                          count=3)
    assert scoring.next_rows(3) == list(range(45))     # 3 full tokens' worth = 45 rows at 2 of 30 layers
    assert scoring.cost(45) == 3 and scoring.cost(1) == 1
    with pytest.raises(ValueError, match="order"):
        scoring.record([1, 2], torch.zeros(2))
    scoring.record(list(range(60)), torch.arange(60, dtype=torch.float32))
    scoring.record(list(range(60, 100)), torch.zeros(40))
    assert scoring.done and set(scoring.scores) == set(range(50, 100))   # only candidates are scored
    assert scoring.selection() == [57, 58, 59]


def test_selection_breaks_ties_towards_the_earlier_offset():
    scoring = ScoringPass(1, 4, [], frozenset({3, 5, 9}), count=2, scores={3: 1.0, 5: 1.0, 9: 1.0})
    assert scoring.selection() == [3, 5]


def test_kv_deviation_is_relative_per_row():
    old_k = torch.ones(3, 2, 4)
    old_v = 2 * torch.ones(3, 2, 4)
    new_k, new_v = old_k.clone(), old_v.clone()
    new_k[1] *= 2          # relative squared distance of K: 1
    new_v[2] *= 1.5        # of V: 0.25
    torch.testing.assert_close(kv_deviation(new_k, new_v, old_k, old_v), torch.tensor([0.0, 1.0, 0.25]))
    # a row's score does not depend on the other rows
    torch.testing.assert_close(kv_deviation(new_k[1:2], new_v[1:2], old_k[1:2], old_v[1:2]), torch.tensor([1.0]))


def test_heads_share_the_count_out_over_the_spans_and_seams_take_a_fixed_head():
    heads = POLICIES["heads"].choose(PLAN, 5)
    assert heads == [20, 21, 22, 80, 81]
    assert POLICIES["heads"].choose(PLAN, 0) == []
    assert seam_offsets(PLAN, 3) == [20, 21, 22, 80, 81, 82]
    assert seam_offsets(PLAN, 50) == list(range(20, 60)) + list(range(80, 130))
    assert seam_offsets(PLAN, 0) == []
    partly = PLAN.with_recomputed([20])
    assert POLICIES["heads"].choose(partly, 2) == [21, 80]
    assert relocated_offsets(partly)[:2] == [21, 22]


def test_a_longer_seam_after_removed_text_replaces_the_short_one_only_there():
    """removed_seam_tokens: spans that follow removed old text get the longer seam, never past
    their end; spans after inserted text only, and plans without removal counts, keep the fixed one."""
    removed = dataclasses.replace(PLAN, removed=(0, 30))
    assert seam_lengths(removed, 3, 10) == [3, 10]
    assert seam_lengths(removed, 12, 10) == [12, 12]       # never shorter than seam_tokens
    assert seam_lengths(removed, 3, 100) == [3, 60]        # at most the span
    assert seam_lengths(PLAN, 3, 10) == [3, 3]             # removal unknown: fixed seams
    assert seam_lengths(dataclasses.replace(PLAN, removed=(1, 0)), 3, 10) == [10, 3]
    assert seam_offsets(removed, 2, 5) == [20, 21, 80, 81, 82, 83, 84]


def test_edited_offsets_start_at_the_first_span_that_moved_or_follows_removed_text():
    """Message openings are recomputed from the first edit on: a span at delta 0 with nothing
    removed before it (a turn that only appended) sees the context its K/V were computed with."""
    appended = SpanPlan(200, 10, (Keep(10, 10, 40), Keep(60, 50, 60)), tail=8, removed=(0, 0))
    assert edited_offsets(appended) == list(range(50, 110))                 # the second span moved
    unmoved = SpanPlan(200, 10, (Keep(10, 10, 40),), tail=8, removed=(0,))
    assert edited_offsets(unmoved) == []
    after_removal = SpanPlan(200, 10, (Keep(10, 10, 40), Keep(60, 60, 10)), tail=8, removed=(0, 10))
    assert edited_offsets(after_removal) == list(range(60, 70))
    assert edited_offsets(PLAN) == relocated_offsets(PLAN)                  # both spans moved
    assert 21 not in edited_offsets(dataclasses.replace(PLAN, recomputed=(21,)))


def test_in_edited_keeps_filters_offsets_as_the_edited_offsets_reference_does():
    plans = [SpanPlan(200, 10, (Keep(10, 10, 40), Keep(60, 50, 60)), tail=8, removed=(0, 0)),
             SpanPlan(200, 10, (Keep(10, 10, 40),), tail=8, removed=(0,)),
             dataclasses.replace(PLAN, recomputed=(21, 85))]
    for plan in plans:
        assert in_edited_keeps(plan, range(200)) == edited_offsets(plan)


# ----- the "overlap" policy -----------------------------------------------------------------
# old: A (0..9) | R1 removed (10..14) | keep 1 (15..34 -> 10..29) | tail (35..38) | R2 removed (39)
#      | keep 2 (40..59 -> 34..53) | tail (60..63); the new prompt drops R1 and R2 and appends D
A_IDS = [100, 101, 102, 103, 104, 105, 9, 9, 8, 8]
R1_IDS = [7, 8, 9, 5, 5]
KEEP1_IDS = [200, 7, 201, 8, 9, 202, 5, 203, 40] + list(range(204, 215))
KEEP2_IDS = [400, 40, 7] + list(range(401, 418))
OLD_IDS = A_IDS + R1_IDS + KEEP1_IDS + [300, 301, 302, 303] + [40] + KEEP2_IDS + [500, 501, 502, 503]
NEW_IDS = A_IDS + KEEP1_IDS + [300, 301, 302, 303] + KEEP2_IDS + [500, 501, 502, 503] + [600, 601, 602, 603]
EDITED = SpanPlan(len(NEW_IDS), 10, (Keep(15, 10, 20), Keep(40, 34, 20)), tail=4, removed=(5, 1),
                  removed_spans=((10, 15), (39, 40)))


def test_overlap_scores_the_share_of_a_tokens_occurrences_that_were_removed():
    """In the context the spans saw (old 0..59): 7 occurs 3 times, 1 removed (1/3); 8 and 9 4 times,
    1 removed (1/4), but the bigram (8, 9) twice, once removed (1/2); 5 three times, 2 removed (2/3).
    Token 40 matches only in keep 2: its removed occurrence (R2) lies after keep 1 in the old
    sequence, so keep 1 never saw it. Tokens that occur in no removed text get no score."""
    EDITED.validate(OLD_IDS, NEW_IDS, len(OLD_IDS))
    scores = overlap_scores(EDITED, OLD_IDS)
    assert scores == pytest.approx({11: 1 / 3, 13: 1 / 4, 14: 1 / 2, 16: 2 / 3, 35: 1 / 3, 36: 1 / 3})


def test_overlap_chooses_the_top_scores_capped_by_the_count_and_by_the_matches():
    choose = POLICIES["overlap"].choose
    assert choose(EDITED, 2, OLD_IDS, NEW_IDS) == [14, 16]
    assert choose(EDITED, 3, OLD_IDS, NEW_IDS) == [11, 14, 16]          # ties (1/3): the earlier offset
    assert choose(EDITED, 100, OLD_IDS, NEW_IDS) == [11, 13, 14, 16, 35, 36]   # only the 6 matches
    assert choose(EDITED, 0, OLD_IDS, NEW_IDS) == []
    # offsets already recomputed (a seam) are not chosen again; the next best take their place
    assert choose(EDITED.with_recomputed([10, 11]), 3, OLD_IDS, NEW_IDS) == [14, 16, 35]


def test_overlap_chooses_nothing_without_removed_text():
    """An edit that only inserts text (no removed spans, or a plan that does not know them)."""
    inserted = dataclasses.replace(EDITED, removed=(0, 0), removed_spans=())
    assert POLICIES["overlap"].choose(inserted, 10, OLD_IDS, NEW_IDS) == []
    assert overlap_scores(inserted, OLD_IDS) == {}


def test_random_draws_the_count_among_relocated_offsets_the_same_way_every_time():
    """The control policy: a uniform draw of `count` distinct relocated offsets (never one already
    recomputed), increasing, the same for the same plan, spread over every span."""
    choose = POLICIES["random"].choose
    drawn = choose(PLAN, 30)
    relocated = relocated_offsets(PLAN)
    assert len(drawn) == 30 and drawn == sorted(set(drawn)) and set(drawn) <= set(relocated)
    assert drawn == choose(PLAN, 30)
    assert any(o < 60 for o in drawn) and any(o >= 80 for o in drawn)   # both spans drawn from
    assert choose(PLAN, 0) == [] and choose(PLAN, 10_000) == relocated
    partly = PLAN.with_recomputed([20, 21])
    assert not {20, 21} & set(choose(partly, len(relocated)))



class _Openings:
    """A MessageStarts stand-in: the same message openings for any prompt, and the calls it got."""

    def __init__(self, offsets):
        self.offsets, self.calls = offsets, []

    def openings(self, ids, tokens, within):
        self.calls.append(tokens)
        return [o for o in self.offsets if o in within]


def test_fixed_recompute_is_the_seams_and_the_openings_in_edited_spans_once_each():
    from kvsplice.reuse.config import ReuseConfig
    from kvsplice.reuse.recompute import fixed_recompute
    cfg = ReuseConfig(seam_tokens=4, message_start_tokens=2)
    finder = _Openings([5, 22, 50, 90, 150])   # 5: in the prefix, 150: computed anyway; 22: a seam too
    assert fixed_recompute(PLAN, list(range(200)), cfg, finder) == [20, 21, 22, 23, 50, 80, 81, 82, 83, 90]
    assert finder.calls == [2]
    assert fixed_recompute(PLAN, list(range(200)), cfg) == seam_offsets(PLAN, 4)
    assert fixed_recompute(PLAN, list(range(200)), dataclasses.replace(cfg, message_start_tokens=0), finder) == \
        seam_offsets(PLAN, 4) and finder.calls == [2]
