"""Hybrid models (Gated DeltaNet + gated attention) served by the engine: logits equal
transformers', prefix hits resume from radix state checkpoints exactly, SCR on a hybrid is exact
for no-edit and append and reports its state mode on edits; state slots never leak."""

from __future__ import annotations

import json

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import build_engine
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams

SCR = ReuseConfig(match_min_tokens=16, min_span=8, tail=2, max_spans=6, checkpoint_policy="every:16")
NO_SCR = SCR.replace(enabled=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from models.test_hybrid import hf_tiny
    from tiny_model import make_tokenizer_files

    path = tmp_path_factory.mktemp("tiny-hybrid")
    vocab = make_tokenizer_files(path)
    eos_id = json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    hf = hf_tiny("qwen3_5_text", seed=7, vocab_size=vocab, eos_token_id=eos_id)
    hf.save_pretrained(path, safe_serialization=True)
    return str(path)


def engine_for(model_dir, reuse=NO_SCR, **kwargs):
    return build_engine(EngineConfig(model=model_dir, reuse=reuse, **kwargs))


def run(engine, prompt, max_tokens=6, **kwargs):
    """Serve one request to the end; (token ids, chosen-token logprobs, final output)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    rid = engine.add_request(prompt, params, **kwargs)
    tokens, lps, last = [], [], None
    while engine.has_work():
        for out in engine.step():
            if out.rid == rid:
                tokens += out.new_token_ids
                lps += [lp.logprob for lp in out.logprobs]
                last = out
    engine.check_integrity()
    return tokens, lps, last


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_same(a, b, atol=1e-4):
    assert a[0] == b[0]
    assert max(abs(x - y) for x, y in zip(a[1], b[1])) <= atol


def test_engine_matches_transformers(model_dir):
    """Prefill of 64 tokens and 16 decode steps through the engine: logits equal transformers'."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = ids(64, 1)
    engine = engine_for(model_dir)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1, ignore_eos=True)
    rid = engine.add_request(prompt, params, keep_last_logits=64)
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.rid == rid]
    tokens = [t for o in outs for t in o.new_token_ids]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    prefill = torch.stack([outs[0].prompt_logits[o] for o in range(64)])
    assert (prefill - logits[:64]).abs().max() <= 1e-4
    expected = torch.log_softmax(logits[63:79], -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    got = torch.tensor([lp.logprob for o in outs for lp in o.logprobs])
    assert (got - expected).abs().max() <= 1e-4
    assert tokens == logits[63:79].argmax(-1).tolist()


def test_prefix_hit_resumes_from_checkpoint(model_dir):
    """A second request sharing 40 tokens resumes from the checkpoint at 32 (every 16 tokens),
    not 40: that is its hit length, and its logits equal a cold run's."""
    first, second = ids(50, 2), ids(40, 2) + ids(20, 3)
    engine = engine_for(model_dir)
    run(engine, first)
    assert engine.cache.radix.num_checkpoints() == 4          # 16, 32, 48 and the request end
    hit = run(engine, second)
    state = hit[2].state_reuse
    assert (state.radix_match, state.checkpoint_depth) == (40, 32)
    assert hit[2].reuse.prefix_tokens == 32
    cold = run(engine_for(model_dir, prefix_cache=False), second)
    assert_same(hit, cold)


def test_append_resumes_from_request_end(model_dir):
    """The next turn (previous sequence + more) resumes from the end-of-request checkpoint."""
    engine = engine_for(model_dir)
    prompt = ids(30, 4)
    tokens, _, _ = run(engine, prompt)
    turn2 = prompt + tokens + ids(9, 5)
    hit = run(engine, turn2)
    assert hit[2].state_reuse.checkpoint_depth == len(prompt) + len(tokens) - 1
    assert_same(hit, run(engine_for(model_dir, prefix_cache=False), turn2))


def test_batching_chunking_preemption_change_nothing(model_dir):
    prompts = [ids(20 + 9 * i, 10 + i) for i in range(4)]
    alone = [run(engine_for(model_dir, prefix_cache=False), p) for p in prompts]
    engine = engine_for(model_dir, max_batch_tokens=16, num_slots=120)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    got = {rid: ([], []) for rid in rids}
    while engine.has_work():
        for out in engine.step():
            got[out.rid][0].extend(out.new_token_ids)
            got[out.rid][1].extend(lp.logprob for lp in out.logprobs)
    for rid, expected in zip(rids, alone):
        assert_same(got[rid], expected)
    engine.check_integrity()
    engine.flush_cache()
    assert engine.cache.states.allocator.num_free == engine.cache.states.num_slots


SYSTEM, TOOL, NOTES, TAIL = ids(24, 20), ids(30, 21), ids(48, 22), ids(20, 23)
TURN1 = SYSTEM + TOOL + NOTES + TAIL
TURN2 = SYSTEM + ids(6, 24) + NOTES + TAIL + ids(5, 25)


def test_scr_no_edit_and_append_are_exact(model_dir):
    engine = engine_for(model_dir, reuse=SCR)
    first = run(engine, TURN1, session_id="s1")
    again = run(engine, TURN1, session_id="s1")
    assert_same(again, run(engine_for(model_dir, prefix_cache=False), TURN1))
    appended = TURN1 + again[0] + ids(7, 26)
    nxt = run(engine, appended, session_id="s1")
    assert nxt[2].reuse.relocated_tokens == 0 and first[2].reuse.relocated_tokens == 0
    assert_same(nxt, run(engine_for(model_dir, prefix_cache=False), appended))


@pytest.mark.parametrize("mode", ["fork", "checkpoint", "none"])
def test_scr_edit_relocates_and_reports_state_mode(model_dir, mode):
    engine = engine_for(model_dir, reuse=SCR.replace(state_mode=mode))
    run(engine, TURN1, session_id="s2")
    edited = run(engine, TURN2, session_id="s2")
    stats, state = edited[2].reuse, edited[2].state_reuse
    assert stats.relocated_spans >= 1 and stats.relocated_tokens > 0
    assert stats.prefix_tokens == 16          # SYSTEM is 24 tokens; the checkpoint below it is at 16
    assert state.mode == mode and state.splices >= 1
    if mode == "fork":
        assert all(src == len(TURN1) + 5 for src in state.loaded_from)
    elif mode == "checkpoint":
        assert all(src is not None and src % 16 == 0 for src in state.loaded_from)
    else:
        assert state.loaded_from == (None,) * state.splices
    # the approximate answer still runs to the end, and a no-edit repeat afterwards is exact again
    assert len(edited[0]) == 6
    engine.check_integrity()
    engine.reuse.drop_idle_sessions()
    engine.flush_cache()
    assert engine.cache.states.allocator.num_free == engine.cache.states.num_slots


def test_fidelity_hybrid_harness_runs_every_mode(model_dir):
    """The harness runs SCR off and each state mode on one short case; SCR off is exact."""
    from kvsplice.bench.edit_cases import REPLY_PLACEHOLDER, EditCase
    from kvsplice.bench.fidelity_hybrid import fidelity_hybrid

    doc = " ".join(["the robot reads documentation and the fox jumps over the lazy dog"] * 4)
    note = "agents edit their own context and rewrite notes in place " * 5
    turn1 = ({"role": "system", "content": doc}, {"role": "user", "content": "tool result: " + doc},
             {"role": "user", "content": note})
    turn2 = ({"role": "system", "content": doc}, {"role": "user", "content": "deleted"},
             {"role": "user", "content": note}, {"role": "assistant", "content": REPLY_PLACEHOLDER},
             {"role": "user", "content": note})
    report = fidelity_hybrid(model_dir, cases=[EditCase("short", turn1, turn2)], max_spans=4, tail=4,
                             checkpoint_every=16, gen_tokens=4, log=lambda line: None)
    by_setting = {s["setting"]: s for s in report["summaries"]}
    assert set(by_setting) == {"scr off", "fork K=4 tail=4", "checkpoint K=4 tail=4", "none K=4 tail=4"}
    assert by_setting["scr off"]["kl_max"] <= 1e-6
    assert all(s["relocated_tokens"] > 0 for name, s in by_setting.items() if name != "scr off")
    assert "fork" in report["table"]
