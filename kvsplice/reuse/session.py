"""Tracked conversations (sessions) and the matching of a new request to one of them.

A session holds the previous sequence of a conversation that has K/V (prompt + completion minus
the final sampled token) and an opaque payload (the engine's resources for those K/V). It belongs
to one namespace (the request's (owner, cache_salt)); nothing outside that namespace ever sees it.

A request finds its session in one of two ways, both verified the same way
(kvsplice.reuse.session_match: distinctive evidence, then the token diff's overlap and coverage):

    explicit   session_id (or X-SMG-Routing-Key) names a session of the request's namespace: only
               that one is verified, no search. An id that does not verify is treated as no id.
    automatic  the prompt's content fingerprints are looked up in the session index
               (kvsplice.reuse.session_index); the sessions holding the most distinctive content
               are verified, and the ambiguity rule picks one or none.

A request that matches nothing gets a new session (the caller creates it, under a fresh id of 128
random bits). So a request never takes over a session it did not verify against, whatever id it
sends. An explicit id follows the conversation that last used it verifiably: the caller hands it
(claim_id) to the session the request attached to or created, and the session that held it
before keeps its sequence and K/V under a minted id, still found by content. A client that
reuses an old conversation's id for a new conversation thus gets a session of its own, named by
that id from its first turn on, and the old conversation loses nothing; a client that sends
another conversation's id gets nothing from it, and that conversation's next turn finds its
session again by content and takes its id back.

Eviction is LRU by count and by private tokens, and never touches a session with a request in
flight.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.diff import EqualRun, common_prefix_len, diff_tokens
from kvsplice.reuse.fingerprint import Fingerprints, fingerprint
from kvsplice.reuse.session_index import SessionIndex
from kvsplice.reuse.session_match import DiffFn, Verified, choose, chunk_runs, chunk_tokens, implausible_reason, verify

# bytes of randomness in a minted session id: 16 bytes = 128 bits (secrets.token_urlsafe)
MINTED_ID_BYTES = 16


class SessionError(RuntimeError):
    """Misuse of the session store: unbalanced end(), removing a busy session, duplicate id."""


@dataclass(eq=False)
class Session:
    """One tracked conversation. `token_ids`: the previous sequence with K/V; `payload`: the
    engine's resources for them (opaque here); `inflight`: requests running on it; `last_used`:
    the store's monotonic clock at the last touch; `private_tokens`: tokens it holds outside the
    shared cache, counted against session_max_tokens; `named`: its id was chosen by a client;
    `prompt_len`: how much of token_ids was the previous prompt (the rest its completion).
    Compared and hashed by identity."""

    session_id: str
    namespace: Hashable
    token_ids: list[int]
    payload: object = None
    inflight: int = 0
    last_used: int = 0
    private_tokens: int = 0
    named: bool = False  # its id was chosen by a client (else minted by the store)
    prompt_len: int = 0  # token_ids[:prompt_len] was the previous request's prompt


@dataclass(frozen=True)
class SessionMatch:
    """SessionStore.match's answer: the session or None, and why ("explicit", "matched", or the
    miss: "no_candidate", "low_overlap", "ambiguous", "session_mismatch", "owner_mismatch",
    "new_session"); for the chosen session (or the best rejected one) its evidence, common prefix
    length, overlap and coverage; how many sessions the index nominated and how many were
    verified by a diff; the chosen session's diff runs (for the plan, so it is not diffed twice);
    and whether the prompt continues the chosen session's whole sequence."""

    session: Session | None
    reason: str
    evidence: int = 0
    lcp: int = 0
    overlap: float = 0.0
    coverage: float = 0.0
    candidates: int = 0
    verified: int = 0
    runs: tuple[EqualRun, ...] | None = None
    continues: bool = False


class SessionStore:
    """All sessions of one engine, indexed by namespace and content, kept in LRU order."""

    def __init__(self, cfg: ReuseConfig) -> None:
        """An empty store governed by cfg's match_* settings, max_sessions and session_max_tokens."""
        self.cfg = cfg
        self._sessions: OrderedDict[tuple[Hashable, str], Session] = OrderedDict()  # oldest first
        self._index = SessionIndex()
        self._id_holders: Counter[str] = Counter()  # session id -> how many namespaces use it
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        """Number of tracked sessions."""
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        """All sessions, least recently used first."""
        return list(self._sessions.values())

    def private_tokens(self) -> int:
        """Sum of all sessions' private_tokens."""
        return sum(session.private_tokens for session in self._sessions.values())

    def get(self, namespace: Hashable, session_id: str) -> Session | None:
        """The session with this id in this namespace, or None (other namespaces are never looked at)."""
        return self._sessions.get((namespace, session_id))

    def index_chunks(self, session: Session) -> int:
        """Distinct content chunks the index holds for the session (its index memory, in entries)."""
        return self._index.chunks_held(session)

    # ----- lifecycle ----------------------------------------------------------------------
    def create(self, namespace: Hashable, session_id: str | None = None) -> Session:
        """A new empty session (most recently used); its id is `session_id` or a freshly minted one
        (128 random bits). Raises SessionError if the id already exists in this namespace. Call
        evict_over_limits() afterwards."""
        named = session_id is not None
        if session_id is None:
            session_id = self._mint_id(namespace)
        if (namespace, session_id) in self._sessions:
            raise SessionError(f"session {session_id!r} already exists")
        session = Session(session_id, namespace, [], last_used=next(self._clock), named=named)
        self._sessions[(namespace, session_id)] = session
        self._id_holders[session_id] += 1
        return session

    def claim_id(self, session: Session, session_id: str) -> None:
        """Give `session` the client-chosen id `session_id` in its namespace (it becomes most
        recently used). A session holding that id until now keeps its sequence and K/V under a
        freshly minted id, so it can still be found by content. No-op if it already has the id."""
        self._require(session)
        if session.session_id == session_id:
            return
        holder = self.get(session.namespace, session_id)
        if holder is not None:
            self._rename(holder, self._mint_id(holder.namespace), named=False)
        self._rename(session, session_id, named=True)

    def _rename(self, session: Session, session_id: str, named: bool) -> None:
        del self._sessions[(session.namespace, session.session_id)]
        self._forget_id(session.session_id)
        session.session_id, session.named = session_id, named
        self._sessions[(session.namespace, session_id)] = session
        self._id_holders[session_id] += 1

    def _forget_id(self, session_id: str) -> None:
        self._id_holders[session_id] -= 1
        if not self._id_holders[session_id]:
            del self._id_holders[session_id]

    def _mint_id(self, namespace: Hashable) -> str:
        """An unguessable id not used in `namespace`."""
        while True:
            session_id = secrets.token_urlsafe(MINTED_ID_BYTES)
            if (namespace, session_id) not in self._sessions:
                return session_id

    def update(self, session: Session, token_ids: Sequence[int], private_tokens: int,
               prompt_len: int | None = None) -> None:
        """Record the session's new sequence with K/V (its first prompt_len tokens the prompt,
        default all of it) and its private token count; re-index it by content and mark it used.
        Raises SessionError for a session not in the store, ValueError for a negative
        private_tokens or a prompt_len outside [0, len(token_ids)]."""
        self._require(session)
        if private_tokens < 0:
            raise ValueError(f"private_tokens must be >= 0, got {private_tokens}")
        prompt_len = len(token_ids) if prompt_len is None else prompt_len
        if not 0 <= prompt_len <= len(token_ids):
            raise ValueError(f"prompt_len {prompt_len} outside [0, {len(token_ids)}]")
        self._index.remove(session)
        session.token_ids = list(token_ids)
        session.private_tokens, session.prompt_len = private_tokens, prompt_len
        if session.token_ids:
            self._index.add(session, session.namespace, fingerprint(session.token_ids, self.cfg.match_chunk_tokens))
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
        self._index.remove(session)
        del self._sessions[(session.namespace, session.session_id)]
        self._forget_id(session.session_id)

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

    # ----- matching -----------------------------------------------------------------------
    def match(self, new_ids: Sequence[int], namespace: Hashable, session_id: str | None = None,
              diff: DiffFn | None = None) -> SessionMatch:
        """The session a request with prompt new_ids continues, or None with the reason.

        With session_id naming a session of `namespace`: that session if it verifies
        ("explicit"). Otherwise automatic matching among the sessions no client named, and on a
        miss the reason for the id: "session_mismatch" (the named session did not verify),
        "session_has_no_kv" (its first request is still running: nothing to verify against yet),
        "owner_mismatch" (the id is held only in other namespaces), "new_session" (held nowhere).
        Without an id: automatic matching ("matched", or "no_candidate", "low_overlap",
        "ambiguous"). A matched session is marked used; a session that did not verify is not
        touched. `diff(old_ids, new_ids)` is the token diff used for verification (default:
        diff_tokens with the store's settings)."""
        diff = diff or self._default_diff
        prompt = fingerprint(new_ids, self.cfg.match_chunk_tokens)
        named_miss = None
        if session_id is not None:
            named = self.get(namespace, session_id)
            if named is not None:
                named_miss = self._verify_named(named, new_ids, prompt, diff)
                if named_miss.session is not None:
                    return named_miss
            else:
                reason = "owner_mismatch" if self._id_holders[session_id] else "new_session"
                named_miss = SessionMatch(None, reason)
        found = self._match_by_content(new_ids, namespace, prompt, diff, anonymous_only=session_id is not None)
        return named_miss if found.session is None and named_miss is not None else found

    def _verify_named(self, session: Session, new_ids: Sequence[int], prompt: Fingerprints,
                      diff: DiffFn) -> SessionMatch:
        """The explicit path: verify the one named session (no search, no ambiguity rule)."""
        if not session.token_ids:
            return SessionMatch(None, "session_has_no_kv", candidates=1)
        lookup = self._index.lookup(session.namespace, prompt, self.cfg.match_max_postings)
        checked = verify(session, session.token_ids, session.prompt_len, new_ids, chunk_runs(prompt, lookup.common),
                         0, session.last_used, diff, self.cfg)
        if implausible_reason(checked, self.cfg) is not None:
            return _answer(None, "session_mismatch", checked, 1, 1)
        self._touch(session)
        return _answer(session, "explicit", checked, 1, 1)

    def _match_by_content(self, new_ids: Sequence[int], namespace: Hashable, prompt: Fingerprints,
                          diff: DiffFn, anonymous_only: bool = False) -> SessionMatch:
        """The automatic path: nominate the sessions holding non-common prompt content (the index),
        verify by a diff up to match_max_candidates of them, choose one or none. With
        `anonymous_only` (the request names its conversation), sessions named by a client are left
        out: they belong to conversations that declared another id."""
        lookup = self._index.lookup(namespace, prompt, self.cfg.match_max_postings)
        held = {session: chunk_tokens(prompt, chunks) for session, chunks in lookup.holders.items()
                if not (anonymous_only and session.named)}
        first_hit = {session: int(prompt.starts[lookup.holders[session][0]]) for session in held}
        strongest = self._worth_a_diff(new_ids, held, first_hit)
        if not strongest:
            return SessionMatch(None, "no_candidate", candidates=len(held))
        common = chunk_runs(prompt, lookup.common)
        checked = [verify(session, session.token_ids, session.prompt_len, new_ids, common, first_hit[session],
                          session.last_used, diff, self.cfg) for session in strongest]
        winner, reason = choose(checked, len(new_ids), self.cfg)
        if winner is None:
            best = max(checked, key=lambda candidate: (candidate.overlap, candidate.evidence))
            return _answer(None, reason, best, len(held), len(checked))
        self._touch(winner.session)
        return _answer(winner.session, reason, winner, len(held), len(checked))

    def _worth_a_diff(self, new_ids: Sequence[int], held: dict[Session, int],
                      first_hit: dict[Session, int]) -> list[Session]:
        """The nominated sessions to verify: those holding at least match_min_tokens of the prompt's
        non-common content, or whose previous prompt the prompt continues (a cheap prefix compare),
        the earliest first (then the most held), at most match_max_candidates. A session holding a
        chunk or two (a system prompt's varying first sentence) is not worth a diff. When none
        qualifies, those holding the most are verified all the same: an edit inside repetitive text
        can shift every chunk cut, which the token diff does not mind."""
        worth = [session for session, tokens in held.items() if tokens >= self.cfg.match_min_tokens
                 or common_prefix_len(session.token_ids, new_ids) >= max(self.cfg.match_min_tokens, session.prompt_len)]
        if not worth:
            return heapq.nlargest(self.cfg.match_max_candidates, held,
                                  key=lambda session: (held[session], session.last_used))
        return heapq.nsmallest(self.cfg.match_max_candidates, worth,
                               key=lambda session: (first_hit[session], -held[session], -session.last_used))

    def _default_diff(self, old_ids: Sequence[int], new_ids: Sequence[int]) -> list[EqualRun]:
        return diff_tokens(old_ids, new_ids, fastdiff_min=self.cfg.fastdiff_min, cdc_target=self.cfg.cdc_target)

    def _touch(self, session: Session) -> None:
        """Mark the session most recently used."""
        session.last_used = next(self._clock)
        self._sessions.move_to_end((session.namespace, session.session_id))

    def _require(self, session: Session) -> None:
        """Raise SessionError unless this very session object is in the store."""
        if self._sessions.get((session.namespace, session.session_id)) is not session:
            raise SessionError(f"session {session.session_id!r} is not in this store")


def _answer(session: Session | None, reason: str, checked: Verified, candidates: int, verified: int) -> SessionMatch:
    """A SessionMatch carrying a verified candidate's measures (and its runs when it is the match)."""
    return SessionMatch(session, reason, checked.evidence, checked.lcp, checked.overlap, checked.coverage,
                        candidates, verified, checked.runs if session is not None else None, checked.continues)
