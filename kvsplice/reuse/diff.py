"""Token diff of a conversation's previous sequence (old_ids) against its new prompt (new_ids).

The result is the list of equal runs: stretches of tokens that are identical in both sequences,
increasing in both offsets and non-overlapping. Everything between runs is an edit:

    old_ids  [ A ][ B  ][ C1 ][ x ][ C2 ]
    new_ids  [ A ][ B' ][ C1 ][ C2 ][ D ]
    runs      A          C1    C2          (B -> B' replaced, x deleted, D inserted)

Two paths (shared/reference/scr-reference-notes.md §4):
- token level: `difflib.SequenceMatcher(autojunk=False)` over the ids, used for short sequences
  and as the fallback;
- fast path, when both sequences hold at least `fastdiff_min` tokens: content-defined chunking
  (CDC), chunks interned to integers, SequenceMatcher over the chunk ids, equal chunk blocks mapped
  back to tokens and extended token by token, short gaps refined at token level, then VERIFIED.
  A run list that fails verification, or any exception raised by the fast path (a bug or an
  out-of-range setting must never end the caller), falls back to the token-level diff and is
  counted in the caller's DiffStats; an exception is also logged with its traceback.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EqualRun:
    """old_ids[old_offset : old_offset + length] == new_ids[new_offset : new_offset + length]."""

    old_offset: int
    new_offset: int
    length: int

    @property
    def old_end(self) -> int:
        """One past the run's last offset in old_ids."""
        return self.old_offset + self.length

    @property
    def new_end(self) -> int:
        """One past the run's last offset in new_ids."""
        return self.new_offset + self.length


DiffPath = Literal["empty", "token", "fast", "fallback"]  # "empty": nothing left to diff


@dataclass
class DiffStats:
    """Counters a caller passes to diff_tokens (no module globals): how many diffs took each path
    (diffs with nothing to diff after the common prefix and suffix are not counted), and the path
    of the latest one. `fallbacks` counts fast-path results rejected by verification
    or raising."""

    token: int = 0
    fast: int = 0
    fallbacks: int = 0
    last_path: DiffPath | None = None

    def record(self, path: DiffPath) -> None:
        """Count one diff that took `path`."""
        self.last_path = path
        if path == "token":
            self.token += 1
        elif path == "fast":
            self.fast += 1
        elif path == "fallback":
            self.fallbacks += 1


FastRuns = Callable[[list[int], list[int], int], list[EqualRun]]


def diff_tokens(
    old_ids: Sequence[int],
    new_ids: Sequence[int],
    *,
    fastdiff_min: int = 2048,
    cdc_target: int = 64,
    stats: DiffStats | None = None,
    fast_runs: FastRuns | None = None,
) -> list[EqualRun]:
    """Equal runs between old_ids and new_ids, increasing in both offsets, non-overlapping, each
    verified token-identical; adjacent runs are merged. Empty input gives [].

    The common prefix and the common suffix are always whole runs (so a pure append or no edit
    gives the single run (0, 0, len(old_ids)) when old_ids is a prefix of new_ids). The middles
    left between them are diffed with the fast chunk path when both hold at least fastdiff_min
    tokens, else with token-level difflib; path "empty" when a middle is empty (nothing to diff).
    `fast_runs` replaces the fast path's run finder (default `chunked_runs`; a test may pass a wrong
    one to exercise the fallback). `stats`, if given, is updated with the path taken.
    """
    old, new = list(old_ids), list(new_ids)
    head = common_prefix_len(old, new)
    tail = common_suffix_len(old, new, max_len=min(len(old), len(new)) - head)
    old_mid, new_mid = old[head : len(old) - tail], new[head : len(new) - tail]
    path: DiffPath
    if not old_mid or not new_mid:
        middle, path = [], "empty"
    elif min(len(old_mid), len(new_mid)) < fastdiff_min:
        middle, path = token_runs(old_mid, new_mid), "token"
    else:
        middle, path = _fast_or_token_runs(old_mid, new_mid, cdc_target, fast_runs or chunked_runs)
    runs = [EqualRun(0, 0, head)] if head else []
    runs += [EqualRun(run.old_offset + head, run.new_offset + head, run.length) for run in middle]
    if tail:
        runs.append(EqualRun(len(old) - tail, len(new) - tail, tail))
    if stats is not None:
        stats.record(path)
    return merge_adjacent(runs)


def _fast_or_token_runs(old: list[int], new: list[int], cdc_target: int,
                        fast_runs: FastRuns) -> tuple[list[EqualRun], DiffPath]:
    """The fast path's runs if they verify, else the token path's ("fallback"). Any exception of the
    fast path (not only the expected ValueError / IndexError) is caught: the fast path is an
    optimisation, and the token path gives a correct answer whatever went wrong."""
    try:
        runs = fast_runs(old, new, cdc_target)
        if verify_runs(old, new, runs):
            return runs, "fast"
    except Exception:  # noqa: BLE001 -- see the docstring
        logger.warning("the fast diff path failed (cdc_target=%r); using the token diff", cdc_target,
                       exc_info=True)
    return token_runs(old, new), "fallback"


def common_prefix_len(old_ids: Sequence[int], new_ids: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of the two sequences, at most `limit` if given.
    Compares 256-token slices first, then tokens, so long equal prefixes cost C-speed compares."""
    bound = min(len(old_ids), len(new_ids))
    if limit is not None:
        bound = min(bound, limit)
    offset, step = 0, 256
    while offset + step <= bound and list(old_ids[offset : offset + step]) == list(new_ids[offset : offset + step]):
        offset += step
    while offset < bound and old_ids[offset] == new_ids[offset]:
        offset += 1
    return offset


def common_suffix_len(old: list[int], new: list[int], max_len: int) -> int:
    """Length of the longest common suffix of the two lists, at most max_len (256-token slices
    first, then tokens)."""
    count, step = 0, 256
    while count + step <= max_len and old[len(old) - count - step : len(old) - count] == new[len(new) - count - step : len(new) - count]:
        count += step
    while count < max_len and old[len(old) - 1 - count] == new[len(new) - 1 - count]:
        count += 1
    return count


def verify_runs(old_ids: Sequence[int], new_ids: Sequence[int], runs: Sequence[EqualRun]) -> bool:
    """True iff every run is non-empty, lies inside both sequences, starts at or after the previous
    run's end in both (so runs and the gaps between them tile both sequences), and is token-identical.
    Checks correctness, not optimality."""
    old_end = new_end = 0
    for run in runs:
        if run.length <= 0 or run.old_offset < old_end or run.new_offset < new_end:
            return False
        if run.old_end > len(old_ids) or run.new_end > len(new_ids):
            return False
        if old_ids[run.old_offset : run.old_end] != new_ids[run.new_offset : run.new_end]:
            return False
        old_end, new_end = run.old_end, run.new_end
    return True


def token_runs(old: list[int], new: list[int], old_base: int = 0, new_base: int = 0) -> list[EqualRun]:
    """Token-level difflib matching blocks as EqualRuns, offsets shifted by the two bases.
    Near-linear for typical edits, up to O(len(old) * len(new)) with many repeated tokens."""
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    return [
        EqualRun(old_base + block.a, new_base + block.b, block.size)
        for block in matcher.get_matching_blocks()
        if block.size > 0
    ]


# --- fast path -------------------------------------------------------------------------------

_GOLDEN = 0x9E3779B1  # 2^32 / golden ratio, the overlay's multiplier
_HASH_SHIFT = 8  # the overlay tests bits 8 .. 8 + log2(target) - 1 of its rolling hash


def chunk_bounds(ids: list[int], target: int) -> list[int]:
    """Content-defined chunk boundaries of `ids`: offsets 0 = b0 < b1 < ... < bn = len(ids).

    The rolling hash is the SCR overlay's (reference notes §4.1): h_i = (h_{i-1} << 1) XOR
    (t_i * 0x9E3779B1 mod 2^32) mod 2^32, with a cut after token i when bits 8 .. 8+log2(target)-1
    of h_i are all zero (probability 1/target). Those bits depend only on the last 8+log2(target)
    tokens, since each step shifts older tokens' bits upwards, so we compute them directly as
    XOR_j (mix(t_{i-j}) << j) over that window, vectorised, which is bit-identical to the recursion.
    Unlike the overlay we bound chunk sizes to [target/4, 4*target]: a run of repeated tokens (which
    hashes to a constant) can neither make one huge chunk nor a chunk per token.
    """
    count = len(ids)
    if count == 0:
        return [0]
    bits = _HASH_SHIFT + (target.bit_length() - 1)
    mixed = (np.asarray(ids, dtype=np.int64).astype(np.uint64) * np.uint64(_GOLDEN)) & np.uint64(0xFFFFFFFF)
    window_hash = np.zeros(count, dtype=np.uint64)
    for back in range(min(bits, count)):
        window_hash[back:] ^= mixed[: count - back] << np.uint64(back)
    mask = np.uint64((target - 1) << _HASH_SHIFT)
    natural_cuts = np.flatnonzero((window_hash & mask) == 0) + 1  # cut after token i -> boundary i+1
    return _bounded_bounds(natural_cuts.tolist(), count, max(1, target // 4), target * 4)


def _bounded_bounds(natural_cuts: list[int], count: int, min_size: int, max_size: int) -> list[int]:
    """Boundaries from natural cut offsets, skipping cuts closer than min_size to the previous
    boundary and forcing a cut every max_size tokens without one."""
    bounds = [0]
    for cut in natural_cuts:
        while cut - bounds[-1] > max_size:
            bounds.append(bounds[-1] + max_size)
        if cut - bounds[-1] >= min_size and cut < count:
            bounds.append(cut)
    while count - bounds[-1] > max_size:
        bounds.append(bounds[-1] + max_size)
    if bounds[-1] != count:
        bounds.append(count)
    return bounds


def chunked_runs(old: list[int], new: list[int], target: int) -> list[EqualRun]:
    """Fast-path equal runs (unverified): CDC chunks of both sequences interned to integers (one
    table for both), SequenceMatcher over the chunk ids, equal chunk blocks mapped back to tokens,
    extended token-wise, short two-sided gaps refined at token level, adjacent runs merged."""
    old_bounds, new_bounds = chunk_bounds(old, target), chunk_bounds(new, target)
    table: dict[tuple[int, ...], int] = {}
    old_chunks = [table.setdefault(tuple(old[a:b]), len(table)) for a, b in zip(old_bounds, old_bounds[1:])]
    new_chunks = [table.setdefault(tuple(new[a:b]), len(table)) for a, b in zip(new_bounds, new_bounds[1:])]
    matcher = difflib.SequenceMatcher(None, old_chunks, new_chunks, autojunk=False)
    runs = []
    for block in matcher.get_matching_blocks():
        if block.size == 0:
            continue
        old_start, old_stop = old_bounds[block.a], old_bounds[block.a + block.size]
        new_start, new_stop = new_bounds[block.b], new_bounds[block.b + block.size]
        if old_stop - old_start != new_stop - new_start:
            raise ValueError("equal chunk blocks of different token lengths")
        runs.append(EqualRun(old_start, new_start, old_stop - old_start))
    runs = _extend_runs(old, new, runs)
    runs = _refine_gaps(old, new, runs, max_gap=16 * target)
    return merge_adjacent(runs)


def _extend_runs(old: list[int], new: list[int], runs: list[EqualRun]) -> list[EqualRun]:
    """Grow each run backwards (not past the previous run's end) and then forwards (not past the
    next run's start) while the tokens match, as the overlay's CDC_EXTEND does."""
    grown: list[EqualRun] = []
    old_floor = new_floor = 0
    for run in runs:
        old_start, new_start = run.old_offset, run.new_offset
        while old_start > old_floor and new_start > new_floor and old[old_start - 1] == new[new_start - 1]:
            old_start, new_start = old_start - 1, new_start - 1
        grown.append(EqualRun(old_start, new_start, run.old_end - old_start))
        old_floor, new_floor = run.old_end, run.new_end
    old_ceiling, new_ceiling = len(old), len(new)
    for position in range(len(grown) - 1, -1, -1):
        run = grown[position]
        old_stop, new_stop = run.old_end, run.new_end
        while old_stop < old_ceiling and new_stop < new_ceiling and old[old_stop] == new[new_stop]:
            old_stop, new_stop = old_stop + 1, new_stop + 1
        grown[position] = EqualRun(run.old_offset, run.new_offset, old_stop - run.old_offset)
        old_ceiling, new_ceiling = run.old_offset, run.new_offset
    return grown


def _refine_gaps(old: list[int], new: list[int], runs: list[EqualRun], max_gap: int) -> list[EqualRun]:
    """Token-level diff inside each gap that has tokens on both sides and at most max_gap on
    each, so equal stretches shorter than a chunk (between nearby edits) are found too."""
    refined: list[EqualRun] = []
    old_prev = new_prev = 0
    for run in [*runs, EqualRun(len(old), len(new), 0)]:
        old_gap, new_gap = run.old_offset - old_prev, run.new_offset - new_prev
        if 0 < old_gap <= max_gap and 0 < new_gap <= max_gap:
            refined.extend(token_runs(old[old_prev : run.old_offset], new[new_prev : run.new_offset], old_prev, new_prev))
        if run.length:
            refined.append(run)
        old_prev, new_prev = run.old_end, run.new_end
    return refined


def merge_adjacent(runs: list[EqualRun]) -> list[EqualRun]:
    """Merge runs that continue each other in both sequences into one."""
    merged: list[EqualRun] = []
    for run in runs:
        if merged and merged[-1].old_end == run.old_offset and merged[-1].new_end == run.new_offset:
            merged[-1] = EqualRun(merged[-1].old_offset, merged[-1].new_offset, merged[-1].length + run.length)
        else:
            merged.append(run)
    return merged
