"""FastDecoder against the reference Decoder (and so against transformers) on random tiny configs:
prefill, decode over DecodeArena rows of different lengths, and mixed batches; weight formats."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvsplice.cache.decode_arena import DecodeArena
from kvsplice.cache.kv_pool import KVPool
from kvsplice.engine.request import Req
from kvsplice.layers.forward_batch import ForwardBatch, SeqSlice
from kvsplice.models.config import ModelConfig
from kvsplice.models.decoder import Decoder
from kvsplice.models.fast_decode import FastDecoder
from kvsplice.models.quantize import WeightFormat, apply_weight_format
from kvsplice.sampling_params import SamplingParams

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
CASES = {
    "llama": dict(model_type="llama"),
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
    "qwen2_bias": dict(model_type="qwen2"),
    "qwen3_qknorm": dict(model_type="qwen3", head_dim=32, attention_bias=True),
}


def _model(case: str, dtype=torch.float32) -> tuple[Decoder, ModelConfig]:
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf_config({**BASE, **CASES[case]})
    model = Decoder.from_config(cfg, dtype=dtype)
    with torch.no_grad():   # wide weights, so that differences show in the logits
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if name.endswith("norm.weight")
                        else 0.15 * torch.randn_like(param))
    return model, cfg


def _req(length: int, slots: torch.Tensor) -> Req:
    """A decoding request of `length` tokens whose offsets map to `slots`."""
    req = Req("r", list(range(3, 3 + length - 1)), SamplingParams(max_tokens=8), output_ids=[5])
    req.seq_slots, req.num_slotted, req.pending = slots, length, [length - 1]
    return req


def _prefill(model, pool, ids, slots):
    n = ids.numel()
    return model(ForwardBatch.single(ids, torch.arange(n), slots, slots, torch.arange(n), all_logits=True), pool)


def _decode_batches(reqs, ids):
    """The same decode step twice: as reference SeqSlices, and as arena rows."""
    positions = torch.tensor([r.seq_len - 1 for r in reqs])
    out_slots = torch.stack([r.seq_slots[r.seq_len - 1] for r in reqs])
    seqs = tuple(SeqSlice(i, 1, r.seq_slots[:r.seq_len], torch.arange(r.seq_len)) for i, r in enumerate(reqs))
    rows = torch.arange(len(reqs))
    reference = ForwardBatch(ids, positions, out_slots, seqs, rows)
    return reference, ForwardBatch(ids, positions, out_slots, (), rows, arena_rows=len(reqs))


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_matches_reference(case):
    model, cfg = _model(case)
    fast = FastDecoder(model)
    ids = torch.randint(0, cfg.vocab_size, (40,))
    pool_ref, pool_fast = (KVPool(64, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim) for _ in range(2))
    slots = torch.randperm(64)[:40]
    expected = _prefill(model, pool_ref, ids, slots)
    n = ids.numel()
    got = fast.forward(ForwardBatch.single(ids, torch.arange(n), slots, slots, torch.arange(n), all_logits=True),
                       pool_fast)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_fast.k, pool_ref.k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["llama", "qwen3_qknorm"])
def test_arena_decode_rows_of_different_lengths_match_reference(case):
    model, cfg = _model(case)
    fast = FastDecoder(model)
    pool = KVPool(256, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim)
    arena = DecodeArena(cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, max_tokens=4096)
    free = torch.randperm(256)
    reqs = []
    for length in (9, 30, 17):
        slots, free = free[:length], free[length:]
        _prefill(model, pool, torch.randint(0, cfg.vocab_size, (length - 1,)), slots[:-1])
        reqs.append(_req(length, slots))
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size, (len(reqs),))
        reference, arena_batch = _decode_batches(reqs, ids)
        pool_before = pool.k.clone()
        expected = model(reference, pool)
        pool.k.copy_(pool_before)
        assert arena.assign(reqs, pool) == reqs
        got = fast.forward(arena_batch, pool, arena)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for req in reqs:   # the next step: one more token each, its slot taken from the free list
            req.output_ids.append(7)
            req.seq_slots = torch.cat([req.seq_slots, free[:1]])
            req.pending, free = [req.seq_len - 1], free[1:]


def test_mixed_batch_arena_rows_and_a_prefill_chunk():
    model, cfg = _model("qwen2_bias")
    fast = FastDecoder(model)
    pool = KVPool(256, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim)
    arena = DecodeArena(cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, max_tokens=4096)
    slots = torch.randperm(256)
    decoding = _req(12, slots[:12])
    _prefill(model, pool, torch.randint(0, cfg.vocab_size, (11,)), slots[:11])
    chunk_slots = slots[12:40]     # a fresh prompt of 28 tokens, second chunk of 20 after 8 cached
    prompt = torch.randint(0, cfg.vocab_size, (28,))
    _prefill(model, pool, prompt[:8], chunk_slots[:8])
    ids = torch.cat([torch.tensor([9]), prompt[8:]])
    positions = torch.cat([torch.tensor([11]), torch.arange(8, 28)])
    out_slots = torch.cat([slots[11:12], chunk_slots[8:]])
    chunk = SeqSlice(1, 20, chunk_slots, torch.arange(28))
    rows = torch.tensor([0, 20])
    reference = ForwardBatch(ids, positions, out_slots, (SeqSlice(0, 1, slots[:12], torch.arange(12)), chunk), rows)
    pool_before = pool.k.clone()
    expected = model(reference, pool)
    pool.k.copy_(pool_before)
    arena.assign([decoding], pool)
    got = fast.forward(ForwardBatch(ids, positions, out_slots, (chunk,), rows, arena_rows=1), pool, arena)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_arena_rows_without_an_arena_are_refused():
    model, cfg = _model("llama")
    pool = KVPool(8, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim)
    batch = ForwardBatch(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), (), torch.tensor([0]), arena_rows=1)
    with pytest.raises(ValueError, match="DecodeArena"):
        FastDecoder(model).forward(batch, pool)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_packed_formats_match_the_rounded_reference(fmt):
    """Decode rows (packed kernels, bf16 activations) against the reference Decoder on the same
    rounded weights in bf16: logits within bf16 noise, and prefill (dense path) the same."""
    model, cfg = _model("llama", dtype=torch.bfloat16)
    apply_weight_format(model, WeightFormat(fmt, fmt))
    fast = FastDecoder(model, fmt)
    assert fast.layers[0].qkv.packed is not None
    pool = KVPool(128, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    arena = DecodeArena(cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, max_tokens=1024)
    free, reqs = torch.randperm(128), []
    for length in (21, 8, 30):     # several rows: the packed kernels get a batch, not one vector
        slots, free = free[:length], free[length:]
        _prefill(model, pool, torch.randint(0, cfg.vocab_size, (length - 1,)), slots[:-1])
        reqs.append(_req(length, slots))
    reference, arena_batch = _decode_batches(reqs, torch.tensor([4, 9, 11]))
    expected = model(reference, pool)
    arena.assign(reqs, pool)
    got = fast.forward(arena_batch, pool, arena)
    tolerance = 0.05 * expected.abs().max()
    assert (got - expected).abs().max() <= tolerance
    # the fast path's choice is the reference's best up to that noise (near ties may swap)
    chosen = expected.gather(1, got.argmax(dim=-1, keepdim=True))[:, 0]
    assert (chosen >= expected.max(dim=-1).values - 2 * tolerance).all()


def test_supports_attention_models_only():
    sliding = ModelConfig.from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 8})
    gated = dataclasses.replace(sliding, attn_output_gate=True)
    assert FastDecoder.supports(sliding) and FastDecoder.compile_refusal(sliding) == "sliding windows on every layer"
    assert not FastDecoder.supports(gated)
    with pytest.raises(ValueError, match="fast path"):
        FastDecoder(Decoder.from_config(gated))
