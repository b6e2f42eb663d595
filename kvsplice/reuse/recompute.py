"""Selective recompute: after relocation, compute again the relocated tokens whose K/V are furthest
from what a full recompute would give.

A relocated token's K/V were computed while the old context was visible; in the new prompt its
context lost or gained text. Measured on the default model, the deviation sits right after each
seam: the first tokens of a span deviate far more in the deep layers than tokens a few hundred
positions in, and layer 1 barely shows it (so CacheBlend's layer-1 check, Yao et al., EuroSys 2025,
ranks them poorly; docs/BENCHMARKS_HISTORY.md, "Selective recompute: the fidelity front" and
"Figures formerly quoted in code"). Tokens are recomputed in every layer, in the
request's main forward, next to B', the span tails and D:

    new prompt       [ A ][ B' ][ C1 relocated ............ ][tail][ C2 relocated ...... ][tail][ D ]
    seam_tokens             ^^^^                                    ^^^^                        (first N of each span)
    message openings                    ^^                                   ^^     (role, \\n, first M content
                                                                                    tokens of every message in a
                                                                                    span: kvsplice.message_offsets)
    main forward           B'   ^^^^ ...                      tail  ^^^^ ...             tail  D

Both are chosen at admission from the plan and the prompt's token ids (the engine's ReuseManager
combines them); nothing here runs the model.
"""

from __future__ import annotations

from typing import Sequence

from kvsplice.reuse.plan import Keep, SpanPlan


def edited_keeps(plan: SpanPlan) -> tuple[Keep, ...]:
    """The keeps of `plan` from its first span whose context was edited on: a span that moved
    (delta != 0) or follows removed old text, and every span after it. A span before every edit
    (a turn that only appends: delta 0, nothing removed) sees the context its K/V were computed
    with, so recomputing it would give the same K/V."""
    removed = plan.removed or (0,) * len(plan.keeps)
    first = next((i for i, (keep, gone) in enumerate(zip(plan.keeps, removed)) if keep.delta or gone),
                 len(plan.keeps))
    return plan.keeps[first:]


def edited_offsets(plan: SpanPlan) -> list[int]:
    """The relocated (not yet recomputed) offsets of `edited_keeps(plan)`, increasing: the
    reference `in_edited_keeps` is tested against."""
    recomputed = set(plan.recomputed)
    return [o for keep in edited_keeps(plan) for o in range(keep.dst_pos, keep.dst_end) if o not in recomputed]


def in_edited_keeps(plan: SpanPlan, offsets: Sequence[int]) -> list[int]:
    """The `offsets` that `edited_offsets(plan)` holds, in their order, without building that list
    (a prompt's relocated offsets can number 10^5; the offsets asked about, a few thousand)."""
    keeps, recomputed = edited_keeps(plan), set(plan.recomputed)
    return [o for o in offsets
            if o not in recomputed and any(keep.dst_pos <= o < keep.dst_end for keep in keeps)]


def seam_lengths(plan: SpanPlan, tokens: int, after_removed: int = 0) -> list[int]:
    """Per keep, its seam: `tokens`, or `max(tokens, after_removed)` when old text was removed
    right before it (`plan.removed`), at most the whole span. A span after removed text saw that
    text; measured on the default model, what carries it to later positions lies in the first
    hundred or two tokens after the seam (docs/BENCHMARKS.md, the fresh cases)."""
    removed = plan.removed or (0,) * len(plan.keeps)
    return [min(keep.length, max(tokens, after_removed) if gone else tokens)
            for keep, gone in zip(plan.keeps, removed)]


def seam_offsets(plan: SpanPlan, tokens: int, after_removed: int = 0) -> list[int]:
    """The first `seam_lengths` offsets of every relocated span, increasing."""
    return [o for keep, length in zip(plan.keeps, seam_lengths(plan, tokens, after_removed))
            for o in range(keep.dst_pos, keep.dst_pos + length)]
