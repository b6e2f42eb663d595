"""SessionStore: indexed matching (namespaces, explicit ids, thresholds, ambiguity) and LRU eviction."""

import random
import time

import pytest

from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.session import SessionError, SessionStore, token_bag, token_overlap


def doc(seed, count, low=0, high=30_000):
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(count)]


def store_with(cfg=ReuseConfig(), **sessions):
    store = SessionStore(cfg)
    made = {}
    for name, (namespace, token_ids) in sessions.items():
        made[name] = store.create(namespace, name)
        store.update(made[name], token_ids, private_tokens=len(token_ids))
    return store, made


def test_match_within_namespace_only():
    ids = doc(1, 3000)
    new = ids[:2000] + doc(2, 100) + ids[2100:]
    store, made = store_with(a=("tenant-a", ids), b=(None, ids))
    assert store.match(new, "tenant-a").session is made["a"]
    assert store.match(new, None).session is made["b"]
    missing = store.match(new, "tenant-c")
    assert missing.session is None and missing.reason == "no_candidates"
    found = store.match(new, "tenant-a")
    assert found.reason == "matched" and found.lcp == 2000 and found.overlap > 0.9 and found.candidates == 1


def test_explicit_session_id():
    store = SessionStore(ReuseConfig())
    assert store.match([1, 2, 3], "ns", "chat-1").reason == "unknown_session_id"
    session = store.create("ns", "chat-1")
    store.update(session, [9, 9, 9], private_tokens=3)
    found = store.match([1, 2, 3], "ns", "chat-1")  # no common prefix needed
    assert found.session is session and found.reason == "explicit" and found.lcp == 0
    assert store.match([1, 2, 3], "other", "chat-1").session is None
    other = store.create("other", "chat-1")  # the same id in another namespace is another session
    assert other is not session and len(store) == 2
    with pytest.raises(SessionError):
        store.create("ns", "chat-1")


def test_thresholds():
    shared, x_tokens, y_tokens = doc(3, 2000), doc(4, 6000, 30_000, 40_000), doc(5, 6000, 40_000, 50_000)
    store, made = store_with(weak=("ns", shared[:1024] + x_tokens[:4000]), low=("ns2", shared + x_tokens[:1000]))
    assert store.match(shared[:1000], "ns").reason == "short_prompt"
    assert store.match(doc(6, 3000), "ns").reason == "no_candidates"
    weak = store.match(shared[:1024] + y_tokens[:4000], "ns")  # lcp/len 0.2, overlap 0.2
    assert weak.session is None and weak.reason == "weak"
    low = store.match(shared + y_tokens, "ns2")  # lcp/len 0.67 passes, overlap 0.36 < 0.55
    assert low.session is None and low.reason == "low_ratio" and low.lcp == 2000
    assert round(low.overlap, 3) == round(2 * 2000 / (3000 + 8000), 3)
    lenient = SessionStore(ReuseConfig(match_min_ratio=0.3))
    session = lenient.create("ns2")
    lenient.update(session, shared + x_tokens[:1000], 3000)
    assert lenient.match(shared + y_tokens, "ns2").session is session


def test_longest_prefix_wins_and_ambiguity_rejects():
    prompt = doc(7, 6000)
    first = prompt[:3000] + doc(8, 1000, 30_000, 40_000)  # lcp 3000, overlap 0.6
    second = prompt[:1500] + doc(9, 10, 30_000, 40_000) + prompt[1500:]  # lcp 1500, overlap ~1.0
    store, made = store_with(first=("ns", first), second=("ns", second))
    result = store.match(prompt, "ns")
    assert result.session is None and result.reason == "ambiguous" and result.candidates == 2
    relaxed, made = store_with(ReuseConfig(match_ambig_margin=0.5), first=("ns", first), second=("ns", second))
    result = relaxed.match(prompt, "ns")
    assert result.session is made["first"] and result.lcp == 3000


def test_update_reindexes():
    store, made = store_with(a=("ns", doc(10, 2000)))
    fresh = doc(11, 2000)
    store.update(made["a"], fresh, 2000)
    assert store.match(doc(10, 2000), "ns").session is None
    assert store.match(fresh + [1, 2], "ns").session is made["a"]


def test_lru_eviction_by_count_keeps_recently_used():
    store = SessionStore(ReuseConfig(max_sessions=3))
    sessions = [store.create("ns") for _ in range(5)]
    store.begin(sessions[0])
    store.end(sessions[0])  # touched: now the most recent
    evicted = store.evict_over_limits()
    assert evicted == [sessions[1], sessions[2]]
    assert store.sessions() == [sessions[3], sessions[4], sessions[0]]


def test_lru_eviction_by_memory():
    store = SessionStore(ReuseConfig(session_max_tokens=100))
    empty, big_old, big_new = store.create("ns"), store.create("ns"), store.create("ns")
    store.update(big_old, [1] * 10, private_tokens=60)
    store.update(big_new, [2] * 10, private_tokens=60)
    assert store.sessions() == [empty, big_old, big_new]  # least recently used first
    assert store.evict_over_limits() == [big_old]  # empty holds no memory: kept
    assert store.private_tokens() == 60 and len(store) == 2


def test_in_flight_sessions_are_never_evicted():
    store = SessionStore(ReuseConfig(max_sessions=1, session_max_tokens=0))
    first, second = store.create("ns"), store.create("ns")
    store.update(first, [1], private_tokens=5)
    store.update(second, [2], private_tokens=5)
    store.begin(first)
    store.begin(second)
    assert store.evict_over_limits() == [] and len(store) == 2
    with pytest.raises(SessionError):
        store.remove(first)
    store.end(first)
    assert store.evict_over_limits() == [first]
    with pytest.raises(SessionError):
        store.end(first)  # unbalanced


def test_index_keeps_matching_cheap_with_1000_sessions():
    cfg = ReuseConfig(max_sessions=1000, match_min_tokens=256, match_window=1024)
    store = SessionStore(cfg)
    rng = random.Random(12)
    docs = [[rng.randrange(30_000) for _ in range(400)] for _ in range(1000)]
    for number, token_ids in enumerate(docs):
        store.update(store.create("ns"), token_ids, 400)
    target = docs[537]
    start = time.perf_counter()
    result = store.match(target[:300] + [1, 2, 3] + target[300:], "ns")
    elapsed = time.perf_counter() - start
    assert result.session is store.sessions()[-1] and result.session.token_ids == target
    assert result.candidates == 1 and elapsed < 0.05


def test_token_overlap_is_quick_ratio():
    old, new = [1, 1, 2, 3], [1, 2, 2, 4]
    assert token_overlap(token_bag(old), token_bag(new)) == pytest.approx(2 * 2 / 8)
    assert token_overlap(token_bag([]), token_bag([])) == 0.0
    assert token_overlap(token_bag([5, 5, 5]), token_bag([5, 6])) == pytest.approx(2 * 1 / 5)
