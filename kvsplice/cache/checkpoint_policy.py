"""Where a hybrid model saves its linear layers' state during prefill, and which saved states go first.

A Gated DeltaNet layer's state after a prefix is exact only for that very prefix, so a prefix hit can
resume only where a state was saved (a checkpoint). When a later prompt diverges at offset d, the hit is
cut back to the deepest checkpoint c <= d and the tokens [c, d) are prefilled again even though their
K/V is cached: the gap d - c is what checkpoints are placed to keep small.

Policy text (env KVREUSE_SSM_CHECKPOINT_POLICY): terms joined by "+".

    messages   the state before every message the request marks (`message_offsets`: where each chat
               message starts, from the chat template) and at the end of its prompt (where the reply
               starts). Agents edit whole messages (delete a tool result, rewrite the notes, strip the
               reasoning of a reply), so an edit inside message k resumes from message k's start.
    every:N    the state at every multiple of N prompt tokens (a bound for long messages and for
               requests without message offsets).

e.g. "messages+every:256" (the default), "messages", "every:256". Whatever the policy, a request's final
state (after its prompt and completion) is kept too: the next turn of a conversation appends to it.

Memory cap: the radix tree keeps at most `max_states` checkpoints (state slots; the bytes of one slot are
`kvsplice.cache.state_pool.state_slot_bytes`, about 147 MiB for a Qwen3.5-27B-sized model). Over the cap,
and when the StatePool runs out of slots, the least useful checkpoint is dropped (its state slot freed, the
node's K/V kept), by this rule (`eviction_key`):

  1. least recently used first: the checkpoints of conversations not touched for longest, and those of
     abandoned branches (the old version of a message that was since edited), go before any on the path
     a request matched more recently (a match touches every node of its path);
  2. among equally recent ones (one path), the one whose loss costs the least re-prefill: with p and n
     the depths of the nearest checkpoints above and below it, a prompt that diverges uniformly in
     (c, n] would recompute c - p more tokens, so the cost is (c - p) * (n - c). This thins a path
     evenly (two boundaries close together lose one first) instead of cutting it from one end, and a
     path's deepest checkpoint (the end of the last request: n is unbounded, appends land after it) goes
     last.

The cap counts the SCR sessions' own states too (the approximate states of a session's previous
sequence after its first relocated token, which only its next turn can load): they compete under the same
rule, a session's states being as recent as its radix path.

A checkpoint that a running request is about to load (an SCR splice) is pinned: its slot has a second
reference and it is never dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

DEFAULT_POLICY = "messages+every:256"
MAX_MESSAGE_OFFSETS = 4096   # message boundaries one request may mark
MAX_EVERY = 1 << 22          # longest spacing: beyond any model's context


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where requests save linear-layer states (`messages`, `every`) and how many the tree keeps.

    `every`: spacing in prompt tokens, None for no fixed spacing. `max_states`: the most state
    checkpoints the radix tree holds (>= 0). Build from text with `parse`.
    """

    messages: bool = True
    every: Optional[int] = 256
    max_states: int = 64

    def __post_init__(self) -> None:
        if self.every is not None and (isinstance(self.every, bool) or not isinstance(self.every, int)
                                       or not 1 <= self.every <= MAX_EVERY):
            raise ValueError(f"every must be an integer in [1, {MAX_EVERY}] or None, got {self.every!r}")
        if isinstance(self.max_states, bool) or not isinstance(self.max_states, int) or self.max_states < 0:
            raise ValueError(f"max_states must be an integer >= 0, got {self.max_states!r}")

    @classmethod
    def parse(cls, text: str, max_states: int = 64) -> "CheckpointPolicy":
        """The policy of `text` ("messages", "every:N" or both joined by "+"); ValueError naming the
        bad term for anything else (an empty text, an unknown or repeated term, N < 1)."""
        terms = [term.strip() for term in str(text).strip().lower().split("+")]
        messages, every = False, None
        for term in terms:
            if term == "messages" and not messages:
                messages = True
            elif term.startswith("every:") and every is None:
                every = _parse_every(term)
            else:
                raise ValueError(f"checkpoint policy {text!r}: bad or repeated term {term!r} "
                                 f"(expected 'messages', 'every:N' or both joined by '+')")
        return cls(messages, every, max_states)

    def describe(self) -> str:
        """The policy as text (what `parse` reads back)."""
        terms = (["messages"] if self.messages else []) + ([f"every:{self.every}"] if self.every else [])
        return "+".join(terms)

    def lengths(self, prompt_len: int, message_offsets: Sequence[int] = ()) -> list[int]:
        """Increasing prefix lengths 0 < p <= prompt_len whose state the policy saves: multiples of
        `every` inside the prompt, and with `messages` every message offset plus the prompt's end
        (only when the request marks messages)."""
        wanted = set(range(self.every, prompt_len, self.every)) if self.every else set()
        if self.messages and message_offsets:
            wanted.update(o for o in message_offsets if 0 < o < prompt_len)
            wanted.add(prompt_len)
        return sorted(wanted)


def _parse_every(term: str) -> int:
    raw = term.removeprefix("every:")
    try:
        every = int(raw, 10)
    except ValueError:
        raise ValueError(f"checkpoint policy term {term!r}: N must be an integer, got {raw!r}") from None
    if not 1 <= every <= MAX_EVERY:
        raise ValueError(f"checkpoint policy term {term!r}: N must lie in [1, {MAX_EVERY}]")
    return every


def check_message_offsets(offsets: Sequence[int] | None, prompt_len: int) -> tuple[int, ...]:
    """`offsets` as a tuple after checking them: integers, strictly increasing, each within the prompt
    (0 <= o < prompt_len), at most MAX_MESSAGE_OFFSETS. ValueError (starting "message_offsets:") else."""
    if offsets is None:
        return ()
    offsets = list(offsets)
    if len(offsets) > MAX_MESSAGE_OFFSETS:
        raise ValueError(f"message_offsets: at most {MAX_MESSAGE_OFFSETS} offsets, got {len(offsets)}")
    if any(isinstance(o, bool) or not isinstance(o, int) for o in offsets):
        raise ValueError("message_offsets: must be a list of integers")
    outside = [o for o in offsets if not 0 <= o < prompt_len]
    if outside:
        raise ValueError(f"message_offsets: {outside[0]} is outside the prompt [0, {prompt_len})")
    for prev, offset in zip(offsets, offsets[1:]):
        if offset <= prev:
            raise ValueError(f"message_offsets: must be strictly increasing, got {prev} then {offset}")
    return tuple(offsets)


# ----- which checkpoint goes first --------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointCandidate:
    """One droppable checkpoint as the eviction rule sees it: its depth (tokens before the state), the
    depths of the nearest checkpoints above (`prev_depth`, 0 for the zero state at the root) and below
    it (`next_depth`, None when it is the deepest of its path), its node's last access time, and
    `handle` (what the caller drops: a radix node)."""

    depth: int
    prev_depth: int
    next_depth: Optional[int]
    last_access: float
    handle: object

    @property
    def removal_cost(self) -> float:
        """Expected extra re-prefill without it, up to a constant: (c - p) * (n - c); infinite for a
        path's deepest checkpoint."""
        if self.next_depth is None:
            return math.inf
        return float(self.depth - self.prev_depth) * float(self.next_depth - self.depth)


def eviction_key(candidate: CheckpointCandidate) -> tuple:
    """Sort key, smallest first to drop (see the module docstring): least recently used, then the
    cheapest loss, then the smallest gap above (orders the deepest checkpoints among themselves)."""
    return (candidate.last_access, candidate.removal_cost, candidate.depth - candidate.prev_depth,
            candidate.depth)


def least_useful(candidates: Sequence[CheckpointCandidate]) -> Optional[CheckpointCandidate]:
    """The candidate to drop first, or None when there is none."""
    return min(candidates, key=eviction_key, default=None)


def sequence_candidates(lengths: Sequence[int], below: Sequence[int], last_access: float,
                        owner: object) -> list[CheckpointCandidate]:
    """Candidates for states saved along one sequence (an SCR session's own states) at `lengths`,
    above exact checkpoints of the same sequence at depths `below` (its radix path); each handle is
    (owner, length). The deepest length is the sequence's end: it has no next."""
    ordered = sorted(lengths)
    floors = sorted(below)
    out = []
    for i, length in enumerate(ordered):
        lower = [d for d in floors if d < length] + ordered[:i]
        out.append(CheckpointCandidate(length, max(lower, default=0),
                                       ordered[i + 1] if i + 1 < len(ordered) else None,
                                       last_access, (owner, length)))
    return out
