"""Tenants under the engine: with a tenant share, one namespace's flood evicts its own history
(radix entries and idle SCR sessions) before another's; a tenant's flush drops its own namespaces
only, in the pool and in the disk tier; one owner never loads another's tier entries."""

from __future__ import annotations

import pytest

from kvsplice.cache.disk_tier import DiskTierConfig
from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams
from tests.cache.tier_helpers import prompt_ids

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
POOL = 400   # slots: one tenant's prompt and two of another's fit; a third evicts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def make_llm(model_dir: str, tier_dir=None, **kwargs) -> LLM:
    tier = DiskTierConfig(tier_dir, budget_bytes=50_000_000, write_queue_size=256) if tier_dir else None
    return LLM(engine=build_engine(EngineConfig(model=model_dir, num_slots=POOL, disk_tier=tier, **kwargs)))


def returning_hit(llm: LLM) -> int:
    """Tenant a's prompt, then three of tenant b's (the third needs room), then a's again: the
    prefix tokens a's return gets from the pool."""
    mine = prompt_ids(100, seed=1)
    llm.generate([mine], GREEDY, owner="a")
    for seed in (11, 12, 13):
        llm.generate([prompt_ids(100, seed)], GREEDY, owner="b")
    [again] = llm.generate([mine], GREEDY, owner="a")
    llm.engine.check_integrity()
    return again.reuse.prefix_tokens


@pytest.mark.parametrize("scr", [True, False])
def test_a_flood_evicts_the_flooding_tenant_first(model_dir, scr):
    """Without a share the pool evicts a's older history (plain LRU); with a share of half the pool,
    b is over its share and loses its own oldest entry (and idle session) instead."""
    reuse = ReuseConfig(enabled=scr)
    assert returning_hit(make_llm(model_dir, reuse=reuse)) == 0
    shared = make_llm(model_dir, reuse=reuse, tenant_kv_share=0.5)
    assert returning_hit(shared) == 99


def test_tenant_share_is_validated():
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="tenant_kv_share"):
            EngineConfig(tenant_kv_share=bad)


def test_one_owner_never_loads_another_owners_tier_entries(model_dir, tmp_path):
    """Same prompt, same (absent) cache_salt, two API-key owners: b's request finds nothing of a's
    in the pool or the tier; a gets its own back from the tier."""
    llm = make_llm(model_dir, tmp_path / "tier")
    prompt = prompt_ids(140, seed=4)
    llm.generate([prompt], GREEDY, owner="a")
    for seed in (21, 22, 23):
        llm.generate([prompt_ids(140, seed)], GREEDY, owner="a")
    llm.engine.cache.tier.wait_writes()
    [b] = llm.generate([prompt], GREEDY, owner="b")
    assert b.reuse.disk_tokens == 0 and b.reuse.prefix_tokens == 0
    for seed in (24, 25, 26):
        llm.generate([prompt_ids(140, seed)], GREEDY, owner="b")
    llm.engine.cache.tier.wait_writes()
    [a] = llm.generate([prompt], GREEDY, owner="a")
    assert a.reuse.disk_tokens > 0
    assert a.token_ids == b.token_ids
    llm.engine.close()


def test_a_tenant_flush_drops_its_own_namespaces_only(model_dir, tmp_path):
    llm = make_llm(model_dir, tmp_path / "tier")
    ours, theirs = prompt_ids(140, seed=7), prompt_ids(140, seed=8)   # 140: an entry ends at 128
    llm.generate([ours], GREEDY, owner="a")
    llm.generate([ours], GREEDY, owner="a", cache_salt="user-2")
    llm.generate([theirs], GREEDY, owner="b")
    llm.engine.cache.radix.evict(POOL)            # everything to the tier, so both tiers hold entries
    llm.engine.reuse.drop_idle_sessions()
    llm.engine.cache.radix.evict(POOL)
    llm.engine.cache.tier.wait_writes()
    llm.generate([ours], GREEDY, owner="a")       # back in the pool too
    llm.engine.flush_cache(owner="a")
    llm.engine.cache.tier.wait_writes()
    names = llm.engine.cache.tier.namespaces()
    assert names and all("'b'" in name for name in names)
    assert [ns.owner for ns in llm.engine.cache.radix.namespaces()] == []
    [a] = llm.generate([ours], GREEDY, owner="a")
    [a2] = llm.generate([ours], GREEDY, owner="a", cache_salt="user-2")
    [b] = llm.generate([theirs], GREEDY, owner="b")
    assert a.reuse.prefix_tokens == 0 and a2.reuse.prefix_tokens == 0
    assert b.reuse.prefix_tokens > 0 and b.reuse.disk_tokens > 0
    llm.engine.flush_cache()
    llm.engine.cache.tier.wait_writes()
    assert llm.engine.cache.tier.stats().entries == 0 and llm.engine.cache.radix.cached_size() == 0
    llm.engine.check_integrity()
    llm.engine.close()
