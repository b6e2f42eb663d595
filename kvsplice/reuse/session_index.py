"""The session index: which tracked sessions hold a given piece of content.

Per namespace, an inverted index from chunk hash (kvsplice.reuse.fingerprint) to the sessions
whose sequence holds that chunk (its posting list):

    namespace ─> { hash(c) ─> [session, session, ...] }        one entry per distinct chunk
    session   ─> (namespace, its distinct chunk hashes)         to unindex it in O(its chunks)

A lookup walks the new prompt's chunks once: O(prompt chunks x postings read), independent of
how many sessions there are or how long they are. A chunk held by more than `max_postings`
sessions is common content (a system prompt, a tool list, a document many conversations read):
it is skipped, so it neither makes every session a candidate nor makes the lookup slower, and it
never counts as evidence that a prompt continues one particular session (the weight of a chunk
is all or nothing, the extreme form of inverse document frequency).

Memory: one dict entry and one small list per distinct chunk of each session, plus 8 bytes per
chunk for the session's own hash array, a few KB per 1,000 tokens of a session with the default
16-token chunks (benchmarks/match_cost.py measures it: docs/BENCHMARKS.md, "Session matching at
scale: 1,000 sessions, 8K and 128K prompts"), against 8 bytes per token of the session's token list
itself.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple

import numpy as np

from kvsplice.reuse.fingerprint import Fingerprints


class Lookup(NamedTuple):
    """SessionIndex.lookup's answer: holder -> indices of the prompt chunks it holds (non-common
    only), and the indices of the prompt's common chunks."""

    holders: dict[Hashable, list[int]]
    common: list[int]


class SessionIndex:
    """Chunk hash -> sessions, per namespace. Holders are any hashable objects (the store passes
    Session objects, hashed by identity)."""

    def __init__(self) -> None:
        self._postings: dict[Hashable, dict[int, list[Hashable]]] = {}
        self._held: dict[Hashable, tuple[Hashable, np.ndarray]] = {}  # holder -> (namespace, hashes)

    def __len__(self) -> int:
        """Number of indexed holders."""
        return len(self._held)

    def add(self, holder: Hashable, namespace: Hashable, fingerprints: Fingerprints) -> None:
        """Index `holder` under `namespace` by the distinct chunk hashes of `fingerprints`.
        Raises ValueError if it is already indexed (remove it first)."""
        if holder in self._held:
            raise ValueError("holder is already indexed; remove it first")
        hashes = np.unique(fingerprints.hashes)
        self._held[holder] = (namespace, hashes)
        postings = self._postings.setdefault(namespace, {})
        for chunk_hash in hashes.tolist():
            postings.setdefault(chunk_hash, []).append(holder)

    def remove(self, holder: Hashable) -> None:
        """Forget `holder` (no-op if it is not indexed)."""
        entry = self._held.pop(holder, None)
        if entry is None:
            return
        namespace, hashes = entry
        postings = self._postings[namespace]
        for chunk_hash in hashes.tolist():
            holders = postings[chunk_hash]
            holders.remove(holder)
            if not holders:
                del postings[chunk_hash]
        if not postings:
            del self._postings[namespace]

    def lookup(self, namespace: Hashable, fingerprints: Fingerprints, max_postings: int) -> Lookup:
        """Walk the prompt's chunks once: for every holder of `namespace` holding at least one
        non-common chunk, the indices of those chunks (in prompt order); and the indices of the
        common chunks (held by more than max_postings holders), which nominate nobody."""
        postings = self._postings.get(namespace)
        found: dict[Hashable, list[int]] = {}
        common: list[int] = []
        if not postings:
            return Lookup(found, common)
        for chunk, chunk_hash in enumerate(fingerprints.hashes.tolist()):
            holders = postings.get(chunk_hash)
            if holders is None:
                continue
            if len(holders) > max_postings:
                common.append(chunk)
                continue
            for holder in holders:
                found.setdefault(holder, []).append(chunk)
        return Lookup(found, common)

    def chunks_held(self, holder: Hashable) -> int:
        """Distinct chunks indexed for `holder` (0 if it is not indexed)."""
        entry = self._held.get(holder)
        return 0 if entry is None else len(entry[1])
