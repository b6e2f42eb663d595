"""Selective recompute's pure parts: seams, and the spans from the first edit on."""

import dataclasses

from kvsplice.reuse.plan import Keep, SpanPlan
from kvsplice.reuse.recompute import edited_offsets, in_edited_keeps, seam_lengths, seam_offsets

PLAN = SpanPlan(200, 10, (Keep(30, 20, 40), Keep(100, 80, 60)), tail=8)


def test_seams_take_a_fixed_head_of_every_span():
    assert seam_offsets(PLAN, 3) == [20, 21, 22, 80, 81, 82]
    assert seam_offsets(PLAN, 50) == list(range(20, 60)) + list(range(80, 130))
    assert seam_offsets(PLAN, 0) == []


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
    assert edited_offsets(PLAN) == list(range(20, 60)) + list(range(80, 140))   # both spans moved
    assert 21 not in edited_offsets(dataclasses.replace(PLAN, recomputed=(21,)))


def test_in_edited_keeps_filters_offsets_as_the_edited_offsets_reference_does():
    plans = [SpanPlan(200, 10, (Keep(10, 10, 40), Keep(60, 50, 60)), tail=8, removed=(0, 0)),
             SpanPlan(200, 10, (Keep(10, 10, 40),), tail=8, removed=(0,)),
             dataclasses.replace(PLAN, recomputed=(21, 85))]
    for plan in plans:
        assert in_edited_keeps(plan, range(200)) == edited_offsets(plan)
