"""diff_tokens: verified equal runs, token-level and fast (CDC) paths, fallback on bad runs."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.reuse.diff import (
    DiffStats, EqualRun, _bounded_bounds, chunk_bounds, common_prefix_len, diff_tokens, token_runs, verify_runs,
)


@st.composite
def edited_pair(draw, max_len=300, vocab=8):
    """An old sequence and a new one made from it by a few random inserts/deletes/replaces/appends."""
    old = draw(st.lists(st.integers(0, vocab - 1), max_size=max_len))
    new = list(old)
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["insert", "delete", "replace", "append"]))
        at = draw(st.integers(0, len(new)))
        piece = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20))
        if kind == "insert":
            new[at:at] = piece
        elif kind == "delete":
            del new[at : at + len(piece)]
        elif kind == "replace":
            new[at : at + len(piece)] = piece
        else:
            new += piece
    return old, new


def covered(runs):
    return sum(run.length for run in runs)


def test_small_substitution_uses_token_path():
    stats = DiffStats()
    assert diff_tokens([1, 2, 3], [1, 9, 3], stats=stats) == [EqualRun(0, 0, 1), EqualRun(2, 2, 1)]
    assert (stats.token, stats.fast, stats.last_path) == (1, 0, "token")


def test_empty_sequences():
    stats = DiffStats()
    assert diff_tokens([], [], stats=stats) == [] and stats.last_path == "empty"
    assert diff_tokens([1, 2], []) == [] and diff_tokens([], [1, 2]) == []


def test_edit_at_token_zero_insert_delete_and_several_edits():
    base = list(range(100))
    assert diff_tokens(base, [999] + base[1:]) == [EqualRun(1, 1, 99)]
    assert diff_tokens(base, [7, 7] + base) == [EqualRun(0, 2, 100)]
    assert diff_tokens(base, base[:40] + base[60:]) == [EqualRun(0, 0, 40), EqualRun(60, 40, 40)]
    new = base[:10] + [500, 501] + base[10:50] + base[55:90] + [600] + base[91:] + [700]
    assert diff_tokens(base, new) == [EqualRun(0, 0, 10), EqualRun(10, 12, 40), EqualRun(55, 52, 35), EqualRun(91, 88, 9)]


@settings(max_examples=150, deadline=None)
@given(edited_pair())
def test_both_paths_give_verified_runs(pair):
    old, new = pair
    for fastdiff_min in (10**9, 0):
        stats = DiffStats()
        runs = diff_tokens(old, new, fastdiff_min=fastdiff_min, cdc_target=4, stats=stats)
        assert verify_runs(old, new, runs)
        assert stats.fallbacks == 0
        assert stats.last_path in (("empty", "token") if fastdiff_min else ("empty", "fast"))
        head = common_prefix_len(old, new)
        if head:
            assert runs[0].old_offset == runs[0].new_offset == 0 and runs[0].length >= head
    if old == new and old:
        assert diff_tokens(old, new, fastdiff_min=0, cdc_target=4) == [EqualRun(0, 0, len(old))]


def test_verify_rejects_bad_runs():
    old, new = [1, 2, 3, 4], [1, 2, 3, 4]
    assert verify_runs(old, new, [EqualRun(0, 0, 2), EqualRun(2, 2, 2)])
    assert not verify_runs(old, new, [EqualRun(0, 0, 2), EqualRun(1, 2, 2)])  # overlap in old
    assert not verify_runs(old, new, [EqualRun(2, 2, 2), EqualRun(0, 0, 2)])  # decreasing
    assert not verify_runs(old, new, [EqualRun(0, 1, 2)])  # tokens differ
    assert not verify_runs(old, new, [EqualRun(3, 3, 2)])  # out of bounds
    assert not verify_runs(old, new, [EqualRun(0, 0, 0)])  # empty


def _seed_natural_cuts(ids, target):
    """The overlay's rolling hash, written as its recursion (reference notes §4.1)."""
    h, cuts = 0, []
    for offset, token in enumerate(ids):
        h = ((h << 1) ^ ((token * 0x9E3779B1) & 0xFFFFFFFF)) & 0xFFFFFFFF
        if (h >> 8) & (target - 1) == 0:
            cuts.append(offset + 1)
    return cuts


def test_chunk_bounds_use_the_seed_hash_with_size_limits():
    rng = random.Random(3)
    ids = [rng.randrange(50_000) for _ in range(5000)]
    bounds = chunk_bounds(ids, 64)
    assert bounds == _bounded_bounds(_seed_natural_cuts(ids, 64), len(ids), 16, 256)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert bounds[0] == 0 and bounds[-1] == len(ids)
    assert max(sizes) <= 256 and min(sizes[:-1]) >= 16
    assert 40 < sum(sizes) / len(sizes) < 120
    constant = chunk_bounds([5] * 1000, 64)
    assert [b - a for a, b in zip(constant, constant[1:])][:-1] == [256] * 3


def _document(rng, count):
    return [rng.randrange(32_000) for _ in range(count)]


def test_common_prefix_and_suffix_are_whole_runs():
    stats = DiffStats()
    old = [1, 0, 0, 1, 1, 1]
    assert diff_tokens(old, old + [0, 1, 1], fastdiff_min=0, cdc_target=4, stats=stats) == [EqualRun(0, 0, 6)]
    assert stats.last_path == "empty"
    assert diff_tokens(old, old, fastdiff_min=0, cdc_target=4) == [EqualRun(0, 0, 6)]
    assert diff_tokens(old, [5] + old[1:], fastdiff_min=0, cdc_target=4) == [EqualRun(1, 1, 5)]


def test_fast_path_substitution_with_append_and_realistic_edit():
    rng = random.Random(0)
    old = _document(rng, 4096)
    new = list(old) + _document(rng, 200)
    new[1000] = 32_001
    stats = DiffStats()
    runs = diff_tokens(old, new, stats=stats)
    assert stats.last_path == "fast" and runs == [EqualRun(0, 0, 1000), EqualRun(1001, 1001, 3095)]
    note = [32_005] * 30
    new = old[:1500] + note + old[1500:2500] + old[3000:] + _document(rng, 200)
    runs = diff_tokens(old, new, stats=stats)
    assert stats.fast == 2 and stats.fallbacks == 0
    assert runs == [EqualRun(0, 0, 1500), EqualRun(1500, 1530, 1000), EqualRun(3000, 2530, 1096)]
    assert covered(runs) == covered(token_runs(old, new))


def test_forced_verification_failure_falls_back_to_token_diff():
    rng = random.Random(1)
    old = _document(rng, 3000)
    new = old[:500] + old[600:] + _document(rng, 100)
    stats = DiffStats()
    def lying(old_mid, new_mid, target):
        return [EqualRun(0, 0, 1100)]  # claims the deleted part survived
    runs = diff_tokens(old, new, stats=stats, fast_runs=lying)
    assert (stats.fallbacks, stats.fast, stats.last_path) == (1, 0, "fallback")
    assert runs == [EqualRun(0, 0, 500), EqualRun(600, 500, 2400)]

    def broken(old_mid, new_mid, target):
        raise ValueError("boom")

    assert diff_tokens(old, new, stats=stats, fast_runs=broken) == runs and stats.fallbacks == 2
    assert diff_tokens(old, new, stats=stats) == runs and stats.fast == 1


def test_any_fast_path_exception_falls_back_never_escapes(caplog):
    """An out-of-range chunk size (2**60 overflowed the rolling hash's bit mask) or any other
    exception of the fast path gives the token path's runs, counted and logged."""
    rng = random.Random(3)
    old = _document(rng, 600)
    new = old[:100] + _document(rng, 20) + old[150:]
    expected = diff_tokens(old, new, fastdiff_min=10**9)   # the token path
    stats = DiffStats()
    assert diff_tokens(old, new, fastdiff_min=0, cdc_target=2**60, stats=stats) == expected
    assert stats.last_path == "fallback" and any(r.exc_info for r in caplog.records)

    def raising(kind):
        def fast(old_mid, new_mid, target):
            raise kind("boom")
        return fast

    for kind in (OverflowError, TypeError, KeyError, RuntimeError, AssertionError):
        assert diff_tokens(old, new, fastdiff_min=0, stats=stats, fast_runs=raising(kind)) == expected
    assert stats.fallbacks == 6


def test_128k_tokens_with_a_few_edits_take_the_fast_path():
    # the chunk path answers and verifies (no token-level diff of the 128K middle); its time is
    # measured by benchmarks/scr_plan_speed.py
    rng = random.Random(2)
    old = _document(rng, 131_072)
    new = old[:30_000] + _document(rng, 40) + old[32_048:90_000] + old[90_500:] + _document(rng, 200)
    stats = DiffStats()
    runs = diff_tokens(old, new, stats=stats)
    assert (stats.last_path, stats.fast, stats.token, stats.fallbacks) == ("fast", 1, 0, 0)
    assert [(run.old_offset, run.new_offset) for run in runs] == [(0, 0), (32_048, 30_040), (90_500, 87_992)]
