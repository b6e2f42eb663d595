"""Tracked conversations (sessions) and the matching of a new request to one of them.

A session holds the previous sequence of a conversation that has K/V (prompt + completion minus
the final sampled token) and an opaque payload (the engine's resources for those K/V). A request
finds its session either by an explicit session id, or automatically as in the SCR overlay
(reference notes §2): same namespace (cache_salt), a common prefix of at least match_min_tokens
within match_window, enough prefix fraction or token overlap, the winner's overlap at least
match_min_ratio, and no other candidate beating it by more than match_ambig_margin.

Unlike the overlay's scan of every session's tokens, candidates come from an index keyed by
(namespace, hash of the first match_min_tokens tokens): only sessions whose first
match_min_tokens tokens equal the request's are compared, since any other has a shorter common
prefix and could not match. Eviction is LRU by count and by private tokens, and never touches a
session with a request in flight.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, NamedTuple, Sequence

import numpy as np

from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import common_prefix_len


class SessionError(RuntimeError):
    """Misuse of the session store: unbalanced end(), removing a busy session, duplicate id."""


@dataclass(eq=False)
class Session:
    """One tracked conversation. `token_ids`: the previous sequence with K/V; `payload`: the
    engine's resources for them (opaque here); `inflight`: requests running on it; `last_used`:
    the store's monotonic clock at the last touch; `private_tokens`: tokens it holds outside the
    shared cache, counted against session_max_tokens."""

    session_id: str
    namespace: Hashable
    token_ids: list[int] = field(default_factory=list)
    payload: object = None
    inflight: int = 0
    last_used: int = 0
    private_tokens: int = 0
    token_bag: TokenBag = field(default_factory=lambda: token_bag([]), repr=False)  # multiset of token_ids


@dataclass(frozen=True)
class SessionMatch:
    """SessionStore.match's answer: the session or None, why, the common prefix length and token
    overlap of the chosen (or best rejected) session, and how many sessions were compared."""

    session: Session | None
    reason: str
    lcp: int = 0
    overlap: float = 0.0
    candidates: int = 0


class TokenBag(NamedTuple):
    """A multiset of token ids: sorted distinct tokens and their counts (numpy int64 arrays)."""

    tokens: np.ndarray
    counts: np.ndarray


def token_bag(token_ids: Sequence[int]) -> TokenBag:
    """The multiset of token_ids."""
    tokens, counts = np.unique(np.asarray(token_ids, dtype=np.int64), return_counts=True)
    return TokenBag(tokens, counts)


def token_overlap(old_bag: TokenBag, new_bag: TokenBag) -> float:
    """difflib's quick_ratio: 2 * |old ∩ new as multisets| / (|old| + |new|); 0.0 if both empty."""
    total = int(old_bag.counts.sum() + new_bag.counts.sum())
    if total == 0:
        return 0.0
    _, old_at, new_at = np.intersect1d(old_bag.tokens, new_bag.tokens, assume_unique=True, return_indices=True)
    shared = int(np.minimum(old_bag.counts[old_at], new_bag.counts[new_at]).sum())
    return 2.0 * shared / total


class SessionStore:
    """All sessions of one engine, indexed by namespace and leading tokens, kept in LRU order."""

    def __init__(self, cfg: ReuseConfig) -> None:
        """An empty store governed by cfg's match_* thresholds, max_sessions and session_max_tokens."""
        self.cfg = cfg
        self._sessions: OrderedDict[tuple[Hashable, str], Session] = OrderedDict()  # oldest first
        self._index: dict[tuple[Hashable, Hashable], dict[str, Session]] = {}
        self._index_key: dict[int, tuple[Hashable, Hashable]] = {}  # id(session) -> its index key
        self._clock = itertools.count(1)
        self._next_number = itertools.count(1)

    def __len__(self) -> int:
        """Number of tracked sessions."""
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        """All sessions, least recently used first."""
        return list(self._sessions.values())

    def private_tokens(self) -> int:
        """Sum of all sessions' private_tokens."""
        return sum(session.private_tokens for session in self._sessions.values())

    def create(self, namespace: Hashable, session_id: str | None = None) -> Session:
        """A new empty session (most recently used); its id is `session_id` or a fresh "s000001"-style
        one. Raises SessionError if the id already exists in this namespace. Call
        evict_over_limits() afterwards."""
        if session_id is None:
            session_id = self._fresh_id(namespace)
        if (namespace, session_id) in self._sessions:
            raise SessionError(f"session {session_id!r} already exists")
        session = Session(session_id, namespace, last_used=next(self._clock))
        self._sessions[(namespace, session_id)] = session
        return session

    def _fresh_id(self, namespace: Hashable) -> str:
        """An id not used in `namespace`."""
        while True:
            session_id = f"s{next(self._next_number):06d}"
            if (namespace, session_id) not in self._sessions:
                return session_id

    def update(self, session: Session, token_ids: Sequence[int], private_tokens: int) -> None:
        """Record the session's new sequence with K/V and its private token count; re-index it and
        mark it used. Raises SessionError for a session not in the store, ValueError for a negative
        private_tokens."""
        self._require(session)
        if private_tokens < 0:
            raise ValueError(f"private_tokens must be >= 0, got {private_tokens}")
        self._unindex(session)
        session.token_ids = list(token_ids)
        session.token_bag = token_bag(session.token_ids)
        session.private_tokens = private_tokens
        self._reindex(session)
        self._touch(session)

    def begin(self, session: Session) -> None:
        """A request starts on the session: inflight += 1 (protects it from eviction); marks it used."""
        self._require(session)
        session.inflight += 1
        self._touch(session)

    def end(self, session: Session) -> None:
        """A request on the session finished or was aborted: inflight -= 1. Raises SessionError if
        no request is in flight."""
        if session.inflight <= 0:
            raise SessionError(f"end() without begin() on session {session.session_id!r}")
        session.inflight -= 1

    def remove(self, session: Session) -> None:
        """Forget the session (the caller frees its payload). Raises SessionError if a request is in
        flight on it or it is not in the store."""
        self._require(session)
        if session.inflight > 0:
            raise SessionError(f"session {session.session_id!r} has {session.inflight} request(s) in flight")
        self._unindex(session)
        del self._sessions[(session.namespace, session.session_id)]

    def evict_over_limits(self) -> list[Session]:
        """Remove least recently used idle sessions until at most max_sessions remain and their
        private tokens total at most session_max_tokens (when over the memory limit only, sessions
        holding no private tokens are kept). Sessions with a request in flight are never evicted, so
        the limits can stay exceeded. Returns the removed sessions; the caller frees their payloads."""
        evicted = []
        count, held = len(self._sessions), self.private_tokens()
        for session in list(self._sessions.values()):
            over_count = count > self.cfg.max_sessions
            over_memory = held > self.cfg.session_max_tokens
            if not over_count and not over_memory:
                break
            if session.inflight > 0 or not (over_count or session.private_tokens > 0):
                continue
            self.remove(session)
            evicted.append(session)
            count, held = count - 1, held - session.private_tokens
        return evicted

    def match(self, new_ids: Sequence[int], namespace: Hashable, session_id: str | None = None) -> SessionMatch:
        """The session a request with prompt new_ids continues, or None with the reason.

        With session_id: that session of the same namespace ("explicit"), else None
        ("unknown_session_id"; the caller may create it). Without: automatic matching through the
        index; reasons "matched", "short_prompt", "no_candidates", "weak", "low_ratio", "ambiguous".
        A matched session is marked used. Sessions of another namespace are never returned."""
        if session_id is not None:
            session = self._sessions.get((namespace, session_id))
            if session is None:
                return SessionMatch(None, "unknown_session_id")
            self._touch(session)
            lcp = common_prefix_len(session.token_ids, new_ids)
            return SessionMatch(session, "explicit", lcp, token_overlap(session.token_bag, token_bag(new_ids)), 1)
        window, min_tokens = self.cfg.match_window, self.cfg.match_min_tokens
        if len(new_ids) < min_tokens:
            return SessionMatch(None, "short_prompt")
        bucket = self._index.get((namespace, _lead_key(new_ids, min_tokens)))
        if not bucket:
            return SessionMatch(None, "no_candidates")
        new_bag = token_bag(new_ids)
        passing = []
        for session in bucket.values():
            lcp = common_prefix_len(session.token_ids, new_ids, window)
            if lcp < min_tokens:  # a hash collision
                continue
            overlap = token_overlap(session.token_bag, new_bag)
            prefix_frac = lcp / len(session.token_ids)
            if prefix_frac >= self.cfg.match_min_prefix_frac or overlap >= self.cfg.match_min_overlap:
                passing.append((lcp, overlap, session.last_used, session))
        return self._decide(passing, len(bucket))

    def _decide(self, passing: list[tuple[int, float, int, Session]], compared: int) -> SessionMatch:
        """Pick the winner among the candidates that passed the weak test: longest common prefix,
        then larger overlap, then most recent; reject it below match_min_ratio or when another
        candidate's overlap exceeds it by more than match_ambig_margin."""
        if not passing:
            return SessionMatch(None, "weak", candidates=compared)
        passing.sort(key=lambda item: item[:3], reverse=True)
        lcp, overlap, _, winner = passing[0]
        if overlap < self.cfg.match_min_ratio:
            return SessionMatch(None, "low_ratio", lcp, overlap, compared)
        rival = max((item[1] for item in passing[1:]), default=0.0)
        if rival > overlap + self.cfg.match_ambig_margin:
            return SessionMatch(None, "ambiguous", lcp, overlap, compared)
        self._touch(winner)
        return SessionMatch(winner, "matched", lcp, overlap, compared)

    def _touch(self, session: Session) -> None:
        """Mark the session most recently used."""
        session.last_used = next(self._clock)
        self._sessions.move_to_end((session.namespace, session.session_id))

    def _require(self, session: Session) -> None:
        """Raise SessionError unless this very session object is in the store."""
        if self._sessions.get((session.namespace, session.session_id)) is not session:
            raise SessionError(f"session {session.session_id!r} is not in this store")

    def _reindex(self, session: Session) -> None:
        """Index the session under its namespace and leading tokens, if it has enough of them."""
        min_tokens = self.cfg.match_min_tokens
        if len(session.token_ids) < min_tokens:
            return
        key = (session.namespace, _lead_key(session.token_ids, min_tokens))
        self._index.setdefault(key, {})[session.session_id] = session
        self._index_key[id(session)] = key

    def _unindex(self, session: Session) -> None:
        """Remove the session from the index, if present."""
        key = self._index_key.pop(id(session), None)
        if key is None:
            return
        bucket = self._index[key]
        bucket.pop(session.session_id, None)
        if not bucket:
            del self._index[key]


def _lead_key(token_ids: Sequence[int], count: int) -> Hashable:
    """Index key of a sequence's first `count` tokens (the tuple's hash; collisions are harmless
    because candidates are verified by their common prefix)."""
    return hash(tuple(token_ids[:count]))
