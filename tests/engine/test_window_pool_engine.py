"""The engine on a sliding-window model keeps sliding layers' K/V only within the windows it still
needs (kvsplice.cache.window_pool): against the all-full layout (the reference Decoder over a plain
KVPool, every layer for every token), fp32, on a random tiny Gemma 3 with a window of 8 and prompts
of many windows. Also the prefix hit after a finished request, an SCR edit, and freeing."""

from __future__ import annotations

import pytest
import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.window_pool import WindowedKVPool
from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.layers.forward_batch import ForwardBatch
from kvsplice.models.config import ModelConfig
from kvsplice.models.decoder import Decoder
from kvsplice.models.loader import load_checkpoint
from kvsplice.reuse.config import ReuseConfig
from kvsplice.sampling_params import SamplingParams
from tests.models.test_gemma3 import WINDOW, _tiny_dir
from tests.tiny_model import make_tokenizer_files

SCR = ReuseConfig(match_min_tokens=16, min_span=8, tail=4, max_spans=6)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_window")
    _tiny_dir(path, make_tokenizer_files(path))
    return path


@pytest.fixture(scope="module")
def full_layout(tiny_path):
    """The reference Decoder (fp32) and a function: token ids -> log-softmax of every position,
    over a plain KVPool (every layer holds every token)."""
    ckpt = load_checkpoint(str(tiny_path))
    cfg = ModelConfig.from_hf_config(ckpt.hf_config)
    model = Decoder.from_config(cfg)
    model.load_hf_state_dict(ckpt.state_dict)

    def logprobs(ids: list[int]) -> torch.Tensor:
        n = len(ids)
        pool = KVPool(n, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim)
        slots = torch.arange(n)
        batch = ForwardBatch.single(torch.tensor(ids), torch.arange(n), slots, slots, torch.arange(n), all_logits=True)
        with torch.no_grad():
            return torch.log_softmax(model(batch, pool).float(), dim=-1)
    return logprobs


def _llm(path, **kwargs) -> LLM:
    kwargs.setdefault("reuse", SCR)
    kwargs.setdefault("max_batch_tokens", 16)
    return LLM(engine=build_engine(EngineConfig(model=str(path), **kwargs)))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_matches_full_layout(out, prompt: list[int], full_layout) -> None:
    """Greedy tokens and their logprobs equal the all-full layout's argmax and logprobs."""
    reference = full_layout(prompt + out.token_ids)
    for step, token in enumerate(out.token_ids):
        row = reference[len(prompt) - 1 + step]
        assert token == int(row.argmax())
        assert abs(out.logprobs[step].logprob - float(row[token])) <= TOL


def test_sliding_model_gets_the_windowed_pool(tiny_path):
    pool = _llm(tiny_path).engine.cache.pool
    assert isinstance(pool, WindowedKVPool) and pool.window == WINDOW
    assert pool.window_slots < pool.num_slots


def test_long_prompt_greedy_and_prompt_logprobs_equal_the_full_layout(tiny_path, full_layout):
    """A prompt of 15 windows, chunked by 2 windows: greedy text, its logprobs and every prompt
    logprob as with every layer full; meanwhile the request never held more than its windows."""
    prompt = _ids(120, 1)
    llm = _llm(tiny_path)
    out = llm.generate([prompt], GREEDY)[0]
    _assert_matches_full_layout(out, prompt, full_layout)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = llm.generate([prompt], params)[0]
    reference = full_layout(prompt)
    for offset in range(1, len(prompt)):
        expected = float(reference[offset - 1, prompt[offset]])
        assert abs(scored.prompt_logprobs[offset].logprob - expected) <= TOL
    pool = llm.engine.cache.pool
    # the cache keeps the two finished sequences' tails (2 W each); the rest of 120+ tokens is spare
    assert pool.window_allocator.num_used - pool.spare_windows() <= 2 * (2 * WINDOW)
    llm.engine.check_integrity()


def test_batched_decode_over_arena_rings_equals_the_full_layout(tiny_path, full_layout):
    """A prompt shorter than the window decodes next to a long one: the arena keeps the sliding
    layers as rings of W columns (masked per row by min(length, W)), the full layers whole."""
    llm = _llm(tiny_path, max_batch_tokens=128)   # both prefill in one step, then decode together
    arena = llm.engine.runner.arena
    assert arena.ring_width == WINDOW and arena.ring_layers == llm.engine.cache.pool.sliding_layers
    prompts = [_ids(3, 11), _ids(70, 12)]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        _assert_matches_full_layout(out, prompt, full_layout)


def test_peak_window_use_of_a_running_request_is_bounded(tiny_path):
    """While a long prompt prefills, the sliding K/V it still needs never exceeds tail_keep + one
    chunk; the rest is spare (a cache given back when room runs short)."""
    llm = _llm(tiny_path, prefix_cache=False)
    engine = llm.engine
    engine.add_request(_ids(160, 2), GREEDY)
    peak = 0
    while engine.has_work():
        engine.step()
        pool = engine.cache.pool
        peak = max(peak, pool.window_allocator.num_used - pool.spare_windows())
    assert peak <= 2 * WINDOW + 16
    assert engine.cache.pool.window_allocator.num_used == 0   # nothing cached: every window given back


def test_spare_windows_are_given_back_when_room_runs_short(tiny_path, full_layout):
    """Window slots for about two running requests: long prompts one after another fill them with
    spare windows, which are given back (oldest first) for the next chunks, so every prompt is
    served, equal to the full layout, and the pool stays consistent."""
    llm = _llm(tiny_path, num_slots=600, max_running=1)
    pool = llm.engine.cache.pool
    for seed in range(5):
        prompt = _ids(150, 40 + seed)
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=0,
                                                    ignore_eos=True))[0]
        _assert_matches_full_layout(out, prompt, full_layout)
        llm.engine.check_integrity()
    # 5 x 150 tokens were computed, far more than the window slots: spare ones were given back
    assert pool.window_slots < 5 * 150 and pool.window_allocator.num_used <= pool.window_slots


def test_a_request_that_can_never_get_window_slots_fails_instead_of_the_engine_spinning(tiny_path):
    """Every window slot carried by a locked radix path (windows that are neither spare nor evictable:
    the path is locked, as the fidelity harness locks turn 1, and held by an SCR session) and nothing
    else running: the next request's chunk can never get a window. It fails with the reason, the
    engine stays consistent and goes on once room is back."""
    from kvsplice.bench.fidelity import NO_NAMESPACE
    from kvsplice.engine.engine import RequestFailedError

    # the default window pool holds one max_model_len sequence and a working set: two locked
    # paths of that length carry more windows than it has
    llm = _llm(tiny_path, num_slots=400, max_running=1, max_model_len=100)
    engine, pool = llm.engine, llm.engine.cache.pool
    nodes, paths = [], []
    for seed in (7, 9):
        held = _ids(99, seed)
        llm.generate([held], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        nodes.append(engine.cache.radix.match_prefix(held, NO_NAMESPACE).node)
        engine.cache.radix.lock(nodes[-1])
        paths.append(engine.cache.radix.match_prefix(held, NO_NAMESPACE).slots)
    path = torch.cat(paths)
    assert path.numel() > pool.window_slots
    pool.drop_spare(pool.window_slots, torch.zeros(pool.num_slots, dtype=torch.bool))
    lacking = path[~pool.has_window[path]][: pool.window_allocator.num_free]
    assert pool.ensure_window(lacking) and pool.window_allocator.num_free == 0   # all on the locked paths
    with pytest.raises(RequestFailedError, match="window slots"):   # raised: the engine did not spin
        llm.generate([_ids(40, 8)], GREEDY)
    engine.check_integrity()
    for node in nodes:
        engine.cache.radix.unlock(node)
    engine.flush_cache()   # the SCR sessions of the held prompts (which also hold their paths) go too
    again = llm.generate([_ids(40, 8)], GREEDY)[0]
    assert again.finish_reason == "length"


def test_prefix_hit_after_a_finished_request_is_exact(tiny_path, full_layout):
    """The next turn appends to a finished request: it hits the whole previous sequence (its tail
    windows are kept), and equals the full layout. A prompt that diverges far before the end is
    cut back to a point whose window is held (the start here), and is exact too."""
    llm = _llm(tiny_path)
    turn1 = _ids(90, 3)
    first = llm.generate([turn1], GREEDY)[0]
    appended = turn1 + first.token_ids + _ids(10, 4)
    nxt = llm.generate([appended], GREEDY)[0]
    assert nxt.reuse.prefix_tokens >= len(turn1) + len(first.token_ids) - 1
    _assert_matches_full_layout(nxt, appended, full_layout)
    diverged = turn1[:50] + _ids(20, 5)
    cut = llm.generate([diverged], GREEDY)[0]
    assert cut.reuse.prefix_tokens < 50 - WINDOW + 1 or cut.reuse.prefix_tokens == 50
    _assert_matches_full_layout(cut, diverged, full_layout)
    llm.engine.check_integrity()


def test_scr_edit_on_a_sliding_model_stays_within_the_relocation_bound(tiny_path):
    """An edit in the middle of a long transcript: SCR relocates the full layers' K/V of the spans,
    the sliding layers' only inside the windows of what is computed (or computes them where the old
    window is gone). Its first token's distribution is as close to exact recompute as relocation
    on the plain layout's layer 0 allows; accounting holds; nothing leaks."""
    system, notes, tail = _ids(24, 6), _ids(64, 7), _ids(40, 8)
    turn1 = system + _ids(24, 9) + notes + tail
    turn2 = system + _ids(8, 10) + notes + tail
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=20, ignore_eos=True)
    llm = _llm(tiny_path)
    llm.generate([turn1], params, session_id="w1")
    out = llm.generate([turn2], params, session_id="w1")[0]
    stats = out.reuse
    assert stats.session == "matched" and stats.relocated_tokens > 0
    stats.check(len(turn2))
    # by layer type: the sliding layers moved only what a computed token's window reads (fewer than
    # the full layers: 64 notes + 40 tail tokens are relocated, the windows are 8 wide)
    assert 0 < stats.window_relocated < stats.relocated_tokens
    assert stats.window_recomputed == 0   # with room, turn 1's windows were kept (spare), none is computed
    assert llm.engine.counters.window_relocated == stats.window_relocated
    assert llm.engine.counters.window_recomputed == stats.window_recomputed
    exact = _llm(tiny_path, prefix_cache=False).generate([turn2], params)[0]
    # the bound: the same edit with keys left unturned (the NO_REROTATE control) is further off
    control = _llm(tiny_path, reuse=SCR.replace(no_rerotate=True))
    control.generate([turn1], params, session_id="w1")
    unturned = control.generate([turn2], params, session_id="w1")[0]
    assert unturned.reuse.relocated_tokens == stats.relocated_tokens
    assert out.token_ids[0] == exact.token_ids[0]
    assert _top_error(out, exact) < _top_error(unturned, exact)
    llm.engine.check_integrity()
    llm.engine.flush_cache()
    pool = llm.engine.cache.pool
    assert pool.allocator.num_free == pool.num_slots
    assert pool.window_allocator.num_free == pool.window_slots
    llm.engine.check_integrity()


def _top_error(out, exact) -> float:
    """Mean |logprob difference| of the first token over the exact run's top tokens."""
    ours = dict(out.logprobs[0].top)
    pairs = [(ours[token], lp) for token, lp in exact.logprobs[0].top if token in ours]
    assert pairs
    return sum(abs(a - b) for a, b in pairs) / len(pairs)


def test_nothing_leaks_after_requests_end_and_the_cache_is_flushed(tiny_path):
    llm = _llm(tiny_path, num_slots=600)
    engine = llm.engine
    pool = engine.cache.pool
    free_full, free_window = pool.allocator.num_free, pool.window_allocator.num_free
    for seed in range(4):
        llm.generate([_ids(70 + 10 * seed, 20 + seed)], GREEDY, session_id=f"s{seed % 2}")
        engine.check_integrity()
    rid = engine.add_request(_ids(100, 30), GREEDY)
    engine.step()
    engine.abort(rid)
    while engine.has_work():
        engine.step()
    engine.flush_cache()
    assert (pool.allocator.num_free, pool.window_allocator.num_free) == (free_full, free_window)
    engine.check_integrity()
