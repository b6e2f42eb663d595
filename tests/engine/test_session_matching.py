"""Session matching inside the engine, on a tiny random model: edits anywhere find their
conversation without any id among decoys that share the system prompt and tools; an explicit
session id attaches only to a session of the same namespace whose content verifies, and never
lets a request replace another conversation's K/V; every miss says why."""

from __future__ import annotations

import re

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

REUSE = ReuseConfig(min_span=8, tail=4, max_sessions=64)   # default matching settings
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM, TOOLS = ids(200, 1), ids(150, 2)


def conversation(seed: int) -> list[list[int]]:
    """SYSTEM, TOOLS, then four turns of (reasoning block, answer) and a user message."""
    blocks = [SYSTEM, TOOLS]
    for turn in range(4):
        blocks += [ids(40, seed * 10 + turn), ids(80, seed * 10 + turn + 5), ids(30, seed * 10 + turn + 50)]
    return blocks


def flat(blocks):
    return [token for block in blocks for token in block]


THINK = slice(2, None, 3)  # the reasoning blocks of conversation()
EDITS = {
    "token_0": lambda b: [[7] + b[0][1:]] + b[1:],
    "before_1024": lambda b: b[:4] + [ids(20, 901)] + b[5:],
    "stripped_reasoning": lambda b: [block for offset, block in enumerate(b) if offset < 2 or (offset - 2) % 3],
    "moved_message": lambda b: b[:2] + b[5:8] + b[2:5] + b[8:],
    "two_edits": lambda b: b[:3] + [ids(30, 902)] + b[4:9] + b[10:],
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """One engine with 10 decoy conversations sharing the system prompt and the tool list (with the
    conversation under test, more holders than match_max_postings: common content)."""
    from tiny_model import make_tiny_model_dir
    model = LLM(engine=build_engine(EngineConfig(model=str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))),
                                                 reuse=REUSE)))
    for seed in range(100, 110):
        model.generate([flat(conversation(seed)[:5])], PARAMS)
    return model


def run(llm, prompt, **kwargs):
    out = llm.generate([prompt], PARAMS, **kwargs)[0]
    out.reuse.check(len(prompt))
    return out.reuse


def held_sequences(llm, owner=None):
    """{session id: its sequence} of the sessions of one owner (no cache_salt)."""
    return {session.session_id: list(session.token_ids) for session in llm.engine.reuse.sessions.sessions()
            if session.namespace == (owner, None)}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edits_anywhere_match_without_any_id(llm, edit):
    blocks = conversation(200 + sorted(EDITS).index(edit))
    first = run(llm, flat(blocks))
    assert first.session == "new" and first.fallback == "no_candidate"
    before = held_sequences(llm)
    prompt = flat(EDITS[edit](blocks) + [ids(30, 903)])
    second = run(llm, prompt)
    assert second.session == "matched" and second.fallback is None
    assert second.relocated_tokens > 80
    after = held_sequences(llm)
    # no other conversation's session changed; the previous turn was all exact (no private K/V), so the
    # match forked: a new session holds the new K/V and the old one is left as it was
    assert all(after.get(sid, seq) == seq for sid, seq in before.items())
    assert [seq[:len(prompt)] for sid, seq in after.items() if sid not in before] == [prompt]
    llm.engine.check_integrity()


def named(llm, session_id, owner=None):
    return llm.engine.reuse.sessions.get((owner, None), session_id)


def test_a_known_session_id_gives_another_conversation_nothing(llm):
    victim = conversation(300)
    assert run(llm, flat(victim), session_id="victim").fallback == "new_session"
    victim_session = named(llm, "victim")
    victim_kv = list(victim_session.token_ids)
    # same namespace, the victim's id, a conversation of its own sharing the preamble
    intruder = run(llm, flat(conversation(301)), session_id="victim")
    assert intruder.session == "new" and intruder.fallback == "session_mismatch"
    assert intruder.relocated_tokens == 0
    # another tenant with the same id: a session of its own, nothing relocated
    other_owner = run(llm, flat(EDITS["token_0"](victim)), session_id="victim", owner="tenant-b")
    assert other_owner.fallback == "owner_mismatch" and other_owner.relocated_tokens == 0
    # nobody replaced the victim's K/V (the id now names the intruder's own conversation)
    assert victim_session.token_ids == victim_kv and victim_session in llm.engine.reuse.sessions.sessions()
    assert named(llm, "victim") is not victim_session
    # the victim's own next turn finds its session by content, relocates from it, takes its id back
    prompt = flat(EDITS["two_edits"](victim))
    edited = run(llm, prompt, session_id="victim")
    assert edited.session == "matched" and edited.relocated_tokens > 80
    assert named(llm, "victim").token_ids[:len(prompt)] == prompt
    llm.engine.check_integrity()


def test_reusing_an_id_for_a_new_conversation_gets_a_session_of_its_own(llm):
    old, new = conversation(310), conversation(311)
    run(llm, flat(old), session_id="reused")
    old_session = named(llm, "reused")
    old_kv = list(old_session.token_ids)
    assert run(llm, flat(new), session_id="reused").fallback == "session_mismatch"
    follow_up = run(llm, flat(EDITS["stripped_reasoning"](new)), session_id="reused")
    assert follow_up.session == "matched" and follow_up.relocated_tokens > 80  # the id names it now
    assert old_session.token_ids == old_kv
    assert run(llm, flat(EDITS["moved_message"](old))).relocated_tokens > 80  # still found by content


def test_minted_session_ids_are_unguessable(llm):
    minted = [session.session_id for session in llm.engine.reuse.sessions.sessions() if not session.named]
    assert len(minted) >= 10 and len(set(minted)) == len(minted)
    # 16 random bytes (22 url-safe characters), not the old sequential "s000001" form (a random id
    # may well start with "s0": only the whole sequential pattern is refused)
    assert all(len(sid) >= 22 and not re.fullmatch(r"s\d+", sid) for sid in minted)
