"""Content fingerprints: the vectorised hash equals a plain per-chunk reference, chunks away from an
edit keep their hashes wherever the edit is, and the cut points are the diff's."""

import random

import numpy as np

from kvsplice.reuse.diff import chunk_bounds
from kvsplice.reuse.fingerprint import fingerprint

MASK64 = (1 << 64) - 1


def reference_hash(chunk):
    """The documented hash, one token at a time in Python integers: sum of splitmix(t * golden + i)."""
    total = 0
    for offset, token in enumerate(chunk):
        value = (token * 0x9E3779B97F4A7C15 + offset) & MASK64
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
        total = (total + (value ^ (value >> 31))) & MASK64
    return total


def tokens(seed, count):
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(count)]


def test_hashes_match_the_reference_and_cuts_are_the_diffs():
    ids = tokens(1, 3000)
    prints = fingerprint(ids, 64)
    bounds = chunk_bounds(ids, 64)
    assert prints.starts.tolist() == bounds[:-1] and prints.ends.tolist() == bounds[1:]
    assert prints.hashes.tolist() == [reference_hash(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert len(set(prints.hashes.tolist())) == len(prints)  # random content: no collisions


def test_order_inside_a_chunk_matters():
    chunk = tokens(2, 40)
    swapped = chunk[1:2] + chunk[:1] + chunk[2:]
    assert reference_hash(chunk) != reference_hash(swapped)


def test_chunks_away_from_an_edit_keep_their_hashes():
    ids = tokens(3, 4000)
    before = set(fingerprint(ids, 64).hashes.tolist())
    for edited in ([7] + ids[1:], ids[:300] + tokens(4, 50) + ids[500:], ids[:2000] + ids[2600:]):
        after = fingerprint(edited, 64)
        kept = sum(int(e - s) for h, s, e in zip(after.hashes.tolist(), after.starts, after.ends) if h in before)
        assert kept >= len(edited) - 700  # only the chunks next to the edit change


def test_empty_and_tiny_inputs():
    assert len(fingerprint([], 64)) == 0
    one = fingerprint([5], 64)
    assert len(one) == 1 and one.starts.tolist() == [0] and one.ends.tolist() == [1]
    assert fingerprint(np.asarray([5, 6, 7]), 64).hashes.tolist() == fingerprint([5, 6, 7], 64).hashes.tolist()
