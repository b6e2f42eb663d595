"""DiskTier: round trips, restarts, crash leftovers, corruption, identity, LRU, failure paths."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch

from kvsplice.cache.disk_tier import DiskTierConfig, DiskTierError, kv_from_pool, kv_into_pool
from kvsplice.cache.tier_format import EntryKey, TierEntry, TierIdentity, namespace_dir, namespace_name
from tests.cache.tier_helpers import (HEAD_DIM, KV_HEADS, LAYERS, BlockingFileSystem, FailingFileSystem,
                                      entry_size, identity, open_tier, prefix_entry, session_entry)

TOKENS = list(range(100, 116))


def entry_files(directory) -> list:
    return sorted(directory.glob("entries/*/*.kvt"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    """K/V and checkpoint tensors come back bit for bit, in their dtype."""
    states = {"conv": torch.randn(3, 5).to(dtype), "rec": torch.randn(2, 2, 2)}
    entry = prefix_entry("ns", TOKENS, start_pos=4, dtype=dtype, states=states)
    with open_tier(tmp_path, ident=identity(str(dtype).removeprefix("torch."))) as tier:
        assert tier.put(entry)
        tier.wait_writes()
        loaded = tier.get(entry.key, token_ids=TOKENS)
    assert loaded is not None and loaded.kv.dtype == dtype
    assert torch.equal(loaded.kv.view(torch.uint8), entry.kv.view(torch.uint8))
    assert torch.equal(loaded.token_ids, entry.token_ids) and loaded.start_pos == 4 and loaded.exact
    assert loaded.states.keys() == states.keys()
    for name, tensor in states.items():
        assert loaded.states[name].dtype == tensor.dtype and torch.equal(loaded.states[name], tensor)


def test_a_stored_entry_without_states_is_replaced_by_one_with_them(tmp_path):
    """An exact entry stored without a checkpoint (written before its state existed) is written
    again when the same run comes with one; one with a checkpoint is never replaced by one without."""
    states = {"conv": torch.randn(3, 5), "rec": torch.randn(2, 2, 2)}
    with open_tier(tmp_path) as tier:
        assert tier.put(prefix_entry("ns", TOKENS, start_pos=4))
        tier.wait_writes()
        key = EntryKey.for_prefix("ns", TOKENS)
        assert tier.contains(key) and not tier.has_states(key)
        assert tier.put(prefix_entry("ns", TOKENS, start_pos=8, states=states))
        tier.wait_writes()
        assert tier.has_states(key) and tier.stats().writes == 2 and tier.stats().entries == 1
        assert tier.put(prefix_entry("ns", TOKENS, start_pos=8))          # nothing to write
        tier.wait_writes()
        assert tier.has_states(key) and tier.stats().writes == 2
        loaded = tier.get(key, token_ids=TOKENS)
    assert loaded.start_pos == 8 and torch.equal(loaded.states["rec"], states["rec"])
    assert len(entry_files(tmp_path)) == 1


def test_prefetch_then_get(tmp_path):
    entry = prefix_entry("ns", TOKENS)
    with open_tier(tmp_path) as tier:
        tier.put(entry)
        tier.wait_writes()
        assert tier.prefetch(entry.key)
        assert not tier.prefetch(entry.key)             # already being read
        assert torch.equal(tier.get(entry.key).kv, entry.kv)
        assert not tier.prefetch(EntryKey.for_prefix("ns", [1, 2]))
        stats = tier.stats()
    assert (stats.hits, stats.loads, stats.writes) == (1, 1, 1) and stats.load_seconds > 0


def test_index_rebuilt_after_reopen(tmp_path):
    entries = [prefix_entry("a", TOKENS[:n], seed=n) for n in (4, 8, 12)] + [session_entry("b", "s1", TOKENS)]
    with open_tier(tmp_path) as tier:
        for entry in entries:
            tier.put(entry)
        tier.wait_writes()
        used = tier.stats().bytes_used
    with open_tier(tmp_path) as tier:
        stats = tier.stats()
        assert (stats.entries, stats.bytes_used, stats.corrupt_dropped) == (4, used, 0)
        assert tier.namespace_bytes("a") + tier.namespace_bytes("b") == used
        for entry in entries:
            loaded = tier.get(entry.key, session_id=entry.session_id)
            assert loaded is not None and torch.equal(loaded.kv, entry.kv)
        match = tier.match_prefix("a", TOKENS, start_pos=0)
    assert match.length == 12 and len(match.keys) == 1      # the longest entry that starts at 0


def test_kill_mid_write_leaves_a_temp_that_is_ignored_and_removed(tmp_path):
    entry = prefix_entry("ns", TOKENS)
    with open_tier(tmp_path) as tier:
        tier.put(entry)
        tier.wait_writes()
    final = entry_files(tmp_path)[0]
    # what a SIGKILL between open and rename leaves: half a file under the temporary name
    temp = final.with_name(f".{final.name}.dead.tmp")
    temp.write_bytes(final.read_bytes()[:100])
    with open_tier(tmp_path) as tier:
        stats = tier.stats()
        assert (stats.entries, stats.temp_files_removed, stats.corrupt_dropped) == (1, 1, 0)
        assert not temp.exists()
        assert tier.get(entry.key) is not None


def test_header_mismatch_ignores_old_entries(tmp_path, caplog):
    with open_tier(tmp_path) as tier:
        tier.put(prefix_entry("ns", TOKENS))
        tier.wait_writes()
    with caplog.at_level(logging.WARNING, logger="kvsplice.cache.disk_tier"):
        tier = open_tier(tmp_path, ident=identity(model="other"))
    with tier:
        stats = tier.stats()
        assert (stats.ignored_at_start, stats.entries, stats.bytes_used) == (1, 0, 0)
        assert tier.get(prefix_entry("ns", TOKENS).key) is None
    assert "1 entries of another model identity" in caplog.text
    assert entry_files(tmp_path) == []
    with open_tier(tmp_path, ident=identity(model="other")) as tier:   # the new header sticks
        assert tier.stats().ignored_at_start == 0


def test_entry_of_another_identity_in_place_is_dropped_at_rebuild(tmp_path):
    """Even with a matching header, an entry stamped with another identity is never indexed."""
    with open_tier(tmp_path, ident=identity(model="other")) as tier:
        tier.put(prefix_entry("ns", TOKENS))
        tier.wait_writes()
    stray = entry_files(tmp_path)[0].read_bytes()
    with open_tier(tmp_path) as tier:
        pass
    path = tmp_path / "entries" / namespace_dir("ns") / (EntryKey.for_prefix("ns", TOKENS).content + ".kvt")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(stray)
    with open_tier(tmp_path) as tier:
        assert (tier.stats().entries, tier.stats().corrupt_dropped) == (0, 1)


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "empty"])
def test_damaged_file_is_a_counted_miss_and_dropped(tmp_path, damage):
    entry = prefix_entry("ns", TOKENS)
    with open_tier(tmp_path) as tier:
        tier.put(entry)
        tier.wait_writes()
        path = entry_files(tmp_path)[0]
        data = bytearray(path.read_bytes())
        if damage == "flip_payload":
            data[-100] ^= 0x01
        elif damage == "flip_header":
            data[40] ^= 0x20
        elif damage == "truncate":
            data = data[:len(data) // 2]
        else:
            data = bytearray()
        path.write_bytes(bytes(data))
        assert tier.get(entry.key) is None
        stats = tier.stats()
        assert (stats.misses, stats.corrupt_dropped, stats.entries, stats.bytes_used) == (1, 1, 0, 0)
        assert not path.exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_file_is_dropped_at_rebuild(tmp_path, damage):
    with open_tier(tmp_path) as tier:
        tier.put(prefix_entry("ns", TOKENS))
        tier.put(prefix_entry("ns", TOKENS[:5]))
        tier.wait_writes()
    path = entry_files(tmp_path)[0]
    path.write_bytes(path.read_bytes()[:-1] if damage == "truncate" else b"not an entry at all")
    with open_tier(tmp_path) as tier:
        assert (tier.stats().entries, tier.stats().corrupt_dropped) == (1, 1)
        assert not path.exists()


def test_token_ids_are_verified_on_load(tmp_path):
    entry = prefix_entry("ns", TOKENS)
    with open_tier(tmp_path) as tier:
        tier.put(entry)
        tier.wait_writes()
        assert tier.get(entry.key, token_ids=TOKENS[:-1] + [7]) is None
        assert tier.get(entry.key, token_ids=TOKENS[:-1]) is None            # shorter than the entry
        assert tier.get(entry.key, token_ids=TOKENS + [1, 2]) is not None    # the query goes on
        assert tier.stats().misses == 2


def test_approximate_entry_only_for_its_session(tmp_path):
    entry = session_entry("ns", "alice", TOKENS)
    with open_tier(tmp_path) as tier:
        tier.put(entry)
        tier.wait_writes()
        assert tier.get(entry.key) is None
        assert tier.get(entry.key, session_id="mallory") is None
        assert tier.get(entry.key, session_id="alice") is not None
        replacement = session_entry("ns", "alice", TOKENS + [9], seed=3)     # the session's next turn
        tier.put(replacement)
        tier.wait_writes()
        assert torch.equal(tier.get(entry.key, session_id="alice").kv, replacement.kv)
        assert tier.stats().entries == 1 and tier.stats().bytes_used == entry_size(replacement)


def test_lru_order_evicts_least_recently_used(tmp_path):
    entries = [prefix_entry("ns", TOKENS[:n], seed=n) for n in (4, 5, 6)]
    size = max(entry_size(entry) for entry in entries)
    with open_tier(tmp_path, budget_bytes=3 * size) as tier:
        for entry in entries:
            tier.put(entry)
        tier.wait_writes()
        tier.get(entries[0].key)                                 # 0 is now the most recent
        assert tier.lru_keys() == [entries[1].key, entries[2].key, entries[0].key]
        tier.put(prefix_entry("ns", TOKENS[:7], seed=7))
        tier.wait_writes()
        assert not tier.contains(entries[1].key) and tier.contains(entries[0].key)
        assert tier.stats().evictions >= 1 and tier.stats().bytes_used <= 3 * size


def test_lru_order_survives_restart_by_mtime(tmp_path):
    entries = [prefix_entry("ns", TOKENS[:n], seed=n) for n in (4, 5, 6)]
    with open_tier(tmp_path) as tier:
        for entry in entries:
            tier.put(entry)
        tier.wait_writes()
    for age, entry in zip((30, 10, 20), entries):
        path = tmp_path / "entries" / namespace_dir("ns") / (entry.key.content + ".kvt")
        os.utime(path, (1_000_000 - age, 1_000_000 - age))
    with open_tier(tmp_path) as tier:
        assert tier.lru_keys() == [entries[0].key, entries[2].key, entries[1].key]


def test_reopen_with_smaller_budget_evicts_oldest(tmp_path):
    entries = [prefix_entry("ns", TOKENS[:n], seed=n) for n in (4, 5, 6)]
    with open_tier(tmp_path) as tier:
        for entry in entries:
            tier.put(entry)
            tier.wait_writes()
    with open_tier(tmp_path, budget_bytes=entry_size(entries[2]) + 1) as tier:
        assert tier.stats().entries == 1 and tier.stats().bytes_used <= entry_size(entries[2]) + 1
        assert len(entry_files(tmp_path)) == 1


def test_entry_larger_than_budget_is_dropped(tmp_path):
    entry = prefix_entry("ns", TOKENS)
    with open_tier(tmp_path, budget_bytes=entry_size(entry) - 1) as tier:
        assert not tier.put(entry)
        assert tier.stats().dropped_over_budget == 1


def test_namespace_share_makes_a_flood_evict_its_own(tmp_path):
    size = entry_size(prefix_entry("x", TOKENS[:8]))
    with open_tier(tmp_path, budget_bytes=4 * size, namespace_share=0.5) as tier:
        quiet = prefix_entry("quiet", TOKENS[:8])
        tier.put(quiet)
        for seed in range(10):
            tier.put(prefix_entry("flood", [seed] + TOKENS[:7], seed=seed))
            tier.wait_writes()
        assert tier.contains(quiet.key)
        assert tier.namespace_bytes("flood") <= 2 * size
        assert tier.stats().bytes_used <= 4 * size


def test_flush_one_namespace_or_all(tmp_path):
    with open_tier(tmp_path) as tier:
        for namespace in ("a", "b"):
            tier.put(prefix_entry(namespace, TOKENS))
            tier.put(prefix_entry(namespace, TOKENS[:4]))
        tier.wait_writes()
        assert tier.flush("a") == 2
        assert tier.namespace_bytes("a") == 0 and tier.stats().entries == 2
        assert tier.get(prefix_entry("a", TOKENS).key) is None
        assert tier.get(prefix_entry("b", TOKENS).key) is not None
        assert tier.flush() == 2
        assert tier.stats().entries == 0 and entry_files(tmp_path) == []


def test_flush_during_a_write_drops_it(tmp_path):
    fs = BlockingFileSystem()
    fs.release.set()
    with open_tier(tmp_path, fs=fs) as tier:
        fs.release.clear()
        tier.put(prefix_entry("a", TOKENS))
        assert tier.namespace_bytes("a") > 0                 # reserved while in flight
        tier.flush("a")
        fs.release.set()
        tier.wait_writes()
        assert tier.stats().entries == 0 and entry_files(tmp_path) == []
        assert tier.namespace_bytes("a") == 0


def test_full_writer_queue_drops_instead_of_blocking(tmp_path):
    fs = BlockingFileSystem()
    fs.release.set()
    with open_tier(tmp_path, fs=fs, write_queue_size=2) as tier:
        fs.release.clear()
        results = [tier.put(prefix_entry("ns", TOKENS[:n], seed=n)) for n in range(2, 10)]
        # one job is with the writer, two wait: the rest are dropped at once
        assert results.count(True) <= 3 and results[-1] is False
        assert tier.stats().dropped_queue_full == results.count(False)
        fs.release.set()
        tier.wait_writes()
        assert tier.stats().entries == results.count(True)


@pytest.mark.parametrize("error_number", [errno.ENOSPC, errno.EIO])
def test_write_error_is_counted_and_reads_go_on(tmp_path, error_number, caplog):
    fs = FailingFileSystem(error_number)
    stored = prefix_entry("ns", TOKENS[:4])
    with open_tier(tmp_path, fs=fs) as tier:
        tier.put(stored)
        tier.wait_writes()
        fs.failing = True
        with caplog.at_level(logging.WARNING, logger="kvsplice.cache.disk_tier"):
            assert tier.put(prefix_entry("ns", TOKENS))               # accepted, fails in the writer
            tier.wait_writes()
        stats = tier.stats()
        assert (stats.write_errors, stats.writes, stats.entries) == (1, 1, 1)
        assert stats.bytes_used == entry_size(stored)                 # the reservation is released
        assert tier.get(stored.key) is not None
        assert "entry dropped" in caplog.text
        fs.failing = False
        assert tier.put(prefix_entry("ns", TOKENS))
        tier.wait_writes()
        assert tier.stats().entries == 2


def test_read_error_is_a_miss_and_the_entry_stays(tmp_path):
    """EIO on a read may be passing: a miss, counted, the file kept for the next try."""
    fs = FailingFileSystem(errno.EIO)
    entry = prefix_entry("ns", TOKENS)
    with open_tier(tmp_path, fs=fs) as tier:
        tier.put(entry)
        tier.wait_writes()
        fs.failing_reads = True
        assert tier.prefetch(entry.key)
        assert tier.get(entry.key) is None
        stats = tier.stats()
        assert (stats.read_errors, stats.misses, stats.corrupt_dropped, stats.entries) == (1, 1, 0, 1)
        fs.failing_reads = False
        assert tier.get(entry.key) is not None


def test_unwritable_directory_is_a_clear_error(tmp_path):
    """A path under a regular file cannot be a directory, even for root."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(DiskTierError, match="cannot use .* as the KV disk tier"):
        open_tier(blocker / "tier")
    with pytest.raises(DiskTierError):
        open_tier(blocker)


def test_one_tier_per_directory(tmp_path):
    with open_tier(tmp_path):
        with pytest.raises(DiskTierError, match="in use by another server"):
            open_tier(tmp_path)
    with open_tier(tmp_path) as tier:                    # closed: the directory is free again
        assert tier.stats().entries == 0


@pytest.mark.parametrize("error_number", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_header_write_failure_is_a_clear_error(tmp_path, error_number):
    """A read-only, full or forbidden directory: the tier refuses to start, saying so."""
    fs = FailingFileSystem(error_number)
    fs.failing = True
    with pytest.raises(DiskTierError, match="cannot write to the KV disk tier"):
        open_tier(tmp_path, fs=fs)


def test_malformed_entry_is_refused(tmp_path):
    with open_tier(tmp_path) as tier:
        entry = prefix_entry("ns", TOKENS)
        with pytest.raises(ValueError, match="kv has shape"):
            tier.put(type(entry)(entry.key, entry.token_ids, 0, entry.kv[:, :, :3]))
        with pytest.raises(ValueError, match="for_prefix"):
            tier.put(type(entry)(EntryKey.for_prefix("ns", [1]), entry.token_ids, 0, entry.kv))
        with pytest.raises(ValueError, match="session"):
            tier.put(type(entry)(entry.key, entry.token_ids, 0, entry.kv, exact=False))
        with pytest.raises(ValueError, match="stores float32"):
            tier.put(type(entry)(entry.key, entry.token_ids, 0, entry.kv.to(torch.bfloat16)))


def test_match_prefix_chains_entries(tmp_path):
    """Radix-node-like runs [0,4) [4,10) [10,16) and a shorter [4,7) are found as one chain, from
    any position they cover."""
    with open_tier(tmp_path) as tier:
        for start, end in ((0, 4), (4, 10), (10, 16), (4, 7)):
            tier.put(prefix_entry("ns", TOKENS[:end], start_pos=start, seed=end))
        tier.wait_writes()
        match = tier.match_prefix("ns", TOKENS + [1, 2], start_pos=0)
        assert match.length == 16 and match.starts == (0, 4, 10) and match.ends == (4, 10, 16)
        assert tier.match_prefix("ns", TOKENS, start_pos=4).ends == (10, 16)
        assert tier.match_prefix("ns", TOKENS, start_pos=5).starts == (4, 10)     # inside [4,10)
        assert tier.match_prefix("ns", TOKENS[:9], start_pos=4).ends == (7,)
        assert tier.match_prefix("ns", TOKENS, start_pos=16).keys == ()
        diverged = TOKENS[:5] + [0] + TOKENS[6:]
        assert tier.match_prefix("ns", diverged).ends == (4,)
        assert tier.match_prefix("ns", diverged, start_pos=2).length == 4
        assert tier.match_prefix("other", TOKENS).keys == ()
        for key, end in zip(match.keys, match.ends):
            assert tier.get(key, token_ids=TOKENS).end_pos == end


def test_match_prefix_chains_overlapping_entries(tmp_path):
    """An entry may start inside the previous one (the tree was split differently when each was
    evicted): the chain still covers the query without a gap."""
    with open_tier(tmp_path) as tier:
        for start, end in ((0, 6), (3, 12), (12, 16)):
            tier.put(prefix_entry("ns", TOKENS[:end], start_pos=start, seed=end))
        tier.wait_writes()
        match = tier.match_prefix("ns", TOKENS)
    assert match.starts == (0, 3, 12) and match.ends == (6, 12, 16) and match.length == 16


def test_same_prefix_is_kept_once_the_longer_run_wins(tmp_path):
    with open_tier(tmp_path) as tier:
        tier.put(prefix_entry("ns", TOKENS, start_pos=8))
        tier.wait_writes()
        assert tier.put(prefix_entry("ns", TOKENS, start_pos=10))             # covered: nothing written
        tier.wait_writes()
        assert tier.stats().writes == 1
        longer = prefix_entry("ns", TOKENS, start_pos=2, seed=4)
        tier.put(longer)
        tier.wait_writes()
        stats = tier.stats()
        assert (stats.writes, stats.entries, stats.evictions, stats.bytes_used) == (2, 1, 0, entry_size(longer))
        assert tier.get(longer.key).start_pos == 2
        assert tier.match_prefix("ns", TOKENS, start_pos=9).starts == (2,)


def test_config_validation_and_gb(tmp_path):
    config = DiskTierConfig.from_gb(tmp_path, 2.5, namespace_share=0.25)
    assert config.budget_bytes == 2_500_000_000 and config.namespace_cap_bytes == 625_000_000
    for bad in ({"budget_bytes": 0}, {"budget_bytes": 1, "namespace_share": 0.0},
                {"budget_bytes": 1, "write_queue_size": 0}):
        with pytest.raises(ValueError):
            DiskTierConfig(tmp_path, **bad)


def test_namespace_name_is_stable_and_typed():
    assert namespace_name(("tenant", None)) == "('tenant', None)"
    assert namespace_name(None) != namespace_name("None")
    with pytest.raises(TypeError):
        namespace_name(("tenant", 1.5))


def test_entry_moved_into_another_namespace_is_never_served(tmp_path):
    """A file copied over another namespace's entry (same content key) is dropped: each entry
    names its namespace in full, checked on load and at rebuild."""
    entry = prefix_entry("a", TOKENS)
    a_path = tmp_path / "entries" / namespace_dir("a") / (entry.key.content + ".kvt")
    b_path = tmp_path / "entries" / namespace_dir("b") / (entry.key.content + ".kvt")
    with open_tier(tmp_path) as tier:
        tier.put(entry)
        tier.put(prefix_entry("b", TOKENS, seed=5))
        tier.wait_writes()
        b_path.write_bytes(a_path.read_bytes())
        assert tier.get(EntryKey.for_prefix("b", TOKENS)) is None
        assert tier.stats().corrupt_dropped == 1 and not b_path.exists()
        b_path.write_bytes(a_path.read_bytes())
    with open_tier(tmp_path) as tier:
        assert tier.stats().corrupt_dropped == 1 and not b_path.exists()
        assert tier.get(entry.key) is not None


KILLED_WRITER = """
import sys, torch
from pathlib import Path
from tests.cache.tier_helpers import open_tier, prefix_entry
tier = open_tier(Path(sys.argv[1]), budget_bytes=4 * 10**6, write_queue_size=4)
for n in range(10**6):
    tier.put(prefix_entry("ns", [n % 7] * 600 + [n], seed=n))
    if n == 20:
        tier.wait_writes()
        print("writing", flush=True)
"""


def test_sigkill_while_writing_leaves_a_consistent_tier(tmp_path):
    """A real SIGKILL at a random point of a stream of writes (and evictions): after a restart
    every indexed entry loads, nothing is corrupt, no temporary is left, the budget holds."""
    import signal
    import subprocess
    import sys
    import time
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                               env=env, cwd=repo)
    try:
        assert process.stdout.readline() == b"writing\n"
        time.sleep(0.3)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    with open_tier(tmp_path, budget_bytes=4 * 10**6) as tier:
        stats = tier.stats()
        assert stats.entries > 0 and stats.corrupt_dropped == 0 and stats.bytes_used <= 4 * 10**6
        for key in tier.lru_keys():
            assert tier.get(key) is not None
        assert tier.stats().misses == 0
    assert not list(tmp_path.glob("entries/*/.*.tmp"))


def test_identity_of_model_changes_with_the_config():
    from kvsplice.models.config import ModelConfig
    hf = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "rope_theta": 10000.0}
    first = TierIdentity.of_model("m", ModelConfig.from_hf_config(hf), torch.bfloat16, "dense")
    assert (first.num_layers, first.num_kv_heads, first.head_dim, first.dtype) == (3, 2, 16, "bfloat16")
    assert first == TierIdentity.of_model("m", ModelConfig.from_hf_config(dict(hf)), torch.bfloat16, "dense")
    other_rope = TierIdentity.of_model("m", ModelConfig.from_hf_config({**hf, "rope_theta": 500000.0}),
                                       torch.bfloat16, "dense")
    assert other_rope != first and other_rope.digest() != first.digest()
    assert TierIdentity.from_json(first.to_json()) == first


@pytest.mark.parametrize("target", [[20, 21, 22, 23], [20, 22, 21, 30], [23, 22, 21, 20]])
def test_pool_round_trip_through_the_tier(tmp_path, target):
    """Gather slots from a pool, store, load, scatter into other slots (a run of fresh slots is
    copied as one slice, any other order scattered): bit-exact, in bf16."""
    from kvsplice.cache.kv_pool import KVPool
    pool = KVPool(32, LAYERS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    source, target = torch.tensor([5, 3, 9, 1]), torch.tensor(target)
    entry = TierEntry(EntryKey.for_prefix("ns", TOKENS[:6]), torch.tensor(TOKENS[:6]), 2,
                      kv_from_pool(pool, source))
    with open_tier(tmp_path, ident=identity("bfloat16")) as tier:
        tier.put(entry)
        tier.wait_writes()
        kv_into_pool(pool, target, tier.get(entry.key).kv)
    assert torch.equal(pool.k[:, target], pool.k[:, source]) and torch.equal(pool.v[:, target], pool.v[:, source])
