"""Selective recompute: after relocation, compute again the relocated tokens whose K/V are furthest
from what a full recompute would give.

A relocated token's K/V were computed while the old context was visible; in the new prompt its
context lost or gained text. Measured on the default model (docs/BENCHMARKS.md), the deviation
sits right after each seam: the first 16 tokens of a span deviate 10-100x more in the deep layers
than tokens a few hundred positions in, and layer 1 barely shows it (so CacheBlend's layer-1 check,
Yao et al., EuroSys 2025, ranks them poorly). Tokens are recomputed in every layer, in the
request's main forward, next to B', the span tails and D:

    new prompt       [ A ][ B' ][ C1 relocated ............ ][tail][ C2 relocated ...... ][tail][ D ]
    seam_tokens             ^^^^                                    ^^^^                        (first N of each span)
    message openings                    ^^                                   ^^     (role, \\n, first M content
                                                                                    tokens of every message in a
                                                                                    span: reuse.message_starts)
    recompute share              policy: "heads" (more of each span's head, shared out evenly),
                                 "deviation" (the top scores of a scoring pass), "overlap"
                                 (tokens that also occur in the removed text the span saw) or
                                 "random" (a uniform draw: the control the others must beat)
    main forward           B'   ^^^^ ...                      tail  ^^^^ ...             tail  D

The "deviation" policy's scoring pass (CacheBlend's selection):

    scoring pass           B'   C1 ......................          C2 ...............          (rows)
      layers 0..d-1 in full over the rows (their K/V written: exact there), layer d's K and V
      projected and compared with the relocated ones (`kv_deviation`); the top share is chosen

Layer 0's K/V of a token depend on the token and its position only, so they are exact once
re-rotated; rows of B' (and of earlier tails) are in the scoring pass because the relocated rows
after them attend to them. The pass is a phase of the request (`Req.scoring`): the scheduler gives
it scoring chunks (rows run through `score_layers` layers only, `Decoder.layer_kv`), the engine
hands their K/V to `ScoringPass.record` (via the ReuseManager), and when every row is scored the
plan is amended (`SpanPlan.with_recomputed`) before the main forward. Seams, "heads", "overlap"
and "random" need no scoring pass: they are chosen at admission ("overlap" from token ids alone).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvsplice.reuse.plan import Keep, SpanPlan


def recompute_count(plan: SpanPlan, share: float) -> int:
    """How many relocated tokens a `share` of the plan's relocated tokens is (rounded half up)."""
    return min(plan.relocated_tokens, math.floor(share * plan.relocated_tokens + 0.5))


def relocated_offsets(plan: SpanPlan) -> list[int]:
    """Every relocated (not yet recomputed) new offset of `plan`, increasing."""
    recomputed = set(plan.recomputed)
    return [o for keep in plan.keeps for o in range(keep.dst_pos, keep.dst_end) if o not in recomputed]


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


# ----- the scoring pass ---------------------------------------------------------------------
@dataclass
class ScoringPass:
    """A request's scoring phase: `rows` (offsets, increasing) still to run through the first
    `depth` of `num_layers` layers; `candidates` the relocated offsets among all rows to score;
    `count` of them to recompute; `scores` {offset: deviation} recorded so far; `all_rows` every
    row of the pass (for its FLOPs)."""

    depth: int
    num_layers: int
    rows: list[int]
    candidates: frozenset[int]
    count: int
    all_rows: tuple[int, ...] = ()
    scores: dict[int, float] = field(default_factory=dict)

    def next_rows(self, budget: int) -> list[int]:
        """The next chunk's rows: as many as cost about `budget` full-depth tokens, at least one."""
        return self.rows[: max(1, budget * self.num_layers // self.depth)]

    def cost(self, rows: int) -> int:
        """Full-depth token equivalents of `rows` scoring rows (rounded up), for the step budget."""
        return -(-rows * self.depth // self.num_layers)

    def record(self, offsets: Sequence[int], deviations: torch.Tensor) -> None:
        """`offsets` (the next rows, in order) ran; `deviations [len(offsets)]` holds each one's
        deviation (read only for candidates). Raises ValueError if they are not the next rows."""
        if list(offsets) != self.rows[: len(offsets)]:
            raise ValueError("scoring rows recorded out of order")
        del self.rows[: len(offsets)]
        values = deviations.tolist()
        for offset, value in zip(offsets, values):
            if offset in self.candidates:
                self.scores[offset] = value

    @property
    def done(self) -> bool:
        return not self.rows

    def selection(self) -> list[int]:
        """The `count` candidates with the highest deviation (ties: the earlier offset), increasing."""
        top = heapq.nlargest(self.count, self.scores.items(), key=lambda item: (item[1], -item[0]))
        return sorted(offset for offset, _ in top)


def scoring_pass(plan: SpanPlan, pending: Sequence[int], count: int, depth: int, num_layers: int,
                 candidates: Sequence[int]) -> ScoringPass:
    """The scoring pass for `candidates` (relocated offsets of `plan`): its rows are the candidates
    and every offset of `pending` (the plan's computed offsets) before the last candidate."""
    last = max(candidates)
    rows = sorted(set(candidates) | {o for o in pending if o < last})
    return ScoringPass(depth, num_layers, rows, frozenset(candidates), count, tuple(rows))


def kv_deviation(new_k: torch.Tensor, new_v: torch.Tensor, old_k: torch.Tensor,
                 old_v: torch.Tensor) -> torch.Tensor:
    """Per row, `[n]`: the squared distance of the new K and V `[n, heads, dim]` from the old ones,
    each relative to the old row's squared norm (K and V live on different scales; a row's score
    does not depend on the other rows of its chunk), in fp32. Keys must be rotated to the same
    positions on both sides."""
    def relative(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        new, old = new.float().flatten(1), old.float().flatten(1)
        return (new - old).pow(2).sum(1) / old.pow(2).sum(1).clamp_min(1e-12)
    return relative(new_k, old_k) + relative(new_v, old_v)


# ----- seams and policies -------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """How a policy picks: `candidates(plan)` to score in a scoring pass ("deviation"), or
    `choose(plan, count, old_ids, new_ids)` at admission ("heads", "overlap": at most `count`
    relocated offsets, from the plan and the token ids of the session's sequence and the prompt).
    Exactly one is set."""

    candidates: Callable[[SpanPlan], list[int]] | None = None
    choose: Callable[[SpanPlan, int, Sequence[int], Sequence[int]], list[int]] | None = None


def _heads(plan: SpanPlan, count: int, old_ids: Sequence[int] = (), new_ids: Sequence[int] = ()) -> list[int]:
    """The first tokens of every relocated span, `count` shared out evenly (earlier spans first);
    the token ids are not read."""
    recomputed = set(plan.recomputed)
    spans = [[o for o in range(k.dst_pos, k.dst_end) if o not in recomputed] for k in plan.keeps]
    chosen: list[int] = []
    depth = 0
    while len(chosen) < count and any(depth < len(span) for span in spans):
        for span in spans:
            if depth < len(span) and len(chosen) < count:
                chosen.append(span[depth])
        depth += 1
    return sorted(chosen)


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


def fixed_recompute(plan: SpanPlan, prompt_ids: Sequence[int], cfg, message_starts=None) -> list[int]:
    """The offsets every plan recomputes before any policy, increasing, each once: the seams'
    first tokens (`seam_offsets` with `cfg.seam_tokens` and `cfg.removed_seam_tokens`) and the
    message openings of `prompt_ids` (role, line break and the first `cfg.message_start_tokens`
    content tokens; `message_starts` a kvsplice.reuse.message_starts.MessageStarts, None: none)
    in the spans from the first edit on (none in a turn that only appends)."""
    offsets = set(seam_offsets(plan, cfg.seam_tokens, cfg.removed_seam_tokens))
    if cfg.message_start_tokens and message_starts is not None:
        openings = message_starts.openings(prompt_ids, cfg.message_start_tokens, range(len(prompt_ids)))
        offsets.update(in_edited_keeps(plan, openings))
    return sorted(offsets)


def overlap_scores(plan: SpanPlan, old_ids: Sequence[int]) -> dict[int, float]:
    """{relocated offset: score > 0} for the relocated (not yet recomputed) tokens of `plan` whose
    token also occurs in removed text (`plan.removed_spans`) their K/V saw (before the span in the
    old sequence). The score is the share of the token's occurrences in the old context the spans
    saw (up to the last keep's end) that lie in that removed text, or, when higher, the same share
    for the bigram (previous old token, token).

    Why: a head that attends by content (a copy or induction head) spreads a query token's
    attention over the earlier keys of the same token (or of the token after one), so what a
    relocated token took from removed text grows with the share of its matches that were there:
    a rare token whose one other occurrence was deleted carries it, a common one barely. Token
    ids only: no forward pass, nothing to count as scored."""
    if not plan.keeps or not plan.removed_spans:
        return {}
    seen = old_ids[: max(keep.src_end for keep in plan.keeps)]
    unigrams = Counter(seen)
    bigrams = Counter(zip(seen, seen[1:]))
    gone_unigrams: Counter = Counter()
    gone_bigrams: Counter = Counter()
    recomputed = set(plan.recomputed)
    spans = iter(plan.removed_spans)   # increasing in old, as the keeps are
    upcoming = next(spans, None)
    scores: dict[int, float] = {}
    for keep in plan.keeps:
        while upcoming is not None and upcoming[1] <= keep.src_pos:
            start, end = upcoming
            gone_unigrams.update(old_ids[start:end])
            gone_bigrams.update(zip(old_ids[max(0, start - 1):end - 1], old_ids[max(1, start):end]))
            upcoming = next(spans, None)
        if not gone_unigrams:
            continue
        for offset in range(keep.dst_pos, keep.dst_end):
            if offset in recomputed:
                continue
            src = offset - keep.delta
            token = old_ids[src]
            score = gone_unigrams[token] / unigrams[token]
            if src > 0:
                pair = (old_ids[src - 1], token)
                score = max(score, gone_bigrams[pair] / bigrams[pair])
            if score > 0:
                scores[offset] = score
    return scores


def _overlap(plan: SpanPlan, count: int, old_ids: Sequence[int], new_ids: Sequence[int] = ()) -> list[int]:
    """At most `count` relocated offsets, increasing: those with the highest `overlap_scores`
    (ties: the earlier offset). Fewer when fewer tokens match removed text; none without it (an
    edit that only inserts text). `new_ids` are not read (a relocated token is the same in both)."""
    top = heapq.nlargest(count, overlap_scores(plan, old_ids).items(), key=lambda item: (item[1], -item[0]))
    return sorted(offset for offset, _ in top)


def _random(plan: SpanPlan, count: int, old_ids: Sequence[int] = (), new_ids: Sequence[int] = ()) -> list[int]:
    """A control, not a selection: `count` relocated offsets drawn uniformly at random, increasing
    (seeded by the offsets themselves, so a plan always gets the same draw); the token ids are not
    read. What a policy must beat at the same budget to have chosen anything."""
    offsets = relocated_offsets(plan)
    return sorted(random.Random(hash(tuple(offsets))).sample(offsets, min(count, len(offsets))))


POLICIES: dict[str, Policy] = {
    "heads": Policy(choose=_heads),
    "deviation": Policy(candidates=relocated_offsets),
    "overlap": Policy(choose=_overlap),
    "random": Policy(choose=_random),
}
