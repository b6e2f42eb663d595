"""Content fingerprints of a token sequence: its content-defined chunks, hashed.

    tokens      [ t0 t1 ... | ........ | ...... | ........... ]
    chunks        c0          c1         c2       c3            cut where the content says so
    fingerprint   h(c0)       h(c1)      h(c2)    h(c3)         64-bit, order inside a chunk matters

The cut points are those of the diff's fast path (`kvsplice.reuse.diff.chunk_bounds`: a cut
depends only on the last few tokens before it), so an edit anywhere changes the chunks it touches
and at most the next one; every other chunk, before or after the edit, keeps its hash. That is
what lets the session index find a conversation from any surviving part of it, with no common
prefix required.

A chunk's hash is the wrapping uint64 sum over its tokens of mix(token, offset inside the chunk),
where mix is SplitMix64's finaliser (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number
generators"; the constants of java.util.SplittableRandom). It is vectorised over the whole
sequence; collisions cost nothing but a wasted verification, since a match is always verified by
the token diff.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from kvsplice.reuse.diff import chunk_bounds

_GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: spreads consecutive inputs
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


class Fingerprints(NamedTuple):
    """The chunks of one sequence: `hashes` (uint64), `starts` and `ends` (int64 offsets, the
    chunks tile the sequence in order)."""

    hashes: np.ndarray
    starts: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.hashes)


def fingerprint(token_ids: Sequence[int] | np.ndarray, target: int) -> Fingerprints:
    """The content-defined chunks of token_ids (mean size `target`, a power of 2; sizes bounded to
    [target/4, 4*target] as in the diff) and their hashes. Empty input gives no chunks."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    if len(tokens) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Fingerprints(np.zeros(0, dtype=np.uint64), empty, empty)
    bounds = np.asarray(chunk_bounds(tokens, target), dtype=np.int64)
    starts, ends = bounds[:-1], bounds[1:]
    return Fingerprints(chunk_hashes(tokens, starts, ends), starts, ends)


def chunk_hashes(tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Hash of each chunk tokens[starts[i]:ends[i]] (chunks tiling `tokens` in order): the
    wrapping sum of mix(token * golden + offset in chunk) over the chunk."""
    offsets_in_chunk = np.arange(len(tokens), dtype=np.int64) - np.repeat(starts, ends - starts)
    mixed = _mix(tokens.astype(np.uint64) * _GOLDEN64 + offsets_in_chunk.astype(np.uint64))
    return np.add.reduceat(mixed, starts)


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise (uint64 arithmetic wraps)."""
    values = (values ^ (values >> np.uint64(30))) * _MIX1
    values = (values ^ (values >> np.uint64(27))) * _MIX2
    return values ^ (values >> np.uint64(31))
