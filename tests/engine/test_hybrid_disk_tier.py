"""The disk tier on a hybrid model (Gated DeltaNet + attention): entries carry the linear layers'
state checkpoints, so a prefix the pool evicted (or one written before a restart) resumes from the
tier at the deepest stored checkpoint, with a cold run's tokens, logprobs and prompt logits in
fp32; an entry whose state is corrupt or missing costs a prefill, never a token."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvsplice.cache.disk_tier import DiskTierConfig
from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.state_pool import StatePool
from kvsplice.cache.tier_format import PREFIX, EntryKey, TierEntry, namespace_name, parse_header
from kvsplice.config import EngineConfig
from kvsplice.engine.cache_manager import CacheManager
from kvsplice.engine.llm import build_engine
from kvsplice.engine.request import Namespace, Req
from kvsplice.layer_configs import LinearAttnConfig
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

SCR = ReuseConfig(match_min_tokens=16, min_span=8, tail=2, max_spans=6, checkpoint_policy="every:64")
NO_SCR = SCR.replace(enabled=False)
POOL = 320          # slots: three 140-token prompts do not fit together, so the first is evicted
PROMPT = 140        # checkpoints at 64, 128 (every:64) and the request's end (145)
MAX_TOKENS = 6
NAMESPACE = Namespace(None, None)      # a request without owner or cache_salt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from models.test_hybrid import hf_tiny
    from tiny_model import make_tokenizer_files

    path = tmp_path_factory.mktemp("tiny-hybrid-tier")
    vocab = make_tokenizer_files(path)
    eos_id = json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    hf_tiny("qwen3_5_text", seed=7, vocab_size=vocab, eos_token_id=eos_id).save_pretrained(
        path, safe_serialization=True)
    return str(path)


def tiered(model_dir, tier_dir, reuse=NO_SCR, **kwargs):
    tier = DiskTierConfig(tier_dir, budget_bytes=50_000_000, write_queue_size=256)
    kwargs.setdefault("num_slots", POOL)
    return build_engine(EngineConfig(model=model_dir, reuse=reuse, disk_tier=tier, **kwargs))


def run(engine, prompt, **kwargs):
    """Serve one request to the end: (token ids, chosen-token logprobs, prompt logits by offset
    of every prompt offset it computed, final output)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    rid = engine.add_request(prompt, params, keep_last_logits=len(prompt), **kwargs)
    tokens, lps, logits, last = [], [], {}, None
    while engine.has_work():
        for out in engine.step():
            if out.rid == rid:
                tokens += out.new_token_ids
                lps += [lp.logprob for lp in out.logprobs]
                logits.update(out.prompt_logits or {})
                last = out
    engine.check_integrity()
    return tokens, lps, logits, last


def cold(model_dir, prompt):
    return run(build_engine(EngineConfig(model=model_dir, reuse=NO_SCR, prefix_cache=False)), prompt)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_same(hit, reference, atol=1e-4):
    """Same tokens and logprobs, and the same logits at every prompt offset the hit computed."""
    assert hit[0] == reference[0]
    assert max(abs(x - y) for x, y in zip(hit[1], reference[1])) <= atol
    assert hit[2]
    for offset, logits in hit[2].items():
        assert (logits - reference[2][offset]).abs().max() <= atol


def key_at(prompt: list[int], end: int) -> EntryKey:
    """The tier's key of the exact entry ending at `end` of `prompt`."""
    return EntryKey.for_prefix(namespace_name(NAMESPACE), prompt[:end])


def evict_with_others(engine, seeds=(101, 102)) -> None:
    for seed in seeds:
        run(engine, ids(PROMPT, seed))
    engine.cache.tier.wait_writes()


def test_a_finished_hybrid_request_writes_its_checkpoints_with_its_kv(model_dir, tmp_path):
    engine = tiered(model_dir, tmp_path / "tier", num_slots=4096)
    prompt = ids(PROMPT, 1)
    sequence = prompt + run(engine, prompt)[0]
    tier = engine.cache.tier
    tier.wait_writes()
    # cut at 64 and 128 (checkpoints), the prompt's end (no checkpoint under every:64) and the
    # request's end (K/V of 145 tokens: the last sampled one has none)
    assert tier.stats().entries == 4
    ends = {64: True, 128: True, PROMPT: False, PROMPT + MAX_TOKENS - 1: True}
    for end, with_state in ends.items():
        assert tier.contains(key_at(sequence, end)) and tier.has_states(key_at(sequence, end)) == with_state
    engine.close()


def test_an_evicted_hybrid_prefix_resumes_from_the_tier_with_the_cold_output(model_dir, tmp_path):
    engine = tiered(model_dir, tmp_path / "tier")
    prompt = ids(PROMPT, 1)
    run(engine, prompt)
    evict_with_others(engine)
    assert engine.cache.radix.match_prefix(prompt, NAMESPACE).length == 0     # gone from the pool
    hit = run(engine, prompt)
    reuse, state = hit[3].reuse, hit[3].state_reuse
    # the match stops before the prompt's last token: the entries up to 128 (their state) serve it
    assert reuse.disk_tokens == 128 and reuse.prefix_tokens == 128 and state.checkpoint_depth == 128
    assert sorted(hit[2]) == list(range(128, PROMPT))
    assert_same(hit, cold(model_dir, prompt))
    assert engine.cache.tier.stats().hits >= 2
    engine.close()


def test_a_spilled_leaf_takes_its_checkpoint_to_the_tier(model_dir, tmp_path):
    """A leaf evicted for room carries its checkpoint: with the write-through's entries gone (the
    tier flushed after the request), the eviction alone puts the K/V and state back."""
    engine = tiered(model_dir, tmp_path / "tier")
    prompt = ids(PROMPT, 3)
    sequence = prompt + run(engine, prompt)[0]
    tier = engine.cache.tier
    tier.wait_writes()
    tier.flush()
    assert not tier.contains(key_at(prompt, 128))
    evict_with_others(engine, seeds=(103, 104))
    assert engine.cache.radix.match_prefix(prompt, NAMESPACE).length == 0
    # the tree's nodes end at its checkpoints (64, 128, 145): each leaf went with its own
    assert tier.contains(key_at(prompt, 128)) and tier.has_states(key_at(sequence, PROMPT + MAX_TOKENS - 1))
    next_turn = sequence + ids(10, 4)
    hit = run(engine, next_turn)
    kv_len = PROMPT + MAX_TOKENS - 1
    assert hit[3].reuse.disk_tokens == kv_len and hit[3].state_reuse.checkpoint_depth == kv_len
    assert_same(hit, cold(model_dir, next_turn))
    engine.close()


def test_a_checkpoint_the_tree_thinned_comes_back_from_the_tier(model_dir, tmp_path):
    """The pool still holds the prompt's K/V but no longer its checkpoint at 128: the tier's entry
    ending there brings the state back (nothing but the state is read into the pool)."""
    engine = tiered(model_dir, tmp_path / "tier", num_slots=4096)
    prompt = ids(PROMPT, 11)
    run(engine, prompt)
    engine.cache.tier.wait_writes()
    radix = engine.cache.radix
    radix.drop_checkpoint(radix.match_prefix(prompt[:128], NAMESPACE).node)
    assert radix.deepest_checkpoint(radix.match_prefix(prompt[:PROMPT - 1], NAMESPACE).node)[1] == 64
    hit = run(engine, prompt)
    state, reuse = hit[3].state_reuse, hit[3].reuse
    assert (state.radix_match, state.checkpoint_depth) == (PROMPT - 1, 128)
    assert reuse.prefix_tokens == 128 and reuse.disk_tokens == 0      # the K/V came from the pool
    assert engine.cache.tier.stats().hits >= 1
    assert_same(hit, cold(model_dir, prompt))
    engine.close()


def test_a_corrupted_state_is_recomputed_with_the_cold_output(model_dir, tmp_path):
    engine = tiered(model_dir, tmp_path / "tier")
    prompt = ids(PROMPT, 5)
    run(engine, prompt)
    evict_with_others(engine, seeds=(105, 106))
    tier = engine.cache.tier
    for end in (64, 128):
        [path] = (tmp_path / "tier" / "entries").rglob(key_at(prompt, end).content + ".kvt")
        data = bytearray(path.read_bytes())
        header = parse_header(bytes(data))
        offset = next(offset for name, _, _, offset in header.tensors if name == "state.rec")
        data[PREFIX.size + header.header_len + offset + 16] ^= 0xFF    # one byte of the recurrent state
        path.write_bytes(bytes(data))
    hit = run(engine, prompt)
    assert tier.stats().corrupt_dropped >= 1
    assert hit[3].reuse.disk_tokens == 0 and hit[3].reuse.prefix_tokens == 0
    assert_same(hit, cold(model_dir, prompt))
    engine.close()


def test_entries_without_their_states_load_no_resume_point(model_dir, tmp_path):
    """K/V stored without a checkpoint (its state missing) is loaded but gives no resume point: the
    match is cut back to the deepest checkpoint (none here) and everything is prefilled."""
    engine = tiered(model_dir, tmp_path / "tier")
    prompt = ids(PROMPT, 7)
    run(engine, prompt)
    evict_with_others(engine, seeds=(107, 108))
    tier = engine.cache.tier
    entries = [tier.get(key) for key in tier.lru_keys()]
    tier.flush()
    for entry in entries:
        tier.put(TierEntry(entry.key, entry.token_ids.clone(), entry.start_pos, entry.kv.clone()))
    tier.wait_writes()
    hit = run(engine, prompt)
    assert hit[3].state_reuse.radix_match >= 128 and hit[3].state_reuse.checkpoint_depth == 0
    assert hit[3].reuse.disk_tokens == 0 and hit[3].reuse.prefix_tokens == 0
    assert_same(hit, cold(model_dir, prompt))
    engine.close()


def test_another_namespace_never_loads_a_hybrid_entry(model_dir, tmp_path):
    engine = tiered(model_dir, tmp_path / "tier")
    prompt = ids(PROMPT, 13)
    run(engine, prompt, cache_salt="alice")
    evict_with_others(engine, seeds=(113, 114))
    bob = run(engine, prompt, cache_salt="bob")
    assert bob[3].reuse.disk_tokens == 0 and bob[3].reuse.prefix_tokens == 0
    evict_with_others(engine, seeds=(115, 116))
    alice = run(engine, prompt, cache_salt="alice")
    assert alice[3].reuse.disk_tokens == 128
    assert alice[0] == bob[0]
    engine.close()


def test_a_restart_on_the_same_directory_resumes_the_next_turn(model_dir, tmp_path):
    """After a restart the next turn (previous prompt + reply + more) resumes from the state at
    the previous request's end, read from the tier."""
    prompt = ids(PROMPT, 9)
    first = tiered(model_dir, tmp_path / "tier", num_slots=4096)
    tokens = run(first, prompt)[0]
    first.close()
    restarted = tiered(model_dir, tmp_path / "tier", num_slots=4096)
    assert restarted.cache.tier.stats().entries == 4
    next_turn = prompt + tokens + ids(20, 10)
    hit = run(restarted, next_turn)
    kv_len = PROMPT + MAX_TOKENS - 1
    assert hit[3].reuse.disk_tokens == kv_len and hit[3].state_reuse.checkpoint_depth == kv_len
    assert_same(hit, cold(model_dir, next_turn))
    restarted.close()


def test_a_named_hybrid_session_comes_back_after_a_restart_and_relocates(model_dir, tmp_path):
    """A session named by its client is written with its states after the split (here the state
    at its end); after a restart its next turn, with a message removed, restores it from the tier
    and relocates from it exactly as an engine that never restarted does."""
    prompt = ids(PROMPT, 17)
    first = tiered(model_dir, tmp_path / "tier", reuse=SCR, num_slots=4096)
    tokens = run(first, prompt, session_id="chat-1")[0]
    first.close()
    edited = prompt[:70] + prompt[90:] + tokens + ids(20, 18)    # tokens 70..89 removed
    restarted = tiered(model_dir, tmp_path / "tier", reuse=SCR, num_slots=4096)
    assert restarted.cache.tier.stats().entries == 5               # 4 exact + the session's
    hit = run(restarted, edited, session_id="chat-1")
    assert restarted.reuse.sessions_restored == 1
    assert hit[3].reuse.session == "matched" and hit[3].reuse.relocated_tokens > 0
    assert hit[3].reuse.disk_tokens == 64 and hit[3].state_reuse.loaded_from
    restarted.close()
    control = tiered(model_dir, tmp_path / "control", reuse=SCR, num_slots=4096)
    run(control, prompt, session_id="chat-1")
    kept = run(control, edited, session_id="chat-1")
    assert kept[3].reuse == dataclasses.replace(hit[3].reuse, disk_tokens=0)     # the same plan
    assert hit[3].state_reuse.loaded_from == kept[3].state_reuse.loaded_from
    assert_same(hit, kept, atol=0.0)
    control.close()


def test_a_relocated_hybrid_session_comes_back_with_its_own_states(model_dir, tmp_path):
    """A session whose last turn relocated holds private K/V and approximate states of its own:
    both go to its entry, and after a restart the next turn equals that of an engine that kept it."""
    prompt = ids(PROMPT, 21)
    turns = []

    def conversation(engine):
        tokens = run(engine, prompt, session_id="chat-2")[0]
        turn2 = prompt[:70] + prompt[90:] + tokens + ids(12, 22)
        reply = run(engine, turn2, session_id="chat-2")
        assert reply[3].reuse.relocated_tokens > 0
        turns.append(turn2 + reply[0] + ids(15, 23))

    kept_engine = tiered(model_dir, tmp_path / "control", reuse=SCR, num_slots=4096)
    conversation(kept_engine)
    [session] = kept_engine.reuse.sessions.sessions()
    assert session.payload.states and session.payload.private_slots.numel()
    kept = run(kept_engine, turns[0], session_id="chat-2")
    kept_engine.close()
    first = tiered(model_dir, tmp_path / "tier", reuse=SCR, num_slots=4096)
    conversation(first)
    first.close()
    restarted = tiered(model_dir, tmp_path / "tier", reuse=SCR, num_slots=4096)
    hit = run(restarted, turns[1], session_id="chat-2")
    assert restarted.reuse.sessions_restored == 1 and hit[3].reuse.session == "matched"
    assert kept[3].reuse == dataclasses.replace(hit[3].reuse, disk_tokens=kept[3].reuse.disk_tokens)
    assert hit[3].state_reuse == kept[3].state_reuse
    assert_same(hit, kept, atol=0.0)
    restarted.close()


def test_a_hybrid_session_entry_without_its_end_state_is_not_restored(model_dir, tmp_path):
    """A session entry whose states lack the one at its end cannot be resumed from: the session
    is not restored and the next turn goes the exact prefix path."""
    prompt = ids(PROMPT, 19)
    first = tiered(model_dir, tmp_path / "tier", reuse=SCR, num_slots=4096)
    tokens = run(first, prompt, session_id="chat-1")[0]
    tier = first.cache.tier
    tier.wait_writes()
    key = EntryKey.for_session(namespace_name(NAMESPACE), "chat-1")
    entry = tier.get(key, session_id="chat-1")
    assert entry is not None and sorted(entry.states) == [f"{PROMPT + MAX_TOKENS - 1}.{n}" for n in ("conv", "rec")]
    assert tier.put(TierEntry(key, entry.token_ids.clone(), entry.start_pos, entry.kv.clone(), exact=False,
                              session_id="chat-1"))               # replaces it
    first.close()
    restarted = tiered(model_dir, tmp_path / "tier", reuse=SCR, num_slots=4096)
    next_turn = prompt + tokens + ids(20, 20)
    hit = run(restarted, next_turn, session_id="chat-1")
    assert restarted.reuse.sessions_restored == 0 and hit[3].reuse.session == "new"
    assert hit[3].reuse.disk_tokens == PROMPT + MAX_TOKENS - 1       # the exact entries serve it
    assert_same(hit, cold(model_dir, next_turn))
    restarted.close()


def test_admission_never_drops_the_checkpoint_it_resumes_from():
    """With no state slot free, making room for a request's working state may drop the tree's
    least useful checkpoint, but never the one the request is to copy (a loaded one may be the
    only one): the request waits instead of resuming from zeros."""
    lin = LinearAttnConfig("qwen3_5", conv_kernel=4, num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=6)
    pool, states = KVPool(32, 1, 2, 4), StatePool(2, 1, lin)
    cache = CacheManager(pool, states=states)
    prompt = list(range(10))
    cache.radix.insert(prompt, pool.allocator.alloc(10), NAMESPACE)
    saved = states.alloc_one()
    states.rec[:, saved].fill_(1.0)
    cache.radix.set_checkpoint(cache.radix.match_prefix(prompt, NAMESPACE).node, saved)
    busy = states.alloc_one()                     # another request's working state: none free
    req = Req("r", prompt + [10, 11], SamplingParams(max_tokens=1))
    match = cache.match(req)
    assert match.length == 10
    assert not cache.admit_state(req, match)
    assert cache.radix.num_checkpoints() == 1 and req.state_slot is None
    states.free([busy])
    assert cache.admit_state(req, match)
    assert torch.equal(states.rec[:, req.state_slot], states.rec[:, saved])
