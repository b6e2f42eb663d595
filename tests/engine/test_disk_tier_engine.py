"""The disk tier under the engine: a prefix the pool evicted is served from disk on its return
(usage.reuse.disk_tokens), with the cold run's greedy output, across a restart, never across
namespaces, and recomputed when its file went bad."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvsplice.cache.disk_tier import DiskTierConfig
from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.sampling_params import SamplingParams
from tests.cache.tier_helpers import prompt_ids

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
POOL = 320   # slots: three 140-token prompts do not fit together, so the first is evicted


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def tiered_llm(model_dir: str, tier_dir: Path, fs=None, **kwargs) -> LLM:
    tier = DiskTierConfig(tier_dir, budget_bytes=50_000_000, write_queue_size=256,
                          **({"fs": fs} if fs is not None else {}))
    kwargs.setdefault("num_slots", POOL)
    return LLM(engine=build_engine(EngineConfig(model=model_dir, disk_tier=tier, **kwargs)))


def cold(model_dir: str, prompt: list[int]):
    llm = LLM(engine=build_engine(EngineConfig(model=model_dir, prefix_cache=False)))
    return llm.generate([prompt], GREEDY)[0]


def evict_with_others(llm: LLM, seeds=(101, 102), **kwargs) -> None:
    """Run other prompts through the small pool so that earlier prefixes are evicted (to the tier)."""
    for seed in seeds:
        llm.generate([prompt_ids(140, seed)], GREEDY, **kwargs)
    llm.engine.cache.tier.wait_writes()


def assert_same_output(a, b, atol=1e-4):
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert abs(x.logprob - y.logprob) <= atol


def test_an_evicted_prefix_is_served_from_the_tier_with_the_cold_output(model_dir, tmp_path):
    llm = tiered_llm(model_dir, tmp_path / "tier")
    prompt = prompt_ids(140, seed=1)
    [first] = llm.generate([prompt], GREEDY)
    assert first.reuse.disk_tokens == 0
    evict_with_others(llm)
    stats = llm.engine.cache.tier.stats()
    assert stats.writes >= 1 and stats.entries >= 1 and stats.write_errors == 0
    [again] = llm.generate([prompt], GREEDY)
    assert again.reuse.disk_tokens > 0
    assert again.reuse.prefix_tokens >= again.reuse.disk_tokens
    assert again.reuse.prefilled_tokens == len(prompt) - again.reuse.prefix_tokens
    again.reuse.check(len(prompt))
    assert_same_output(again, cold(model_dir, prompt))
    assert llm.engine.cache.tier.stats().hits >= 1
    assert llm.engine.counters.disk_tokens == again.reuse.disk_tokens
    llm.engine.check_integrity()
    llm.engine.close()


def test_a_new_engine_on_the_same_directory_serves_from_it(model_dir, tmp_path):
    prompt = prompt_ids(140, seed=2)
    first = tiered_llm(model_dir, tmp_path / "tier")
    first.generate([prompt], GREEDY)
    evict_with_others(first)
    first.engine.close()
    restarted = tiered_llm(model_dir, tmp_path / "tier")
    [served] = restarted.generate([prompt], GREEDY)
    assert served.reuse.disk_tokens > 0
    assert_same_output(served, cold(model_dir, prompt))
    restarted.engine.close()


def test_a_finished_request_is_written_through_without_any_eviction(model_dir, tmp_path):
    """What a SIGKILL leaves: the K/V of finished requests is on disk although the pool evicted
    nothing, in 128-token pieces plus one ending at the prompt's end (where the next turn, which
    does not resend the reply's tokens, diverges); a second turn writes only its new pieces."""
    prompt = prompt_ids(300, seed=5)
    first = tiered_llm(model_dir, tmp_path / "tier", num_slots=4096)
    first.generate([prompt], GREEDY)
    first.engine.cache.tier.wait_writes()
    stats = first.engine.cache.tier.stats()
    assert stats.writes == 4 and stats.evictions == 0          # [0, 128) [128, 256) [256, 300) [300, 305)
    [again] = first.generate([prompt + prompt_ids(20, seed=6)], GREEDY)
    assert again.reuse.prefix_tokens == len(prompt)
    first.engine.cache.tier.wait_writes()
    assert first.engine.cache.tier.stats().writes == 4 + 2     # [256, 320) [320, 325)
    first.engine.close()
    restarted = tiered_llm(model_dir, tmp_path / "tier", num_slots=4096)
    next_turn = prompt + prompt_ids(30, seed=9)
    [served] = restarted.generate([next_turn], GREEDY)
    assert served.reuse.disk_tokens == len(prompt)
    assert_same_output(served, cold(model_dir, next_turn))
    restarted.engine.check_integrity()
    restarted.engine.close()


def test_a_corrupted_entry_is_recomputed_with_the_same_output(model_dir, tmp_path):
    llm = tiered_llm(model_dir, tmp_path / "tier")
    prompt = prompt_ids(140, seed=3)
    llm.generate([prompt], GREEDY)
    evict_with_others(llm)
    files = sorted((tmp_path / "tier" / "entries").rglob("*.kvt"))
    assert files
    for path in files:                       # flip a byte in the middle of every entry's payload
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    [served] = llm.generate([prompt], GREEDY)
    assert served.reuse.disk_tokens == 0
    assert llm.engine.cache.tier.stats().corrupt_dropped >= 1
    assert_same_output(served, cold(model_dir, prompt))
    llm.engine.check_integrity()
    llm.engine.close()


def test_namespaces_never_share_tier_entries(model_dir, tmp_path):
    llm = tiered_llm(model_dir, tmp_path / "tier")
    prompt = prompt_ids(140, seed=4)
    llm.generate([prompt], GREEDY, cache_salt="alice")
    evict_with_others(llm, cache_salt="alice")
    [bob] = llm.generate([prompt], GREEDY, cache_salt="bob")
    assert bob.reuse.disk_tokens == 0 and bob.reuse.prefix_tokens == 0
    evict_with_others(llm, seeds=(103, 104), cache_salt="bob")
    [alice] = llm.generate([prompt], GREEDY, cache_salt="alice")
    assert alice.reuse.disk_tokens > 0
    assert_same_output(alice, bob)
    llm.engine.close()


def test_flush_cache_empties_the_tier(model_dir, tmp_path):
    llm = tiered_llm(model_dir, tmp_path / "tier")
    prompt = prompt_ids(140, seed=5)
    llm.generate([prompt], GREEDY)
    evict_with_others(llm)
    assert llm.engine.cache.tier.stats().entries >= 1
    llm.engine.flush_cache()
    llm.engine.cache.tier.wait_writes()
    assert llm.engine.cache.tier.stats().entries == 0
    [served] = llm.generate([prompt], GREEDY)
    assert served.reuse.disk_tokens == 0 and served.reuse.prefix_tokens == 0
    llm.engine.close()


def test_an_edited_turn_whose_session_was_dropped_loads_its_head_from_the_tier(model_dir, tmp_path):
    """SCR on: the pool drops the idle session, its exact K/V goes to the tier; the next, edited
    turn finds no session K/V but loads the unchanged head from disk, and is exact."""
    llm = tiered_llm(model_dir, tmp_path / "tier", max_batch_tokens=64)
    head, rest = prompt_ids(130, seed=6), prompt_ids(20, seed=8)
    llm.generate([head + prompt_ids(8, seed=7) + rest], GREEDY, session_id="s1")
    evict_with_others(llm)
    assert llm.engine.reuse.sessions_evicted_for_memory >= 1
    edited = head + prompt_ids(5, seed=9) + rest
    [turn] = llm.generate([edited], GREEDY, session_id="s1")
    turn.reuse.check(len(edited))
    assert turn.reuse.disk_tokens >= 128 and turn.reuse.relocated_tokens == 0
    assert_same_output(turn, cold(model_dir, edited))
    llm.engine.check_integrity()
    llm.engine.close()


def test_scr_relocates_beyond_a_prefix_loaded_from_the_tier(model_dir, tmp_path):
    """The tier's prefix and SCR together: the head comes back from disk (its first conversation
    was evicted) and stays cached; an edit after it relocates the session's kept span."""
    llm = tiered_llm(model_dir, tmp_path / "tier", max_batch_tokens=64)
    head = prompt_ids(130, seed=10)
    llm.generate([head + prompt_ids(10, seed=11)], GREEDY, session_id="old")
    evict_with_others(llm)
    body, tail = prompt_ids(80, seed=12), prompt_ids(10, seed=13)
    [second] = llm.generate([head + body], GREEDY, session_id="s2")
    assert second.reuse.disk_tokens >= 128                    # the head from disk, into the radix tree
    edited = head + prompt_ids(3, seed=14) + body + tail
    [turn] = llm.generate([edited], GREEDY, session_id="s2")
    turn.reuse.check(len(edited))
    assert turn.reuse.prefix_tokens >= 128 and turn.reuse.relocated_tokens > 0
    llm.engine.check_integrity()
    llm.engine.close()


def test_a_named_session_dropped_for_memory_comes_back_from_the_tier(model_dir, tmp_path):
    """A session whose private (relocated) K/V the pool dropped is restored from the tier by its own
    id, and its next turn relocates from it again; another namespace never gets it."""
    llm = tiered_llm(model_dir, tmp_path / "tier", max_batch_tokens=64)
    head, rest = prompt_ids(40, seed=20), prompt_ids(100, seed=21)
    llm.generate([head + prompt_ids(6, seed=22) + rest], GREEDY, session_id="s1")
    edited = head + prompt_ids(4, seed=23) + rest
    [second] = llm.generate([edited], GREEDY, session_id="s1")
    assert second.reuse.relocated_tokens > 0
    evict_with_others(llm)
    assert llm.engine.reuse.sessions_evicted_for_memory >= 1
    [stranger] = llm.generate([edited + second.token_ids + prompt_ids(5, seed=24)], GREEDY,
                              session_id="s1", cache_salt="other")
    assert llm.engine.reuse.sessions_restored == 0 and stranger.reuse.relocated_tokens == 0
    third_prompt = prompt_ids(3, seed=25) + edited[3:] + second.token_ids + prompt_ids(5, seed=24)
    [third] = llm.generate([third_prompt], GREEDY, session_id="s1")
    assert llm.engine.reuse.sessions_restored == 1
    third.reuse.check(len(third_prompt))
    assert third.reuse.session == "matched" and third.reuse.relocated_tokens > 0
    llm.engine.check_integrity()
    llm.engine.close()


def test_a_named_session_survives_a_restart_without_any_eviction(model_dir, tmp_path):
    """Written through after its turn: a new engine on the directory restores the session (its
    relocated K/V) by its id, and the next edited turn relocates from it."""
    first = tiered_llm(model_dir, tmp_path / "tier", num_slots=4096, max_batch_tokens=64)
    head, rest = prompt_ids(40, seed=30), prompt_ids(100, seed=31)
    first.generate([head + prompt_ids(6, seed=32) + rest], GREEDY, session_id="s1")
    edited = head + prompt_ids(4, seed=33) + rest
    [second] = first.generate([edited], GREEDY, session_id="s1")
    assert second.reuse.relocated_tokens > 0
    assert first.engine.reuse.sessions_evicted_for_memory == 0
    first.engine.close()
    restarted = tiered_llm(model_dir, tmp_path / "tier", num_slots=4096, max_batch_tokens=64)
    third_prompt = prompt_ids(3, seed=35) + edited[3:] + second.token_ids + prompt_ids(5, seed=34)
    [third] = restarted.generate([third_prompt], GREEDY, session_id="s1")
    assert restarted.engine.reuse.sessions_restored == 1
    third.reuse.check(len(third_prompt))
    assert third.reuse.session == "matched" and third.reuse.relocated_tokens > 0
    restarted.engine.check_integrity()
    restarted.engine.close()


def test_an_all_exact_named_session_survives_a_restart(model_dir, tmp_path):
    """A session's first turn relocates nothing (its K/V is all exact, in the tier's exact
    entries): its completion's K/V is written as the session's own entry, so a restarted engine
    restores the session and the next, edited turn relocates from it; the restored tokens the
    prompt shares count as disk tokens."""
    first = tiered_llm(model_dir, tmp_path / "tier", num_slots=4096, max_batch_tokens=64)
    head, rest = prompt_ids(40, seed=50), prompt_ids(100, seed=51)
    [one] = first.generate([head + prompt_ids(6, seed=52) + rest], GREEDY, session_id="s1")
    assert one.reuse.relocated_tokens == 0
    first.engine.close()
    restarted = tiered_llm(model_dir, tmp_path / "tier", num_slots=4096, max_batch_tokens=64)
    edited = head + prompt_ids(4, seed=53) + rest + one.token_ids + prompt_ids(5, seed=54)
    [two] = restarted.generate([edited], GREEDY, session_id="s1")
    assert restarted.engine.reuse.sessions_restored == 1
    two.reuse.check(len(edited))
    assert two.reuse.session == "matched" and two.reuse.relocated_tokens > 0
    assert two.reuse.disk_tokens == two.reuse.prefix_tokens >= len(head) - 1
    restarted.engine.check_integrity()
    restarted.engine.close()


def test_a_full_disk_costs_reuse_never_a_reply(model_dir, tmp_path):
    """ENOSPC on every write once serving: each is counted and dropped, and the prompts evicted
    meanwhile are recomputed with the cold output."""
    from tests.cache.tier_helpers import FailingFileSystem
    fs = FailingFileSystem(errno.ENOSPC)
    llm = tiered_llm(model_dir, tmp_path / "tier", fs=fs)
    fs.failing = True
    prompt = prompt_ids(140, seed=7)
    llm.generate([prompt], GREEDY)
    evict_with_others(llm)
    stats = llm.engine.cache.tier.stats()
    assert stats.write_errors >= 3 and stats.writes == 0 and stats.entries == 0 and stats.bytes_used == 0
    [again] = llm.generate([prompt], GREEDY)
    assert again.reuse.disk_tokens == 0
    assert_same_output(again, cold(model_dir, prompt))
    llm.engine.check_integrity()
    llm.engine.close()


def test_another_dtype_on_the_same_directory_ignores_its_entries(model_dir, tmp_path):
    """A model identity mismatch (here the dtype): the old entries are removed unread and counted."""
    prompt = prompt_ids(140, seed=8)
    first = tiered_llm(model_dir, tmp_path / "tier")
    first.generate([prompt], GREEDY)
    first.engine.close()
    old_files = sorted((tmp_path / "tier" / "entries").rglob("*.kvt"))
    assert len(old_files) >= 2
    other = tiered_llm(model_dir, tmp_path / "tier", dtype="bfloat16")
    assert other.engine.cache.tier.stats().ignored_at_start == len(old_files)
    assert not any(path.exists() for path in old_files)
    [served] = other.generate([prompt], GREEDY)
    assert served.reuse.disk_tokens == 0
    other.engine.close()
