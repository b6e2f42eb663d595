"""Properties of the disk tier under random operations (hypothesis, derandomized, small).

- budget: the bytes on disk (entry files and temporaries, measured by the file system itself at
  every write) never exceed the budget, nor does the tier's own count, nor a namespace its share;
- tenancy: a lookup in one namespace only ever returns what was put in that namespace, with the
  very K/V put there, even when every namespace stores the same token ids.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsplice.cache.tier_format import ENTRY_SUFFIX
from kvsplice.cache.tier_fs import LocalFileSystem, TEMP_SUFFIX
from tests.cache.tier_helpers import entry_size, open_tier, prefix_entry, session_entry

SETTINGS = settings(max_examples=25, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
NAMESPACES = ["a", "b", "c"]
PUTS = st.lists(st.tuples(st.sampled_from(NAMESPACES), st.integers(1, 12), st.integers(0, 3)),
                min_size=1, max_size=25)


class MeasuringFileSystem(LocalFileSystem):
    """Sums the size of everything under the entries directory around every write."""

    def __init__(self, root: Path):
        self.root = root
        self.max_bytes = 0
        self._lock = threading.Lock()

    def _measure(self) -> None:
        total = sum(self._size(path) for path in self.root.glob("entries/*/*")
                    if path.name.endswith((ENTRY_SUFFIX, TEMP_SUFFIX)))
        with self._lock:
            self.max_bytes = max(self.max_bytes, total)

    @staticmethod
    def _size(path: Path) -> int:
        # a flush on another thread may unlink the file between the glob and the stat: it then
        # holds no bytes (raising here would count as the tier's write error)
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0

    def write_atomic(self, path, chunks) -> None:
        chunks = list(chunks)
        self._measure()
        super().write_atomic(path, chunks)
        self._measure()


@SETTINGS
@given(puts=PUTS, budget_entries=st.integers(1, 6), share=st.sampled_from([1.0, 0.5]))
def test_budget_never_exceeded(puts, budget_entries, share):
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        budget = budget_entries * entry_size(prefix_entry("a", list(range(8))))
        fs = MeasuringFileSystem(root)
        with open_tier(root, budget_bytes=budget, namespace_share=share, fs=fs, write_queue_size=4) as tier:
            for namespace, length, seed in puts:
                tier.put(prefix_entry(namespace, [seed] * length, seed=seed))
                stats = tier.stats()
                assert stats.bytes_used <= budget
                for name in NAMESPACES:
                    assert tier.namespace_bytes(name) <= int(budget * share)
            tier.wait_writes()
            stats = tier.stats()
            on_disk = sum(path.stat().st_size for path in root.glob("entries/*/*.kvt"))
            assert on_disk == stats.bytes_used <= budget
            assert stats.entries == len(list(root.glob("entries/*/*.kvt")))
        assert fs.max_bytes <= budget


@SETTINGS
@given(puts=PUTS, queries=st.lists(st.tuples(st.sampled_from(NAMESPACES), st.integers(1, 12),
                                              st.integers(0, 3)), max_size=15))
def test_namespace_isolation(puts, queries):
    with tempfile.TemporaryDirectory() as directory:
        with open_tier(Path(directory), budget_bytes=10**7, write_queue_size=64) as tier:
            stored = {}
            for namespace, length, seed in puts:
                # the seed of the K/V depends on the namespace: equal tokens, different K/V
                entry = prefix_entry(namespace, [seed] * length, seed=NAMESPACES.index(namespace) * 100 + seed)
                if entry.key not in stored and tier.put(entry):
                    stored[entry.key] = entry
                session = session_entry(namespace, f"s{seed}", [seed] * length, seed=length)
                if tier.put(session):
                    stored[session.key] = session
            tier.wait_writes()
            for namespace, length, seed in queries:
                tokens = [seed] * length
                match = tier.match_prefix(namespace, tokens)
                assert all(key.namespace == namespace for key in match.keys)
                for other in NAMESPACES:
                    for key, session_id in ((prefix_entry(other, tokens).key, None),
                                            (session_entry(other, f"s{seed}", tokens).key, f"s{seed}")):
                        loaded = tier.get(key, session_id=session_id)
                        assert (loaded is not None) == (key in stored)
                        if loaded is not None:
                            assert loaded.key.namespace == other
                            assert torch.equal(loaded.kv, stored[key].kv)


STORED_RUNS = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(st.integers(0, 1), min_size=1, max_size=8),
                                 st.integers(0, 7)), max_size=12)


@SETTINGS
@given(runs=STORED_RUNS, query=st.lists(st.integers(0, 1), min_size=1, max_size=10), start_pos=st.integers(0, 9),
       namespace=st.sampled_from(["a", "b"]))
def test_match_prefix_covers_as_far_as_a_brute_force_search(runs, query, start_pos, namespace):
    """Against a model: from start_pos, repeatedly take any stored entry of the namespace that
    starts at or before the covered end, ends after it and whose tokens equal the query's."""
    start_pos = min(start_pos, len(query))
    with tempfile.TemporaryDirectory() as directory:
        with open_tier(Path(directory), budget_bytes=10**7, write_queue_size=64) as tier:
            stored = []
            for run_namespace, tokens, start in runs:
                start = min(start, len(tokens) - 1)
                if tier.put(prefix_entry(run_namespace, tokens, start_pos=start)):
                    stored.append((run_namespace, tokens, start))
            tier.wait_writes()
            match = tier.match_prefix(namespace, query, start_pos=start_pos)
            covered = start_pos
            while True:
                ends = [len(tokens) for ns, tokens, start in stored if ns == namespace and start <= covered
                        < len(tokens) and query[:len(tokens)] == tokens]
                if not ends:
                    break
                covered = max(ends)
            assert match.length == covered
            previous_end = start_pos
            for key, start, end in zip(match.keys, match.starts, match.ends):
                assert key.namespace == namespace and start <= previous_end < end
                entry = tier.get(key, token_ids=query)
                assert entry is not None and (entry.start_pos, entry.end_pos) == (start, end)
                previous_end = end


def test_threads_putting_loading_and_flushing_never_see_wrong_kv(tmp_path):
    """Several threads put, prefetch, get and flush at once under a tight budget: every hit is
    exactly what was put under its key, and the budget holds throughout."""
    budget = 6 * entry_size(prefix_entry("a", list(range(8))))
    fs = MeasuringFileSystem(tmp_path)
    expected = {}
    failures = []
    with open_tier(tmp_path, budget_bytes=budget, fs=fs, write_queue_size=4) as tier:
        def worker(worker_id: int) -> None:
            try:
                for step in range(60):
                    namespace = NAMESPACES[(worker_id + step) % 3]
                    tokens = [worker_id, step % 7] + [1] * (step % 6)
                    entry = prefix_entry(namespace, tokens, seed=100 * worker_id + step % 42)   # one K/V per key
                    expected[entry.key] = entry.kv
                    tier.put(entry)
                    tier.prefetch(entry.key)
                    loaded = tier.get(entry.key, token_ids=tokens)
                    if loaded is not None and not torch.equal(loaded.kv, expected[entry.key]):
                        failures.append(entry.key)
                    if step % 25 == 24:
                        tier.flush(namespace)
                    assert tier.stats().bytes_used <= budget
            except Exception as error:          # surfaced below: a thread's assert is otherwise lost
                failures.append(error)
        threads = [threading.Thread(target=worker, args=(worker_id,)) for worker_id in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        tier.wait_writes()
        stats = tier.stats()
        assert stats.corrupt_dropped == 0 and stats.write_errors == 0
        assert sum(path.stat().st_size for path in tmp_path.glob("entries/*/*.kvt")) == stats.bytes_used
    assert not failures and fs.max_bytes <= budget
