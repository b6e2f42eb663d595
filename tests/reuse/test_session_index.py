"""SessionIndex: posting lists per namespace, common chunks skipped, exact unindexing."""

import random

import pytest

from kvsplice.reuse.fingerprint import fingerprint
from kvsplice.reuse.session_index import SessionIndex


def tokens(seed, count):
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(count)]


SHARED = tokens(0, 1000)


def test_hits_name_the_holders_of_each_chunk_within_the_namespace():
    index = SessionIndex()
    own, other = tokens(1, 1000), tokens(2, 1000)
    index.add("a", "ns", fingerprint(SHARED + own, 64))
    index.add("b", "ns", fingerprint(SHARED + other, 64))
    index.add("c", "elsewhere", fingerprint(SHARED + own, 64))
    prompt = fingerprint(SHARED + own, 64)
    found, common = index.lookup("ns", prompt, max_postings=8)
    assert set(found) == {"a", "b"} and common == []  # never "c": another namespace
    assert len(found["a"]) == len(prompt) and len(found["b"]) < len(found["a"])
    # with at most one holder per chunk, the shared chunks (two holders) are common: only a's own remain
    alone, common = index.lookup("ns", prompt, max_postings=1)
    assert set(alone) == {"a"} and sorted(alone["a"] + common) == list(range(len(prompt)))
    assert common and all(chunk not in alone["a"] for chunk in common)


def test_remove_unindexes_exactly():
    index = SessionIndex()
    prints = fingerprint(SHARED, 64)
    index.add("a", "ns", prints)
    index.add("b", "ns", prints)
    with pytest.raises(ValueError):
        index.add("a", "ns", prints)
    index.remove("a")
    index.remove("a")  # no-op
    assert set(index.lookup("ns", prints, 8).holders) == {"b"} and len(index) == 1
    index.remove("b")
    assert index.lookup("ns", prints, 8) == ({}, []) and len(index) == 0
    assert index._postings == {}  # nothing left behind


def test_chunks_held_counts_distinct_chunks():
    index = SessionIndex()
    block = tokens(3, 500)
    index.add("a", "ns", fingerprint(block + block, 64))
    assert 0 < index.chunks_held("a") <= len(fingerprint(block + block, 64))
    assert index.chunks_held("missing") == 0
