"""Disk-tier reads off the engine thread (kvsplice.engine.tier_reads): a request whose history is
on disk waits in the queue while its files are read, the other requests keep decoding, and its
reply is that of exact recompute; a read that fails costs a prefill, never a wrong token."""

from __future__ import annotations

import errno

import pytest

from kvsplice.engine.request import ReqStatus
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams
from tests.cache.tier_helpers import FailingFileSystem, GatedReadFileSystem, prompt_ids
from tests.engine.test_disk_tier_engine import GREEDY, assert_same_output, cold, tiered_llm

BIG_POOL = 4096   # nothing is evicted: the history is on disk only because of the restart


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def written_history(model_dir, tier_dir, prompt: list[int]) -> None:
    """A first server answers `prompt` (written through to `tier_dir`) and goes away."""
    first = tiered_llm(model_dir, tier_dir, num_slots=BIG_POOL)
    first.generate([prompt], GREEDY)
    first.engine.close()


def outputs_by_rid(outputs) -> dict:
    found: dict = {}
    for out in outputs:
        found.setdefault(out.rid, []).append(out)
    return found


def test_a_slow_tier_read_holds_its_request_not_the_engine(model_dir, tmp_path):
    """While the reader thread is stuck in the history's file read, another request decodes a
    token every step and the loading one stays queued; once the read ends it is admitted with its
    history from disk and answers as exact recompute (fp32)."""
    history = prompt_ids(300, seed=40)
    written_history(model_dir, tmp_path / "tier", history)
    fs = GatedReadFileSystem()
    engine = tiered_llm(model_dir, tmp_path / "tier", fs=fs, num_slots=BIG_POOL).engine
    other = engine.add_request(prompt_ids(30, seed=41), SamplingParams(max_tokens=12, temperature=0.0,
                                                                       ignore_eos=True), rid="other")
    while not engine._reqs[other].output_ids:
        engine.step()
    loading = engine.add_request(history + prompt_ids(10, seed=42), GREEDY, rid="loading")
    assert fs.entered.wait(timeout=60)                     # the reader thread is inside the read
    decoded = 0
    for _ in range(5):
        news = outputs_by_rid(engine.step())
        decoded += sum(len(out.new_token_ids) for out in news.get(other, []))
        assert loading not in news
    assert decoded == 5                                     # one token per step, never stalled
    assert engine._reqs[loading].status is ReqStatus.WAITING
    fs.release.set()
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    [final] = [out for out in outputs if out.rid == loading and out.finished]
    assert final.reuse.disk_tokens >= 256
    tokens = [t for out in outputs if out.rid == loading for t in out.new_token_ids]
    reference = cold(model_dir, history + prompt_ids(10, seed=42))
    assert tokens == reference.token_ids
    engine.check_integrity()
    engine.close()


@pytest.mark.parametrize("failure", ["read_error", "truncated", "missing", "truncated_before_start"])
def test_a_failed_tier_read_falls_back_to_recompute(model_dir, tmp_path, failure):
    """EIO on every read, entry files cut short or deleted behind the tier's back (after it
    indexed them), or cut short before the restart (dropped when the index is rebuilt): the
    request prefills its history and answers as exact recompute; the engine goes on."""
    history = prompt_ids(300, seed=43)
    written_history(model_dir, tmp_path / "tier", history)
    if failure == "truncated_before_start":
        for path in (tmp_path / "tier" / "entries").rglob("*.kvt"):
            path.write_bytes(path.read_bytes()[:-1])
    fs = FailingFileSystem(errno.EIO)
    llm = tiered_llm(model_dir, tmp_path / "tier", fs=fs, num_slots=BIG_POOL)
    files = sorted((tmp_path / "tier" / "entries").rglob("*.kvt"))
    assert files or failure == "truncated_before_start"
    for path in files:
        if failure == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        elif failure == "missing":
            path.unlink()
    fs.failing_reads = failure == "read_error"
    prompt = history + prompt_ids(10, seed=44)
    [served] = llm.generate([prompt], GREEDY)
    assert served.reuse.disk_tokens == 0
    assert_same_output(served, cold(model_dir, prompt))
    stats = llm.engine.cache.tier.stats()
    assert (stats.read_errors if failure == "read_error" else stats.corrupt_dropped) >= 1
    llm.engine.check_integrity()
    llm.engine.close()


def test_a_request_with_nothing_on_disk_never_waits_for_others_reads(model_dir, tmp_path):
    """With room for one request's reads, held by a request stuck in a slow read, a request whose
    prompt the tier does not hold is admitted and answered meanwhile."""
    from kvsplice.cache.disk_tier import DiskTierConfig
    from kvsplice.config import EngineConfig
    from kvsplice.engine.llm import build_engine

    history = prompt_ids(300, seed=45)
    written_history(model_dir, tmp_path / "tier", history)
    fs = GatedReadFileSystem()
    tier = DiskTierConfig(tmp_path / "tier", budget_bytes=50_000_000, max_prefetches=1, fs=fs)
    engine = build_engine(EngineConfig(model=model_dir, disk_tier=tier, num_slots=BIG_POOL))
    loading = engine.add_request(history + prompt_ids(10, seed=46), GREEDY, rid="loading")
    assert fs.entered.wait(timeout=60)
    fresh = engine.add_request(prompt_ids(30, seed=47), GREEDY, rid="fresh")
    finished = set()
    for _ in range(50):
        finished |= {out.rid for out in engine.step() if out.finished}
        if fresh in finished:
            break
    assert fresh in finished and loading not in finished
    fs.release.set()
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    [final] = [out for out in outputs if out.rid == loading and out.finished]
    assert final.reuse.disk_tokens >= 256
    engine.check_integrity()
    engine.close()


def test_a_prefix_the_tree_evicts_while_the_request_waits_comes_back_from_the_tier(model_dir, tmp_path):
    """Queued while the tree still holds its history (nothing to read then), the request finds the
    history evicted by the time it is admitted: it looks again, waits for the read and loads the
    history from disk instead of prefilling it, and answers as exact recompute (fp32)."""
    history = prompt_ids(300, seed=50)
    # SCR off: a session would keep its history locked in the tree
    llm = tiered_llm(model_dir, tmp_path / "tier", num_slots=BIG_POOL, reuse=ReuseConfig(enabled=False))
    engine = llm.engine
    llm.generate([history], GREEDY)
    engine.cache.tier.wait_writes()
    prompt = history + prompt_ids(10, seed=51)
    rid = engine.add_request(prompt, GREEDY, rid="returning")
    assert not engine.cache.reads.holds(rid)                 # the tree held it: nothing to read
    engine.cache.radix.evict(BIG_POOL)                        # before its admission, the tree lets it go
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    [final] = [out for out in outputs if out.rid == rid and out.finished]
    assert final.reuse.disk_tokens >= 256
    tokens = [t for out in outputs if out.rid == rid for t in out.new_token_ids]
    assert tokens == cold(model_dir, prompt).token_ids
    engine.check_integrity()
    engine.close()
