"""Selective recompute inside the engine, on a tiny random 4-layer model: the scoring pass makes the
layers it runs exact, the selection follows the true deviation, recomputing everything is a full
recompute, the counters add up, chunked scoring changes nothing, hybrids refuse it."""

from __future__ import annotations

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.engine.request import Namespace
from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.recompute import kv_deviation, relocated_offsets
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


def first_step(llm, session_id="c"):
    """Turn 1, then admit turn 2 and run one step (admission + scoring pass); returns the request."""
    llm.generate([TURN1], GREEDY, session_id=session_id)
    engine = llm.engine
    rid = engine.add_request(TURN2, GREEDY, session_id=session_id, keep_last_logits=8)
    engine.step()
    return engine._reqs[rid]


def finish(llm):
    while llm.engine.has_work():
        llm.engine.step()


def test_scoring_pass_makes_its_layers_exact_and_selects_by_deviation(model_dir):
    """After the scoring pass (depth 2), the relocated tokens' K/V in layers 0..2 are a cold run's;
    layer 3 still holds the relocated K/V; the chosen tokens are the top deviations at layer 2."""
    k_exact, v_exact, _ = exact_kv(model_dir, TURN2)
    control = make_llm(model_dir)
    req = first_step(control)
    relocated = torch.tensor(relocated_offsets(req.scr.plan))
    pool = control.engine.cache.pool
    k_old, v_old = pool.k[:, req.seq_slots[relocated]].clone(), pool.v[:, req.seq_slots[relocated]].clone()
    finish(control)

    llm = make_llm(model_dir, recompute=0.1, recompute_policy="deviation", score_layers=2)
    req = first_step(llm)
    assert req.scoring is None and req.scr.scoring.done
    slots = req.seq_slots[relocated]
    pool = llm.engine.cache.pool
    for layer in range(3):
        torch.testing.assert_close(pool.k[layer, slots], k_exact[layer, relocated], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pool.v[layer, slots], v_exact[layer, relocated], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool.k[3, slots], k_old[3])
    deviation = kv_deviation(k_exact[2, relocated], v_exact[2, relocated], k_old[2], v_old[2])
    count = round(0.1 * len(relocated))
    expected = sorted(relocated[deviation.topk(count).indices].tolist())
    assert list(req.scr.plan.recomputed) == expected
    assert set(expected) <= set(req.pending)
    finish(llm)
    llm.engine.check_integrity()


@pytest.mark.parametrize("policy, seams", [("deviation", 0), ("heads", 0), ("heads", 4096)])
def test_recomputing_every_relocated_token_is_a_full_recompute(model_dir, policy, seams):
    """recompute=1 (or seams longer than every span): every token after the prefix is computed in
    one forward, so the logits are a cold run's and the whole prompt is exact (it enters the
    radix tree)."""
    _, _, cold = exact_kv(model_dir, TURN2)
    llm = make_llm(model_dir, recompute=0.0 if seams else 1.0, recompute_policy=policy, seam_tokens=seams)
    llm.generate([TURN1], GREEDY, session_id="c")
    out = llm.generate([TURN2], GREEDY, session_id="c", keep_last_logits=8)[0]
    stats = out.reuse
    stats.check(len(TURN2))
    assert stats.relocated_tokens == 0 and stats.recomputed > 0 and stats.relocated_spans > 0
    assert (stats.scored_tokens > 0) == (policy == "deviation" and not seams)
    for offset, logits in cold.prompt_logits.items():
        torch.testing.assert_close(out.prompt_logits[offset], logits, atol=1e-4, rtol=1e-4)
    assert out.token_ids == cold.token_ids
    hit = llm.engine.cache.radix.match_prefix(TURN2, Namespace(None, None))
    assert hit.length == len(TURN2)


def test_counters_move_recomputed_tokens_from_relocated_to_prefilled(model_dir):
    plain = make_llm(model_dir)
    plain.generate([TURN1], GREEDY, session_id="c")
    base = plain.generate([TURN2], GREEDY, session_id="c")[0].reuse
    llm = make_llm(model_dir, recompute=0.2, recompute_policy="deviation")
    llm.generate([TURN1], GREEDY, session_id="c")
    stats = llm.generate([TURN2], GREEDY, session_id="c")[0].reuse
    stats.check(len(TURN2))
    assert stats.recomputed == round(0.2 * base.relocated_tokens)
    assert stats.relocated_tokens == base.relocated_tokens - stats.recomputed
    assert stats.prefilled_tokens == base.prefilled_tokens + stats.recomputed
    assert stats.relocated_spans == base.relocated_spans
    assert stats.scored_tokens >= base.relocated_tokens
    scoring = llm.engine.reuse.flops.scoring_flops(range(len(SYSTEM), len(SYSTEM) + stats.scored_tokens), 1)
    assert stats.prefill_flops > base.prefill_flops + scoring      # scoring, and the recomputed tokens
    assert llm.engine.counters.relocated_tokens == stats.relocated_tokens
    llm.engine.check_integrity()


def test_seams_and_a_share_add_up(model_dir):
    """seam_tokens recomputes the first tokens of every span; the policy's share comes on top."""
    llm = make_llm(model_dir, seam_tokens=3, recompute=0.05)
    req = first_step(llm)
    plan = req.scr.plan
    heads = {o for keep in plan.keeps for o in range(keep.dst_pos, keep.dst_pos + 3)}
    relocated = sum(keep.length for keep in plan.keeps)
    assert heads <= set(plan.recomputed)
    assert len(plan.recomputed) == len(heads) + round(0.05 * relocated)
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


def test_chunked_scoring_chooses_the_same_tokens(model_dir):
    """A scoring pass cut into chunks by a small step budget chooses what one chunk would."""
    whole = make_llm(model_dir, recompute=0.1, recompute_policy="deviation")
    chosen = first_step(whole).scr.plan.recomputed
    finish(whole)
    chunked = LLM(engine=build_engine(EngineConfig(model=model_dir, max_batch_tokens=16,
                                                   reuse=BASE.replace(recompute=0.1, recompute_policy="deviation"))))
    req = first_step(chunked)
    assert req.scoring is not None                  # 16 full tokens' worth = 64 rows at 1 of 4 layers
    finish(chunked)
    assert req.scr.plan.recomputed == chosen
    req.reuse.check(len(TURN2))
    chunked.engine.check_integrity()


def test_recompute_setting_is_range_checked(model_dir):
    llm = make_llm(model_dir)
    for bad in ({"recompute": 1.5}, {"recompute": -0.1}, {"recompute_policy": "best"}, {"score_layers": 9},
                {"recompute": True}, {"seam_tokens": -1}, {"seam_tokens": 5000}, {"removed_seam_tokens": -1},
                {"removed_seam_tokens": 4097}, {"removed_seam_tokens": 1.5}):
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
        seam_tokens=8, recompute=0.1, checkpoint_policy="every:16"))))
    for field in ("recompute", "seam_tokens", "removed_seam_tokens"):
        with pytest.raises(ValueError, match=f"scr.{field}"):
            llm.generate([TURN1], GREEDY, scr={field: 0.1 if field == "recompute" else 4})
    llm.generate([TURN1], GREEDY, session_id="h")
    out = llm.generate([TURN2], GREEDY, session_id="h")[0]
    assert out.reuse.relocated_tokens > 0 and out.reuse.recomputed == 0 and out.reuse.scored_tokens == 0
    out.reuse.check(len(TURN2))
    llm.engine.check_integrity()


def test_overlap_recomputes_the_relocated_tokens_that_match_removed_text(model_dir):
    """TOOL_RESULT is removed in turn 2: with the share at 1, "overlap" recomputes exactly the
    relocated tokens whose token occurs in removed text before their span (no others, no scoring
    pass), and the counters say so."""
    llm = make_llm(model_dir, recompute=1.0, recompute_policy="overlap")
    req = first_step(llm)
    plan = req.scr.plan
    assert plan.removed_spans
    expected = []
    for keep in plan.keeps:
        gone = {TURN1[o] for start, end in plan.removed_spans if end <= keep.src_pos for o in range(start, end)}
        expected += [o for o in range(keep.dst_pos, keep.dst_end) if TURN2[o] in gone]
    assert 0 < len(expected) < sum(keep.length for keep in plan.keeps)
    assert list(plan.recomputed) == expected and req.scr.scoring is None
    finish(llm)
    stats = req.reuse
    stats.check(len(TURN2))
    assert stats.recomputed == len(expected) and stats.scored_tokens == 0
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
