"""Message-boundary state checkpoints on a tiny random hybrid: a prompt that diverges inside message k
resumes from message k's start with a cold run's logits; every checkpoint the radix tree holds is the
exact state of its own path's tokens (property test over random conversations and edits, prefix
caching and SCR); the cap holds; SCR's checkpoint mode loads message-boundary states; the offline
API computes and passes the offsets."""

from __future__ import annotations

import random

import pytest
import torch

from engine import test_hybrid_engine
from engine.test_hybrid_engine import assert_same, engine_for, run
from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.state_pool import StatePool
from kvsplice.engine.llm import LLM
from kvsplice.layers.forward_batch import ForwardBatch, LinearSeq, Segment, SeqSlice
from kvsplice.message_offsets import message_offsets
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

WORDS = ("robot reads documentation fox jumps over lazy dog agents edit their own context delete tool "
         "results rewrite notes place function returns none when nothing found").split()
NO_SCR = ReuseConfig(enabled=False, checkpoint_policy="messages")
SCR = ReuseConfig(match_min_tokens=16, min_span=8, tail=2, max_spans=6, checkpoint_policy="messages")
model_dir = test_hybrid_engine.model_dir  # the tiny hybrid's module-scoped fixture


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def conversation(rng: random.Random, n_messages: int) -> list[dict]:
    roles = ["system"] + [rng.choice(["user", "assistant", "tool"]) for _ in range(n_messages - 1)]
    return [{"role": role, "content": text(rng, rng.randint(4, 14))} for role in roles]


def render(engine, messages):
    """Prompt ids (with the reply opened) and verified message offsets."""
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return ids, message_offsets(engine.tokenizer, messages, ids)


def test_divergence_inside_message_k_resumes_from_its_start(model_dir):
    rng = random.Random(3)
    messages = conversation(rng, 6)
    engine = engine_for(model_dir, reuse=NO_SCR)
    ids, offsets = render(engine, messages)
    assert len(offsets) == 6                          # messages 1..5 and the reply
    run(engine, ids, message_offsets=offsets)
    k = 3
    edited = [dict(m) for m in messages]
    edited[k]["content"] = messages[k]["content"] + " and then something else entirely"
    new_ids, new_offsets = render(engine, edited)
    assert new_offsets[:k] == offsets[:k]
    hit = run(engine, new_ids, message_offsets=new_offsets)
    state = hit[2].state_reuse
    assert state.checkpoint_depth == offsets[k - 1]                 # message k's start
    assert state.radix_match > offsets[k - 1] + 4                   # the match reached into message k
    assert_same(hit, run(engine_for(model_dir, prefix_cache=False), new_ids))


def test_edit_of_the_reply_resumes_from_the_prompt_end(model_dir):
    """The next turn renders its own version of the assistant's reply: it resumes where the reply
    started (the previous prompt's end), not at an earlier message start."""
    rng = random.Random(4)
    messages = conversation(rng, 4)
    engine = engine_for(model_dir, reuse=NO_SCR)
    ids, offsets = render(engine, messages)
    run(engine, ids, message_offsets=offsets)
    turn2 = messages + [{"role": "assistant", "content": "nothing found"}, {"role": "user", "content": text(rng, 6)}]
    new_ids, new_offsets = render(engine, turn2)
    hit = run(engine, new_ids, message_offsets=new_offsets)
    assert hit[2].state_reuse.checkpoint_depth == len(ids)
    assert_same(hit, run(engine_for(model_dir, prefix_cache=False), new_ids))


def path_ids(node) -> list[int]:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return [t for key in reversed(keys) for t in key]


def reference_state(engine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear layers' (conv, recurrent) state after `ids`, computed cold in one segment."""
    cfg = engine.model_config
    pool = KVPool(len(ids), cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim)
    states = StatePool(1, cfg.num_linear_layers, cfg.linear_attn)
    n = len(ids)
    positions = torch.arange(n)
    batch = ForwardBatch(torch.tensor(ids), positions, positions.clone(), (SeqSlice(0, n, positions, positions),),
                         torch.tensor([n - 1]), (LinearSeq(0, (Segment(0, n),)),))
    with torch.inference_mode():
        engine.runner.model(batch, pool, states)
    return states.conv[:, 0], states.rec[:, 0]


def assert_checkpoints_exact(engine, verified: set) -> int:
    """Every checkpoint in the tree is the cold state of its own path (those in `verified`, already
    checked with the same node, path and slot, are skipped); returns how many there are."""
    candidates = engine.cache.radix.checkpoint_candidates()
    assert len(candidates) == engine.cache.radix.num_checkpoints()   # idle: nothing pinned
    for candidate in candidates:
        ids = path_ids(candidate.handle)
        key = (id(candidate.handle), tuple(ids), candidate.handle.state_checkpoint)
        if key in verified:
            continue
        verified.add(key)
        assert len(ids) == candidate.depth
        conv, rec = reference_state(engine, ids)
        slot = candidate.handle.state_checkpoint
        assert torch.allclose(engine.cache.states.conv[:, slot], conv, atol=1e-4, rtol=1e-4)
        assert torch.allclose(engine.cache.states.rec[:, slot], rec, atol=1e-4, rtol=1e-4)
    return len(candidates)


def edit(rng: random.Random, messages: list[dict]) -> list[dict]:
    """One agent-style edit of an earlier message, then an appended message."""
    messages = [dict(m) for m in messages]
    k = rng.randrange(1, len(messages))
    kind = rng.choice(["delete", "rewrite", "extend", "none"])
    if kind == "delete" and len(messages) > 2:
        del messages[k]
    elif kind == "rewrite":
        messages[k]["content"] = text(rng, rng.randint(3, 10))
    elif kind == "extend":
        messages[k]["content"] += " " + text(rng, 3)
    return messages + [{"role": rng.choice(["user", "tool"]), "content": text(rng, rng.randint(4, 12))}]


@pytest.mark.parametrize("seed", [1, 2])
def test_property_checkpoints_hold_exact_states_of_their_path(model_dir, seed):
    """Random conversations, random edits, prefix caching and SCR (state modes drawn at random),
    random policies and a small cap: after every turn, every checkpoint is exact for its path."""
    rng = random.Random(seed)
    policy = rng.choice(["messages", "messages+every:16", "every:16"])
    base = SCR if seed % 2 == 0 else NO_SCR
    reuse = base.replace(checkpoint_policy=policy, checkpoint_max_states=rng.choice([6, 64]))
    engine = engine_for(model_dir, reuse=reuse)
    seen, verified = 0, set()
    for conv in range(2):
        messages = conversation(rng, rng.randint(3, 6))
        for _turn in range(3):
            ids, offsets = render(engine, messages)
            scr = {"state_mode": rng.choice(["fork", "checkpoint", "none"])} if reuse.enabled else None
            tokens, _, _ = run(engine, ids, max_tokens=rng.randint(1, 4), message_offsets=offsets,
                               session_id=f"c{conv}", scr=scr)
            seen = max(seen, assert_checkpoints_exact(engine, verified))
            kept = engine.cache.radix.num_checkpoints() + engine.reuse.private_state_slots()
            assert kept <= reuse.checkpoint_max_states      # the tree's and the sessions' own together
            messages = edit(rng, messages + [{"role": "assistant", "content": engine.tokenizer.decode(tokens)}])
    assert seen >= 3


def test_cap_thins_the_tree(model_dir):
    engine = engine_for(model_dir, reuse=NO_SCR.replace(checkpoint_max_states=3))
    messages = conversation(random.Random(5), 8)
    ids, offsets = render(engine, messages)
    run(engine, ids, message_offsets=offsets)
    radix = engine.cache.radix
    assert radix.num_checkpoints() == 3
    depths = sorted(c.depth for c in radix.checkpoint_candidates())
    assert depths[-1] == len(ids) + 5         # the request's end (6 tokens generated, the last not fed)
    engine.flush_cache()
    assert engine.cache.states.allocator.num_free == engine.cache.states.num_slots


def test_scr_checkpoint_mode_loads_message_boundary_states(model_dir):
    rng = random.Random(6)
    messages = conversation(rng, 7)
    engine = engine_for(model_dir, reuse=SCR)
    ids, offsets = render(engine, messages)
    first = run(engine, ids, message_offsets=offsets, session_id="s")
    turn2 = messages[:1] + messages[2:] + [{"role": "assistant", "content": engine.tokenizer.decode(first[0])},
                                           {"role": "user", "content": text(rng, 5)}]
    new_ids, new_offsets = render(engine, turn2)
    edited = run(engine, new_ids, message_offsets=new_offsets, session_id="s")
    state = edited[2].state_reuse
    assert edited[2].reuse.relocated_tokens > 0 and state.mode == "checkpoint" and state.splices >= 1
    saved = set(offsets) | {len(ids) + 5}
    assert state.loaded_from and all(src in saved for src in state.loaded_from)
    engine.check_integrity()
    engine.reuse.drop_idle_sessions()
    engine.flush_cache()
    assert engine.cache.states.allocator.num_free == engine.cache.states.num_slots


def test_llm_chat_passes_offsets_and_generate_checks_them(model_dir):
    llm = LLM(model=model_dir, reuse=NO_SCR)
    messages = conversation(random.Random(7), 4)
    llm.chat(messages, SamplingParams(max_tokens=2, temperature=0.0))
    ids, offsets = render(llm.engine, messages)
    depths = {c.depth for c in llm.engine.cache.radix.checkpoint_candidates()}
    assert set(offsets) <= depths
    out = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0), message_offsets=offsets)
    assert out[0].state_reuse.checkpoint_depth == offsets[-1]    # the reply's opening (the match stops 1 short)
    with pytest.raises(ValueError, match="message_offsets"):
        llm.generate([ids, ids], message_offsets=offsets)
    with pytest.raises(ValueError, match="message_offsets"):
        llm.generate(ids, message_offsets=[5, 3])


def test_scr_append_after_an_edit_relocates_the_sessions_own_kv(model_dir):
    """After an SCR edit, the session's K/V beyond the radix match is approximate and only the
    session has it. The next turn appends: a hybrid relocates that part in place as a dense model
    does, computing only the cached-but-stateless tokens after its checkpoint, the span tail and the
    appended text."""
    rng = random.Random(8)
    messages = conversation(rng, 7)
    engine = engine_for(model_dir, reuse=SCR)
    ids, offsets = render(engine, messages)
    first = run(engine, ids, message_offsets=offsets, session_id="s")
    turn2 = messages[:1] + messages[2:] + [{"role": "assistant", "content": engine.tokenizer.decode(first[0])}]
    ids2, offsets2 = render(engine, turn2)
    second = run(engine, ids2, message_offsets=offsets2, session_id="s")
    assert second[2].reuse.relocated_tokens > 0
    turn3 = turn2 + [{"role": "assistant", "content": engine.tokenizer.decode(second[0])},
                     {"role": "user", "content": text(rng, 6)}]
    ids3, offsets3 = render(engine, turn3)
    third = run(engine, ids3, message_offsets=offsets3, session_id="s")
    stats, state = third[2].reuse, third[2].state_reuse
    appended = len(ids3) - (len(ids2) + len(second[0]) - 1)
    assert stats.relocated_tokens > 0
    # without relocating in place it would recompute everything after its checkpoint (~240 tokens);
    # 8: the reply re-rendered from text may tokenize differently from the sampled tokens near its end
    assert stats.prefilled_tokens <= (state.radix_match - state.checkpoint_depth) + SCR.tail + appended + 8
