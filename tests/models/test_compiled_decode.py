"""CompiledDecode against the eager fast path on a random tiny model with a GGUF's weights (int4
projections, a Q8_0 lm_head; bf16): one row and several rows over DecodeArena rows of different
lengths, steps that no graph covers, one row's logits from the int8 head, the engine generating
with it, and the set-ups it refuses. One engine compiles the graphs for the
whole module (10-90 s, depending on inductor's on-disk cache)."""

from __future__ import annotations

import pytest
import torch

from kvsplice.cache.decode_arena import DecodeArena
from kvsplice.cache.kv_pool import KVPool
from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.models.fast_decode import FastDecoder
from kvsplice.sampling_params import SamplingParams
from kvsplice.server.metrics import take_snapshot
from kvsplice.utils.thread_policy import intra_op_threads

from tests.models.test_fast_decode import _decode_batches, _model, _prefill, _req


pytestmark = pytest.mark.slow  # the module's engine compiles its graphs first (10-90 s)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_gguf_like_model_dir
    return str(make_gguf_like_model_dir(tmp_path_factory.mktemp("tiny")))


def _engine(model_dir, compile_decode: bool):
    return build_engine(EngineConfig(model=model_dir, dtype="bfloat16", weight_format="auto", num_slots=2048,
                                     compile_decode=compile_decode))


@pytest.fixture(scope="module")
def compiled_engine(model_dir):
    return _engine(model_dir, compile_decode=True)


@pytest.fixture(scope="module")
def decoders(compiled_engine):
    """(model, cfg, eager FastDecoder, compiled FastDecoder) on the same int4 weights."""
    runner = compiled_engine.runner
    formats = runner.weight_format
    return runner.model, runner.model.cfg, FastDecoder(runner.model, formats.projections, formats.lm_head), runner.fast


def _setup(model, cfg, lengths):
    """A pool holding each request's prefilled context, and two arenas (eager, compiled)."""
    pool = KVPool(256, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    arenas = [DecodeArena(cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, max_tokens=4096,
                          min_rows=2) for _ in range(2)]
    free, reqs = torch.randperm(256), []
    for length in lengths:
        slots, free = free[:length], free[length:]
        _prefill(model, pool, torch.randint(0, cfg.vocab_size, (length - 1,)), slots[:-1])
        reqs.append(_req(length, slots))
    return pool, arenas, reqs, free


def _steps(decoders, lengths, steps=3):
    """Run `steps` decode steps of `lengths` rows on both paths; assert they agree each step."""
    model, cfg, eager, compiled = decoders
    pool, (arena_e, arena_c), reqs, free = _setup(model, cfg, lengths)
    pool_c = KVPool(256, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    for step in range(steps):
        pool_c.k.copy_(pool.k), pool_c.v.copy_(pool.v)
        with torch.inference_mode():   # the step's tensors made as the engine makes them
            _, batch = _decode_batches(reqs, torch.randint(0, cfg.vocab_size, (len(reqs),)))
        arena_e.assign(reqs, pool), arena_c.assign(reqs, pool_c)
        expected = eager.forward(batch, pool, arena_e)
        got = compiled.forward(batch, pool_c, arena_c)
        tolerance = 0.05 * expected.abs().max()   # bf16 rounding of the fused kernels' intermediates
        assert (got - expected).abs().max() <= tolerance, step
        chosen = expected.gather(1, got.argmax(dim=-1, keepdim=True))[:, 0]
        assert (chosen >= expected.max(dim=-1).values - 2 * tolerance).all()
        # the same K/V written: into the pool at out_slots, into the arena at (row, position)
        written = batch.out_slots
        torch.testing.assert_close(pool_c.k[:, written], pool.k[:, written], atol=0.05, rtol=0.05)
        torch.testing.assert_close(pool_c.v[:, written], pool.v[:, written], atol=0.05, rtol=0.05)
        width = max(arena_e.lengths)
        torch.testing.assert_close(arena_c.k[:, :len(reqs), :, :width], arena_e.k[:, :len(reqs), :, :width],
                                   atol=0.05, rtol=0.05)
        for req in reqs:
            req.output_ids.append(7)
            req.seq_slots = torch.cat([req.seq_slots, free[:1]])
            req.pending, free = [req.seq_len - 1], free[1:]


def test_one_row_matches_the_eager_fast_path(decoders):
    compiled = decoders[3].compiled
    before = compiled.compiled_steps
    _steps(decoders, [23])
    assert compiled.compiled_steps == before + 3


def test_rows_of_different_lengths_match_the_eager_fast_path(decoders):
    compiled = decoders[3].compiled
    before = compiled.compiled_steps
    _steps(decoders, [9, 30, 17])          # three rows of an arena grown to four: a strided view
    _steps(decoders, [12, 12])             # equal lengths still take the masked graph
    assert compiled.compiled_steps == before + 6


def test_more_rows_than_the_packed_kernels_take_run_eagerly(decoders):
    compiled = decoders[3].compiled
    assert compiled.covers(compiled.max_rows, 40, 16, 256) and compiled.covers(1, 255, 2, 256)
    assert not compiled.covers(compiled.max_rows + 1, 40, 16, 256) and not compiled.covers(1, 1, 2, 256)
    assert not compiled.covers(1, 40, 1, 256)    # an arena of one row: dynamo would specialise it
    assert not compiled.covers(1, 256, 2, 256)   # a context filling the capacity: another guard
    before = compiled.compiled_steps
    _steps(decoders, [10 + row for row in range(compiled.max_rows + 1)], steps=1)
    assert compiled.compiled_steps == before


def test_a_call_no_graph_covers_runs_eagerly_without_compiling(decoders):
    """int32 token ids fail the graphs' guards: the call runs the eager function instead of
    recompiling, and gives its result."""
    model, cfg, eager, fast = decoders
    compiled = fast.compiled
    pool, (arena, _), reqs, _ = _setup(model, cfg, [15])
    arena.assign(reqs, pool)
    fallbacks = compiled.fallbacks
    with torch.inference_mode():
        step = (torch.tensor([3], dtype=torch.int32), torch.tensor([14]), reqs[0].seq_slots[14:15],
                torch.ones(1, 1, 1, 15, dtype=torch.bool))
        got = compiled(*step, pool.k, pool.v, arena.k, arena.v)
        expected = fast.arena_decode_hidden(*step, pool.k, pool.v, arena.k, arena.v)
    assert compiled.fallbacks == fallbacks + 1
    torch.testing.assert_close(got, expected)


def test_the_guard_filter_drops_the_decoders_own_guards_only():
    """The decoder's frozen attributes go unchecked; the step's inputs and globals keep theirs
    (the test above shows an input guard still refusing a call)."""
    from types import SimpleNamespace

    from kvsplice.models.compiled_decode import _skip_decoder_guards

    names = ["self.layers[3].o_proj.packed[1]", "self.lm_head", "pool_k[9]", "arena_v[28]", "input_ids",
             "G['torch'].float32"]
    assert _skip_decoder_guards([SimpleNamespace(name=name) for name in names]) == [False, False, True, True, True, True]


def test_a_few_rows_logits_come_from_the_checkpoints_int8_head(model_dir, decoders):
    """With the checkpoint's lm_head stored as Q8_0 blocks, the logits of up to `max_rows` rows (as
    many as the blocks measured faster at, at least 1) are those exact weights times the rows (closer
    to them than the bf16 head), with or without the compiled step; one more row takes the bf16 head."""
    from safetensors.torch import load_file

    model, cfg, eager, fast = decoders
    assert eager.row_head is not None and fast.row_head is not None
    few = fast.row_head.max_rows
    assert few in (1, 2, 4, 8)
    exact = load_file(f"{model_dir}/model.safetensors")["lm_head.weight"].double()
    with torch.inference_mode():   # rows made as the engine's steps make them
        rows = torch.randn(few + 1, cfg.hidden_size).bfloat16()
        got, more, dense = fast.logits(rows[:few]), fast.logits(rows), fast.lm_head(rows).float()
    truth = rows.double() @ exact.t()
    assert (got.double() - truth[:few]).abs().max() < 2.0 ** -14 * truth.abs().max()   # int16 rows (block_int8_head)
    assert (dense[:few].double() - truth[:few]).abs().max() > 4 * (got.double() - truth[:few]).abs().max()
    torch.testing.assert_close(more, dense)
    torch.testing.assert_close(eager.logits(rows[:1]), got[:1], rtol=0, atol=0)


def test_dense_projections_are_refused():
    model, _ = _model("llama", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int4 or int8"):
        FastDecoder(model, "dense", compile_decode=True)


def test_the_engine_generates_with_compiled_steps(model_dir, compiled_engine):
    """Greedy generations of staggered prompts (one row, then several) with and without the
    compiled step: the same tokens until bf16 rounding first tips a near tie, the same logprobs
    within bf16 noise, most decode steps compiled, none recompiled, the pool intact."""
    prompts = [list(range(5, 5 + n)) for n in (7, 30, 18)]
    compiled = compiled_engine.runner.fast.compiled
    before, fallbacks = compiled.compiled_steps, compiled.fallbacks
    got = LLM(engine=compiled_engine).generate(prompts, GREEDY)
    expected = LLM(engine=_engine(model_dir, compile_decode=False)).generate(prompts, GREEDY)
    for a, b in zip(expected, got):
        agreed = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        assert agreed >= 8
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs[:agreed], b.logprobs[:agreed])) <= 0.05
    assert compiled.compiled_steps - before >= GREEDY.max_tokens - 2 and compiled.fallbacks == fallbacks
    assert compiled_engine.runner.arena.rows >= 2
    counters = take_snapshot(compiled_engine).counters   # what /metrics exports
    assert (counters["compiled_decode_steps"], counters["compiled_decode_fallbacks"]) == (
        compiled.compiled_steps, compiled.fallbacks)
    compiled_engine.check_integrity()


def test_decode_steps_on_fewer_threads_run_compiled(model_dir):
    """With --decode-threads below the process's threads (and a prefill lane), the graphs are built at
    the count the steps run at: dynamo guards the count, so graphs built at another would refuse
    every step."""
    with intra_op_threads(2):   # the suite runs on one thread (tests/conftest.py)
        engine = build_engine(EngineConfig(model=model_dir, dtype="bfloat16", weight_format="auto", num_slots=2048,
                                           compile_decode=True, decode_threads=1, prefill_lane_threads=1))
        threads = engine.runner.threads
        assert threads.compiled_step_counts() == (1,)
        LLM(engine=engine).generate([list(range(5, 20))], GREEDY)
    fast = engine.runner.fast
    assert fast.compiled.compiled_steps >= GREEDY.max_tokens - 2 and fast.compiled.fallbacks == 0


@pytest.mark.parametrize("kwargs, message", [(dict(decode_arena_tokens=0), "DecodeArena"),
                                             (dict(fast_path=False), "fast path")])
def test_the_engine_refuses_compile_without_what_it_needs(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_engine(EngineConfig(model=model_dir, dtype="bfloat16", weight_format="int4", num_slots=256,
                                  compile_decode=True, **kwargs))


def test_steps_beside_the_prefill_lane_run_eagerly(decoders):
    """`allow_compiled=False` (the runner's steps beside a lane job) keeps the eager path."""
    model, cfg, _, fast = decoders
    pool, (arena, _), reqs, _ = _setup(model, cfg, [19])
    with torch.inference_mode():
        _, batch = _decode_batches(reqs, torch.tensor([4]))
    arena.assign(reqs, pool)
    before = fast.compiled.compiled_steps
    with torch.inference_mode():
        fast.final_hidden(batch, pool, arena, allow_compiled=False)
    assert fast.compiled.compiled_steps == before


def test_auto_times_the_built_graphs_against_the_eager_step(model_dir, caplog):
    """auto, where this machine's facts allow compiling: the graphs (inductor's, from its cache by
    now) are switched in only after the speed trial, whose verdict is logged once."""
    import logging

    from kvsplice.utils.machine import read_cpu_flags

    if not read_cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("auto stays eager without native bf16")
    with caplog.at_level(logging.INFO, logger="kvsplice.models.compiled_decode"):
        engine = build_engine(EngineConfig(model=model_dir, dtype="bfloat16", weight_format="auto", num_slots=2048,
                                           compile_decode="auto"))
    compiled = engine.runner.fast.compiled
    assert compiled.verdict is not None and compiled.state == ("active" if any(compiled.verdict.use_compiled) else "eager")
    assert [r.message for r in caplog.records].count(f"compiled decode: {compiled.verdict.reason}") == 1
    [out] = LLM(engine=engine).generate([list(range(5, 20))], GREEDY)
    assert len(out.token_ids) == GREEDY.max_tokens and compiled.fallbacks == 0
