"""Whether a prompt continues a session: verification by the token diff, and the ambiguity rule.

A candidate session is judged on what the token diff of its sequence against the prompt keeps,
counting only solid runs (at least match_min_tokens / 4 tokens: shorter equal runs are what any two
texts share by chance):

    old_ids   [ lcp: common prefix ][ rest of the session ....................... ]
    new_ids   [ lcp: common prefix ][ edits, surviving parts of the rest ][ appended ]
                                                                  span end ^
    continues  the common prefix holds the session's whole previous prompt (and at least
               match_min_tokens): a pure append, whatever became of the previous completion
    evidence   kept prompt tokens after the common prefix, outside common content (prompt chunks
               held by more than match_max_postings sessions: a system prompt, a tool list, a
               document many conversations have)
    overlap    kept / span end: the share of the prompt the diff keeps from the session, not
               counting the text appended after everything it keeps (a continuation's new turn)
    coverage   kept / len(old_ids): the share of the session's sequence the prompt keeps

The common prefix is no evidence by itself: a new conversation that opens with the same system
prompt and tool list as a tracked one shares exactly that prefix and nothing after it. So a
session is plausible when it continues or evidence >= match_min_tokens (else "no_candidate"), and
overlap >= match_min_ratio and coverage >= match_min_coverage (else "low_overlap": the prompt is
mostly something else, or keeps little of the session). No common prefix is required: after an
edit at token 0 the whole rest is evidence.

The winner among plausible sessions: only those the prompt continues compete if there are any
(the prompt literally extends them); of the rest, only those whose first non-common content
chunk in the prompt starts within match_min_tokens of the earliest one (a conversation's own
history opens its prompt, while a document it shares with another conversation was typically
appended later); among those, the one the diff keeps most of, then more evidence, then the more
recent. Another of those makes the match "ambiguous" (the prompt takes neither) when it keeps
almost as much: fewer than match_min_tokens tokens less, and no more than match_ambig_margin of
the prompt less. An older copy of the same conversation, or a sibling branch sharing its history,
keeps less as soon as the prompt holds match_min_tokens of the winner's newer content: it does
not block; two sessions that share only the same content with the prompt do.

The one case content cannot settle: with a single other conversation in the namespace, content it
shares with the prompt is not yet known to be common. A prompt that shares with it only a system
prompt edited in its first tokens, or a document after a different question, looks exactly like
an edit of that conversation, and may match it when that shared part is most of both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import EqualRun, common_prefix_len
from kvsplice.reuse.fingerprint import Fingerprints

DiffFn = Callable[[Sequence[int], Sequence[int]], list[EqualRun]]


@dataclass(frozen=True)
class Verified:
    """One candidate after verification: the diff's runs (all of them, for the plan), what its
    solid runs keep (`kept`, `evidence`, `overlap`, `coverage`), whether the prompt continues the
    session's whole sequence, where in the prompt the first non-common content chunk the session
    holds starts (`first_hit`, from the index), and the session's recency (the store's clock at
    its last use)."""

    session: object
    runs: tuple[EqualRun, ...]
    solid: tuple[EqualRun, ...]
    lcp: int
    continues: bool
    kept: int
    evidence: int
    overlap: float
    coverage: float
    first_hit: int
    recency: int


def chunk_tokens(fingerprints: Fingerprints, chunks: Sequence[int], after: int = 0) -> int:
    """Prompt tokens at offsets >= `after` in the given chunks (indices into `fingerprints`)."""
    if not chunks:
        return 0
    picked = np.asarray(chunks, dtype=np.int64)
    ends = fingerprints.ends[picked]
    return int(np.maximum(0, ends - np.maximum(fingerprints.starts[picked], after)).sum())


def chunk_runs(fingerprints: Fingerprints, chunks: Sequence[int]) -> list[EqualRun]:
    """The given prompt chunks (increasing indices) as runs over the prompt's offsets."""
    return [EqualRun(start, start, end - start)
            for start, end in zip(fingerprints.starts[chunks].tolist(), fingerprints.ends[chunks].tolist())]


def verify(session: object, old_ids: Sequence[int], old_prompt_len: int, new_ids: Sequence[int],
           common: Sequence[EqualRun], first_hit: int, recency: int, diff: DiffFn, cfg: ReuseConfig) -> Verified:
    """Diff the session's sequence (whose first old_prompt_len tokens were its prompt) against the
    prompt and measure what it keeps; `common`: the prompt's common content as runs over its
    offsets (see chunk_runs)."""
    runs = tuple(diff(old_ids, new_ids))
    solid = tuple(run for run in runs if run.length >= cfg.match_min_run)
    lcp = common_prefix_len(old_ids, new_ids)
    kept = sum(run.length for run in solid)
    prefix = [EqualRun(0, 0, lcp)] if lcp else []
    evidence = exclusive_tokens(solid, _union(prefix, list(common)))
    continues = lcp >= max(cfg.match_min_tokens, old_prompt_len)
    span_end = solid[-1].new_end if solid else 0
    return Verified(session, runs, solid, lcp, continues, kept, evidence, kept / span_end if span_end else 0.0,
                    kept / len(old_ids) if old_ids else 0.0, first_hit, recency)


def implausible_reason(candidate: Verified, cfg: ReuseConfig) -> str | None:
    """Why the candidate cannot be matched ("no_candidate", "low_overlap"), or None if it can."""
    if not candidate.continues and candidate.evidence < cfg.match_min_tokens:
        return "no_candidate"
    if candidate.overlap < cfg.match_min_ratio or candidate.coverage < cfg.match_min_coverage:
        return "low_overlap"
    return None


def choose(candidates: Sequence[Verified], prompt_len: int, cfg: ReuseConfig) -> tuple[Verified | None, str]:
    """The winner among verified candidates and "matched", or None and the reason: "no_candidate"
    (none has enough evidence), "low_overlap" (none keeps enough), "ambiguous"."""
    reasons = [implausible_reason(candidate, cfg) for candidate in candidates]
    plausible = [candidate for candidate, reason in zip(candidates, reasons) if reason is None]
    if not plausible:
        return None, "low_overlap" if "low_overlap" in reasons else "no_candidate"
    if any(candidate.continues for candidate in plausible):
        plausible = [candidate for candidate in plausible if candidate.continues]
    earliest = min(candidate.first_hit for candidate in plausible)
    front = [candidate for candidate in plausible if candidate.first_hit < earliest + cfg.match_min_tokens]
    winner = max(front, key=lambda c: (c.kept, c.evidence, c.recency))
    for rival in front:
        if rival is not winner and _equally_plausible(winner, rival, prompt_len, cfg):
            return None, "ambiguous"
    return winner, "matched"


def _equally_plausible(winner: Verified, rival: Verified, prompt_len: int, cfg: ReuseConfig) -> bool:
    """True when the rival keeps almost as much as the winner (see the module docstring)."""
    lead = winner.kept - rival.kept
    return lead < cfg.match_min_tokens and lead <= cfg.match_ambig_margin * prompt_len


def exclusive_tokens(runs: Sequence[EqualRun], others: Sequence[EqualRun]) -> int:
    """Prompt tokens kept by `runs` and not by `others` (both increasing and disjoint in the new
    prompt's offsets): their total length minus the length of their intersection."""
    shared, other = 0, 0
    for run in runs:
        while other < len(others) and others[other].new_end <= run.new_offset:
            other += 1
        probe = other
        while probe < len(others) and others[probe].new_offset < run.new_end:
            shared += min(run.new_end, others[probe].new_end) - max(run.new_offset, others[probe].new_offset)
            probe += 1
    return sum(run.length for run in runs) - shared


def _union(first: list[EqualRun], second: list[EqualRun]) -> list[EqualRun]:
    """The union of two increasing disjoint run lists (new offsets), as an increasing disjoint list."""
    merged: list[EqualRun] = []
    for run in sorted(first + second, key=lambda r: r.new_offset):
        if merged and run.new_offset <= merged[-1].new_end:
            end = max(merged[-1].new_end, run.new_end)
            merged[-1] = EqualRun(merged[-1].new_offset, merged[-1].new_offset, end - merged[-1].new_offset)
        else:
            merged.append(run)
    return merged
