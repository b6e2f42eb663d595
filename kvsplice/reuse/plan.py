"""Which surviving spans to relocate, and which new tokens to compute.

    old_ids   [ A ][ B  ][ C1 ..........][ x ][ C2 ..........][ rest ]
    new_ids   [ A ][ B' ][ C1 ..........][ C2 ..........][ D ]
               |         |<- keep ->|tail |<- keep ->|tail
    radix cache          relocated       relocated          (src_pos -> dst_pos, delta = dst - src)
    computed:      B'                 tail            tail  D

A is served exactly by the radix cache (prefix_len tokens). Each chosen span relocates all but its
last `tail` tokens; those, the edits and the unchosen spans are computed. Everything from the first
relocated token on is approximate K/V (it saw a different context); everything before is exact.
Selective recompute (`kvsplice.reuse.recompute`) may then mark some relocated offsets `recomputed`:
they stay inside their keep (its K/V were copied) but are computed again in every layer, so they
count as prefilled, not relocated.
Selection follows the SCR overlay (reference notes §5): candidates are the equal runs after A whose
relocatable length reaches `min_span`, the K longest are taken (ties: the later run), and executed
in new-prompt order. Unlike the overlay, an edit at token 0 still gets a plan.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Sequence

from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import EqualRun, common_prefix_len


class PlanError(ValueError):
    """A SpanPlan violates one of its invariants."""


def runs_of(offsets: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Increasing, unique `offsets` as ranges [start, end) of consecutive offsets."""
    runs: list[tuple[int, int]] = []
    for offset in offsets:
        if runs and runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], offset + 1)
        else:
            runs.append((offset, offset + 1))
    return tuple(runs)


@dataclass(frozen=True)
class Keep:
    """One relocated span: old tokens [src_pos, src_pos + length) move to new positions
    [dst_pos, dst_pos + length); their keys are re-rotated by delta."""

    src_pos: int
    dst_pos: int
    length: int

    @property
    def delta(self) -> int:
        """dst_pos - src_pos: the RoPE position shift of every token of the span."""
        return self.dst_pos - self.src_pos

    @property
    def src_end(self) -> int:
        """One past the span's last position in the old sequence."""
        return self.src_pos + self.length

    @property
    def dst_end(self) -> int:
        """One past the span's last position in the new prompt."""
        return self.dst_pos + self.length


@dataclass(frozen=True)
class SpanPlan:
    """How one prompt of prompt_len tokens is served: [0, prefix_len) from the radix cache, the
    keeps relocated from the session, computed_ranges recomputed. `tail` is the minimum number of
    computed tokens after every keep. `recomputed`: new offsets inside keeps that are computed
    again after relocation (selective recompute), increasing. `removed`: per keep, how many old
    tokens right before it (since the previous keep, or the prefix) are gone from the new prompt
    (deleted or replaced text its K/V saw), or () when not known. `removed_spans`: where that text
    was, as old-offset ranges [start, end) before the last keep, increasing and disjoint, or ()
    when not known (selective recompute's "overlap" policy reads the old tokens there)."""

    prompt_len: int
    prefix_len: int
    keeps: tuple[Keep, ...]
    tail: int
    recomputed: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    removed_spans: tuple[tuple[int, int], ...] = ()

    @property
    def relocated_tokens(self) -> int:
        """Tokens whose relocated K/V are used as they are (keeps minus the recomputed offsets)."""
        return sum(keep.length for keep in self.keeps) - len(self.recomputed)

    @property
    def computed_ranges(self) -> tuple[tuple[int, int], ...]:
        """New-offset ranges [start, end) to compute: [prefix_len, prompt_len) minus the keeps,
        plus the recomputed offsets; non-empty, disjoint, increasing (adjacent ranges merged)."""
        ranges = list(runs_of(self.recomputed))
        start = self.prefix_len
        for keep in self.keeps:
            if keep.dst_pos > start:
                ranges.append((start, keep.dst_pos))
            start = max(start, keep.dst_end)
        if self.prompt_len > start:
            ranges.append((start, self.prompt_len))
        merged: list[tuple[int, int]] = []
        for low, high in sorted(ranges):
            if merged and merged[-1][1] == low:
                merged[-1] = (merged[-1][0], high)
            else:
                merged.append((low, high))
        return tuple(merged)

    def with_recomputed(self, offsets) -> SpanPlan:
        """This plan with `offsets` (relocated offsets, any order) recomputed as well."""
        return dataclasses.replace(self, recomputed=tuple(sorted(set(self.recomputed) | set(offsets))))

    @property
    def prefilled_tokens(self) -> int:
        """Tokens computed by the model: prompt_len - prefix_len - relocated_tokens."""
        return self.prompt_len - self.prefix_len - self.relocated_tokens

    @property
    def exact_len(self) -> int:
        """Offset of the first relocated token that is not recomputed, or prompt_len if none: K/V
        before it are exact (everything there attends only to exact K/V), from it on approximate
        (only the exact part may enter the shared radix cache)."""
        recomputed = set(self.recomputed)
        for keep in self.keeps:
            for offset in range(keep.dst_pos, keep.dst_end):
                if offset not in recomputed:
                    return offset
        return self.prompt_len

    def validate(self, old_ids: Sequence[int], new_ids: Sequence[int], old_kv_len: int) -> None:
        """Raise PlanError unless: prompt_len == len(new_ids); 0 <= prefix_len <= prompt_len;
        tail >= 1; keeps non-empty, disjoint and increasing in old and new and all at/after
        prefix_len; every relocated token identical in old and new; every src range within
        old_kv_len <= len(old_ids); at least `tail` computed tokens after every keep (so the
        prompt's last token is computed); recomputed offsets increasing, unique, each inside a
        keep; `removed` empty or one count >= 0 per keep; `removed_spans` non-empty ranges,
        increasing, disjoint, before the last keep and overlapping no keep; prefix + relocated +
        prefilled == prompt_len."""
        if self.prompt_len != len(new_ids):
            raise PlanError(f"prompt_len {self.prompt_len} != len(new_ids) {len(new_ids)}")
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise PlanError(f"prefix_len {self.prefix_len} outside [0, {self.prompt_len}]")
        if self.tail < 1:
            raise PlanError(f"tail {self.tail} < 1: the prompt's last token must be computed")
        if not 0 <= old_kv_len <= len(old_ids):
            raise PlanError(f"old_kv_len {old_kv_len} outside [0, {len(old_ids)}]")
        src_floor, dst_floor = 0, self.prefix_len
        for keep in self.keeps:
            _validate_keep(keep, src_floor, dst_floor, old_kv_len, old_ids, new_ids)
            if keep.dst_end + self.tail > self.prompt_len:
                raise PlanError(f"{keep} is followed by fewer than {self.tail} prompt tokens")
            src_floor, dst_floor = keep.src_end, keep.dst_end + self.tail
        _validate_recomputed(self.recomputed, self.keeps)
        if self.removed and (len(self.removed) != len(self.keeps) or min(self.removed) < 0):
            raise PlanError(f"removed {self.removed} must hold one count >= 0 per keep")
        _validate_removed_spans(self.removed_spans, self.keeps)
        computed = sum(end - start for start, end in self.computed_ranges)
        if self.prefix_len + self.relocated_tokens + computed != self.prompt_len:
            raise PlanError("prefix + relocated + prefilled != prompt_len")


def _validate_keep(keep: Keep, src_floor: int, dst_floor: int, old_kv_len: int,
                   old_ids: Sequence[int], new_ids: Sequence[int]) -> None:
    """Raise PlanError unless `keep` is non-empty, starts at/after both floors (the previous keep's
    end in old, its end plus tail in new), lies within old_kv_len and matches token for token."""
    if keep.length < 1:
        raise PlanError(f"{keep} is empty")
    if keep.src_pos < src_floor:
        raise PlanError(f"{keep} starts before old offset {src_floor} (overlap or out of order)")
    if keep.dst_pos < dst_floor:
        raise PlanError(f"{keep} starts before new offset {dst_floor} (prefix, overlap or short tail)")
    if keep.src_end > old_kv_len:
        raise PlanError(f"{keep} reads old positions beyond old_kv_len {old_kv_len}")
    if list(old_ids[keep.src_pos : keep.src_end]) != list(new_ids[keep.dst_pos : keep.dst_end]):
        raise PlanError(f"{keep} relocates tokens that differ between old and new")


def _validate_recomputed(recomputed: Sequence[int], keeps: Sequence[Keep]) -> None:
    """Raise PlanError unless `recomputed` is strictly increasing and every offset lies in a keep."""
    if any(b <= a for a, b in zip(recomputed, recomputed[1:])):
        raise PlanError("recomputed offsets must be strictly increasing")
    starts = [keep.dst_pos for keep in keeps]
    for offset in recomputed:
        position = bisect.bisect_right(starts, offset) - 1
        if position < 0 or offset >= keeps[position].dst_end:
            raise PlanError(f"recomputed offset {offset} lies in no keep")


def _validate_removed_spans(spans: Sequence[tuple[int, int]], keeps: Sequence[Keep]) -> None:
    """Raise PlanError unless `spans` are non-empty old ranges, increasing and disjoint, ending at
    or before the last keep's start and overlapping no keep (a keep's tokens are still there)."""
    floor = 0
    for start, end in spans:
        if not floor <= start < end:
            raise PlanError(f"removed span {(start, end)} is empty, out of order or overlaps the previous one")
        floor = end
    if spans and (not keeps or spans[-1][1] > keeps[-1].src_pos):
        raise PlanError(f"removed span {spans[-1]} does not lie before the last keep")
    for start, end in spans:
        if any(start < keep.src_end and keep.src_pos < end for keep in keeps):
            raise PlanError(f"removed span {(start, end)} overlaps a keep")


@dataclass(frozen=True)
class PrefillBreakdown:
    """Why each prefilled token was computed: `changed` (new tokens in no equal run: B' and D),
    `span_tails` (the tails of relocated spans), `unchosen_spans` (equal-run tokens after A that
    were not relocated: not among the K longest, too short, or beyond the old K/V),
    `uncached_unchanged` (the common prefix of old and new beyond prefix_len, which the radix cache
    did not serve), `recomputed` (relocated tokens computed again by selective recompute)."""

    changed: int = 0
    span_tails: int = 0
    unchosen_spans: int = 0
    uncached_unchanged: int = 0
    recomputed: int = 0

    @property
    def total(self) -> int:
        """The sum of the five categories (== the plan's prefilled tokens)."""
        return self.changed + self.span_tails + self.unchosen_spans + self.uncached_unchanged + self.recomputed


@dataclass(frozen=True)
class PlanResult:
    """make_plan's answer: the plan, or None with the reason; and the prefilled-token breakdown
    (of the plan, or of plain prefill after prefix_len when there is no plan)."""

    plan: SpanPlan | None
    reason: str | None
    breakdown: PrefillBreakdown


def make_plan(
    old_ids: Sequence[int],
    new_ids: Sequence[int],
    runs: Sequence[EqualRun],
    *,
    prefix_len: int,
    old_kv_len: int,
    cfg: ReuseConfig,
) -> PlanResult:
    """Plan the reuse of a session's K/V for new_ids, given diff_tokens(old_ids, new_ids) runs,
    the radix-served prefix length and the number of old tokens with K/V. The plan (when one is
    returned) passes validate(). No plan, with reason, when SCR is off ("disabled"), the session
    holds no tokens ("no_session_tokens"), or no run after the prefix is long enough ("no_spans").
    Raises ValueError on a prefix_len or old_kv_len out of range."""
    prompt_len = len(new_ids)
    if not 0 <= prefix_len <= prompt_len:
        raise ValueError(f"prefix_len {prefix_len} outside [0, {prompt_len}]")
    if not 0 <= old_kv_len <= len(old_ids):
        raise ValueError(f"old_kv_len {old_kv_len} outside [0, {len(old_ids)}]")
    reason = None
    keeps: tuple[Keep, ...] = ()
    if not cfg.enabled:
        reason = "disabled"
    elif old_kv_len == 0:
        reason = "no_session_tokens"
    else:
        keeps = choose_keeps(runs, prefix_len=prefix_len, old_kv_len=old_kv_len, cfg=cfg, prompt_len=prompt_len)
        reason = None if keeps else "no_spans"
    breakdown = prefill_breakdown(old_ids, new_ids, runs, prefix_len=prefix_len, keeps=keeps, tail=cfg.tail)
    removed = removed_before(keeps, runs)
    plan = SpanPlan(prompt_len, prefix_len, keeps, cfg.tail, removed=removed,
                    removed_spans=removed_spans(keeps, runs)) if keeps else None
    return PlanResult(plan, reason, breakdown)


def removed_before(keeps: Sequence[Keep], runs: Sequence[EqualRun]) -> tuple[int, ...]:
    """Per keep, the old tokens between the previous keep's end (the first keep: old offset 0) and
    the keep's start that lie in no equal run: text the keep's K/V attended to that the new prompt
    no longer has (every token of an equal run is still in the new prompt).

        old   [ A ][ C1 keep ][tail][ removed ][ x ][ more removed ][ C2 keep ]
        new   [ A ][ C1 keep ][tail][ inserted ][ x ][ C2 keep ]
        removed_before: C1 -> 0, C2 -> |removed| + |more removed|      (A, tail and x: equal runs)
    """
    counts = []
    start = 0
    for keep in keeps:
        kept = sum(max(0, min(run.old_end, keep.src_pos) - max(run.old_offset, start)) for run in runs)
        counts.append(max(0, keep.src_pos - start - kept))
        start = keep.src_end
    return tuple(counts)


def removed_spans(keeps: Sequence[Keep], runs: Sequence[EqualRun]) -> tuple[tuple[int, int], ...]:
    """The old text before the last keep that lies in no equal run (what `removed_before` counts),
    as old-offset ranges [start, end), increasing and disjoint. `runs` are increasing in old."""
    if not keeps:
        return ()
    limit = keeps[-1].src_pos
    spans: list[tuple[int, int]] = []
    start = 0
    for run in sorted(runs, key=lambda r: r.old_offset):
        if run.old_offset >= limit:
            break
        if run.old_offset > start:
            spans.append((start, run.old_offset))
        start = max(start, run.old_end)
    if start < limit:
        spans.append((start, limit))
    return tuple(spans)


def choose_keeps(runs: Sequence[EqualRun], *, prefix_len: int, old_kv_len: int, cfg: ReuseConfig,
                 prompt_len: int) -> tuple[Keep, ...]:
    """The keeps, in new order: each run is clipped to start at/after prefix_len in new; its
    relocatable part is [start, end - tail), clipped to old_kv_len in old; runs whose relocatable
    part reaches min_span are candidates; the cfg.span_limit(prompt_len) longest win (ties: the
    later run)."""
    candidates = []
    for order, run in enumerate(runs):
        cut = max(0, prefix_len - run.new_offset)
        src_pos, dst_pos = run.old_offset + cut, run.new_offset + cut
        length = min(run.length - cut - cfg.tail, old_kv_len - src_pos)
        if length >= cfg.min_span:
            candidates.append((length, order, Keep(src_pos, dst_pos, length)))
    candidates.sort(key=lambda item: (item[0], item[1]), reverse=True)
    chosen = [keep for _, _, keep in candidates[: cfg.span_limit(prompt_len)]]
    return tuple(sorted(chosen, key=lambda keep: keep.dst_pos))


def prefill_breakdown(
    old_ids: Sequence[int],
    new_ids: Sequence[int],
    runs: Sequence[EqualRun],
    *,
    prefix_len: int,
    keeps: Sequence[Keep],
    tail: int,
    recomputed: Sequence[int] = (),
) -> PrefillBreakdown:
    """Classify every computed new offset in [prefix_len, len(new_ids)) minus the keeps plus the
    `recomputed` offsets, first match wins: a recomputed offset -> recomputed; the `tail` tokens
    after a keep -> span_tails; inside the common prefix of old and new -> uncached_unchanged;
    inside an equal run -> unchosen_spans; else changed. Pass keeps=() for the breakdown of plain
    prefill (e.g. after a relocation fell back)."""
    prompt_len = len(new_ids)
    common = common_prefix_len(old_ids, new_ids)
    plan = SpanPlan(prompt_len, prefix_len, tuple(keeps), tail, tuple(recomputed))
    families = (
        ("recomputed", list(runs_of(plan.recomputed))),
        ("span_tails", [(keep.dst_end, min(keep.dst_end + tail, prompt_len)) for keep in keeps]),
        ("uncached_unchanged", [(0, common)]),
        ("unchosen_spans", [(run.new_offset, run.new_end) for run in runs]),
    )
    cuts = sorted({edge for _, ranges in families for pair in ranges for edge in pair})
    counts = {"changed": 0, "span_tails": 0, "unchosen_spans": 0, "uncached_unchanged": 0, "recomputed": 0}
    for start, end in plan.computed_ranges:
        inner = cuts[bisect.bisect_right(cuts, start) : bisect.bisect_left(cuts, end)]
        for low, high in zip([start, *inner], [*inner, end]):
            counts[_family_of(low, families)] += high - low
    return PrefillBreakdown(**counts)


def _family_of(offset: int, families: Sequence[tuple[str, Sequence[tuple[int, int]]]]) -> str:
    """Name of the first family with a range holding `offset` (each family's ranges sorted and
    disjoint), or "changed"."""
    for name, ranges in families:
        position = bisect.bisect_right(ranges, (offset, float("inf"))) - 1
        if position >= 0 and ranges[position][0] <= offset < ranges[position][1]:
            return name
    return "changed"
