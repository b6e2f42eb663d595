"""Selective recompute inside the engine, on a tiny random 4-layer model: seams and message openings
are recomputed, recomputing everything is a full recompute, the counters add up, hybrids refuse it."""

from __future__ import annotations

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.engine.request import Namespace
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

BASE = ReuseConfig(match_min_tokens=16, min_span=8, tail=4, max_spans=6, seam_tokens=0)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 300, (n,), generator=g).tolist()


SYSTEM, TOOL_RESULT, NOTES, TAIL = ids(40, 1), ids(30, 2), ids(100, 3), ids(60, 4)
TURN1 = SYSTEM + TOOL_RESULT + NOTES + TAIL
TURN2 = SYSTEM + ids(10, 5) + NOTES + ids(20, 8) + TAIL + ids(10, 6)   # two seams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-recompute"), num_hidden_layers=4))


def make_llm(model_dir, **reuse) -> LLM:
    return LLM(engine=build_engine(EngineConfig(model=model_dir, reuse=BASE.replace(**reuse))))


def exact_kv(model_dir, prompt):
    """Every layer's K and V of a cold run of `prompt`, by offset: [layers, len(prompt), heads, dim]."""
    llm = LLM(engine=build_engine(EngineConfig(model=model_dir)))
    cold = llm.generate([prompt], GREEDY, keep_last_logits=8)[0]
    slots = llm.engine.cache.radix.match_prefix(prompt, Namespace(None, None)).slots
    pool = llm.engine.cache.pool
    return pool.k[:, slots].clone(), pool.v[:, slots].clone(), cold


def relocated_offsets(plan) -> list[int]:
    """Every relocated (not recomputed) new offset of `plan`, increasing."""
    recomputed = set(plan.recomputed)
    return [o for keep in plan.keeps for o in range(keep.dst_pos, keep.dst_end) if o not in recomputed]


def first_step(llm, session_id="c"):
    """Turn 1, then admit turn 2 and run one step; returns the request."""
    llm.generate([TURN1], GREEDY, session_id=session_id)
    engine = llm.engine
    rid = engine.add_request(TURN2, GREEDY, session_id=session_id, keep_last_logits=8)
    engine.step()
    return engine._reqs[rid]


def finish(llm):
    while llm.engine.has_work():
        llm.engine.step()


def test_recomputing_every_relocated_token_is_a_full_recompute(model_dir):
    """Seams longer than every span: every token after the prefix is computed in one forward, so
    the logits are a cold run's and the whole prompt is exact (it enters the radix tree)."""
    _, _, cold = exact_kv(model_dir, TURN2)
    llm = make_llm(model_dir, seam_tokens=4096)
    llm.generate([TURN1], GREEDY, session_id="c")
    out = llm.generate([TURN2], GREEDY, session_id="c", keep_last_logits=8)[0]
    stats = out.reuse
    stats.check(len(TURN2))
    assert stats.relocated_tokens == 0 and stats.recomputed > 0 and stats.relocated_spans > 0
    for offset, logits in cold.prompt_logits.items():
        torch.testing.assert_close(out.prompt_logits[offset], logits, atol=1e-4, rtol=1e-4)
    assert out.token_ids == cold.token_ids
    hit = llm.engine.cache.radix.match_prefix(TURN2, Namespace(None, None))
    assert hit.length == len(TURN2)


def test_counters_move_recomputed_tokens_from_relocated_to_prefilled(model_dir):
    plain = make_llm(model_dir)
    plain.generate([TURN1], GREEDY, session_id="c")
    base = plain.generate([TURN2], GREEDY, session_id="c")[0].reuse
    llm = make_llm(model_dir, seam_tokens=5)
    llm.generate([TURN1], GREEDY, session_id="c")
    stats = llm.generate([TURN2], GREEDY, session_id="c")[0].reuse
    stats.check(len(TURN2))
    assert stats.recomputed == 5 * base.relocated_spans
    assert stats.relocated_tokens == base.relocated_tokens - stats.recomputed
    assert stats.prefilled_tokens == base.prefilled_tokens + stats.recomputed
    assert stats.relocated_spans == base.relocated_spans
    assert stats.prefill_flops > base.prefill_flops                # the recomputed tokens
    assert llm.engine.counters.relocated_tokens == stats.relocated_tokens
    llm.engine.check_integrity()


def test_seams_recompute_the_first_tokens_of_every_span(model_dir):
    """seam_tokens recomputes the first tokens of every span, and nothing else."""
    llm = make_llm(model_dir, seam_tokens=3)
    req = first_step(llm)
    plan = req.scr.plan
    heads = {o for keep in plan.keeps for o in range(keep.dst_pos, keep.dst_pos + 3)}
    assert set(plan.recomputed) == heads
    finish(llm)
    req.reuse.check(len(TURN2))
    assert req.reuse.recomputed == len(plan.recomputed)


def test_longer_seams_after_removed_text_only(model_dir):
    """removed_seam_tokens: NOTES follows the removed tool result and gets the longer seam; TAIL
    follows only inserted text and keeps seam_tokens. The counters add up."""
    llm = make_llm(model_dir, seam_tokens=2, removed_seam_tokens=12)
    req = first_step(llm)
    plan = req.scr.plan
    assert len(TOOL_RESULT) - 3 <= plan.removed[0] <= len(TOOL_RESULT) and plan.removed[1] == 0
    notes, tail = plan.keeps
    expected = list(range(notes.dst_pos, notes.dst_pos + 12)) + list(range(tail.dst_pos, tail.dst_pos + 2))
    assert list(plan.recomputed) == expected
    finish(llm)
    req.reuse.check(len(TURN2))
    assert req.reuse.recomputed == 14
    llm.engine.check_integrity()


def test_recompute_setting_is_range_checked(model_dir):
    llm = make_llm(model_dir)
    for bad in ({"seam_tokens": -1}, {"seam_tokens": 5000}, {"seam_tokens": True}, {"removed_seam_tokens": -1},
                {"removed_seam_tokens": 4097}, {"removed_seam_tokens": 1.5}, {"message_start_tokens": 65}):
        with pytest.raises(ValueError):
            llm.generate([TURN1], GREEDY, scr=bad)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    import json

    from models.test_hybrid import hf_tiny
    from tiny_model import make_tokenizer_files

    path = tmp_path_factory.mktemp("tiny-hybrid-recompute")
    vocab = make_tokenizer_files(path)
    eos_id = json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    hf_tiny("qwen3_5_text", seed=7, vocab_size=vocab, eos_token_id=eos_id).save_pretrained(path, safe_serialization=True)
    return str(path)


def test_hybrids_refuse_a_requested_recompute_and_skip_the_server_default(hybrid_dir):
    """Linear-attention layers cannot recompute scattered tokens: a request that asks is refused
    (naming the field); a server-wide setting leaves hybrid requests as they were."""
    llm = LLM(engine=build_engine(EngineConfig(model=hybrid_dir, reuse=BASE.replace(
        seam_tokens=8, checkpoint_policy="every:16"))))
    for field in ("seam_tokens", "removed_seam_tokens", "message_start_tokens"):
        with pytest.raises(ValueError, match=f"scr.{field}"):
            llm.generate([TURN1], GREEDY, scr={field: 4})
    llm.generate([TURN1], GREEDY, session_id="h")
    out = llm.generate([TURN2], GREEDY, session_id="h")[0]
    assert out.reuse.relocated_tokens > 0 and out.reuse.recomputed == 0
    out.reuse.check(len(TURN2))
    llm.engine.check_integrity()


def test_message_openings_inside_relocated_spans_are_recomputed(model_dir):
    """message_start_tokens: the role, line break and first content token of every message that
    lies inside a relocated span are recomputed; 0 turns it off."""
    from kvsplice.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(model_dir)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    role = tokenizer.encode("tool", add_special_tokens=False)
    plain = [t for t in range(5, 300) if not tokenizer.token_str(t).endswith("\n")]

    def content(n, seed):
        g = torch.Generator().manual_seed(seed)
        return [plain[i] for i in torch.randint(0, len(plain), (n,), generator=g).tolist()]

    def message(body):
        return [1, *role, *newline, *body, 2, *newline]

    notes = message(content(50, 3)) + message(content(50, 4))
    turn1 = message(content(40, 1)) + message(content(30, 2)) + notes + message(content(30, 5))
    turn2 = message(content(40, 1)) + notes + message(content(30, 5)) + message(content(10, 6))
    header = len(role) + len(newline) + 1
    opening = len(message(content(40, 1))) + header
    second = opening + len(message(content(50, 3)))
    third = second + len(message(content(50, 4)))                   # the last old message, relocated too
    # the first note's header matches the deleted message's identical header, so it stays in the
    # reused prefix; the later roles and line breaks were relocated and are recomputed with their
    # first token (<|im_start|>, token 1, is special: left alone)
    starts = [opening, *range(second - header + 1, second + 1), *range(third - header + 1, third + 1)]
    for tokens, expected in ((1, starts), (0, [])):
        llm = make_llm(model_dir, message_start_tokens=tokens)
        llm.generate([turn1], GREEDY, session_id="c")
        rid = llm.engine.add_request(turn2, GREEDY, session_id="c")
        llm.engine.step()
        req = llm.engine._reqs[rid]
        inside = [o for o in expected if o in set(relocated_offsets(req.scr.plan)) | set(req.scr.plan.recomputed)]
        assert inside == expected                    # every opening lies in a relocated span
        assert list(req.scr.plan.recomputed) == expected
        finish(llm)
        req.reuse.check(len(turn2))
        assert req.reuse.recomputed == len(expected)
        llm.engine.check_integrity()
