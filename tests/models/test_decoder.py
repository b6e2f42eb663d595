"""Decoder vs transformers on random tiny configs: prefill, decode through the pool, mixed batches.

Each case is a config.json-like dict; transformers builds its model from it (eager attention,
fp32), we build ours with ModelConfig.from_hf_config and load its state_dict().
Partial rotary: none of llama / mistral / qwen2 / qwen3 in transformers 5.24 rotates a partial
head (their default RoPE ignores partial_rotary_factor and their apply_rotary_pos_emb rotates all
of head_dim). It is tested against transformers' Phi3 instead (same block as llama with fused
qkv_proj / gate_up_proj, and partial rotary supported), its weights split into llama names.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvsplice.cache.kv_pool import KVPool
from kvsplice.layers.forward_batch import ForwardBatch, SeqSlice
from kvsplice.models.config import ModelConfig
from kvsplice.models.decoder import Decoder

TOL = 1e-4
PREFILL_LEN = 64
DECODE_STEPS = 16

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

CASES = {
    "llama_gqa_untied": dict(model_type="llama", tie_word_embeddings=False),
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=4),
    "mistral_sliding16": dict(model_type="mistral", sliding_window=16),
    "qwen2_bias": dict(model_type="qwen2", num_hidden_layers=3),
    "qwen2_sliding_layers": dict(model_type="qwen2", num_hidden_layers=3, use_sliding_window=True,
                                 sliding_window=12, max_window_layers=1),
    "qwen3_qknorm_head_dim": dict(model_type="qwen3", head_dim=32, attention_bias=True),
    "llama3_scaling": dict(model_type="llama", rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
    "yarn_scaling": dict(model_type="qwen2", max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)),
    "linear_scaling_legacy_keys": dict(model_type="mistral", sliding_window=None, rope_theta=500.0,
                                       rope_scaling=dict(type="linear", factor=2.0)),
}


def _raw_config(case: str) -> dict:
    return {**BASE, **CASES[case]}


def _hf_model(raw: dict):
    fields = {key: value for key, value in raw.items() if key != "model_type"}
    hf_cfg = AutoConfig.for_model(raw["model_type"], **fields)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    # Default init (std 0.02, norms at 1) makes logits tiny and hides norm weights: widen it.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model.eval()


def _pair(case: str):
    torch.manual_seed(0)
    raw = _raw_config(case)
    hf_model = _hf_model(raw)
    cfg = ModelConfig.from_hf_config(raw)
    ours = Decoder.from_config(cfg)
    ours.load_hf_state_dict(hf_model.state_dict())
    pool = KVPool(256, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    return hf_model, ours, pool, cfg


def _hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0].float()


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_transformers(case):
    hf_model, ours, pool, cfg = _pair(case)
    ids = torch.randint(0, cfg.vocab_size, (PREFILL_LEN,))
    positions = torch.arange(PREFILL_LEN)
    slots = pool.allocator.alloc(PREFILL_LEN)
    logits = ours(ForwardBatch.single(ids, positions, slots, slots, positions, all_logits=True), pool)
    assert logits.shape == (PREFILL_LEN, cfg.vocab_size) and logits.dtype == torch.float32
    assert (logits - _hf_logits(hf_model, ids)).abs().max() <= TOL

    context_slots, context_pos = slots, positions
    for _ in range(DECODE_STEPS):
        next_id = logits[-1].argmax().reshape(1)
        ids = torch.cat([ids, next_id])
        pos = torch.tensor([ids.numel() - 1])
        slot = pool.allocator.alloc(1)
        context_slots, context_pos = torch.cat([context_slots, slot]), torch.cat([context_pos, pos])
        logits = ours(ForwardBatch.single(next_id, pos, slot, context_slots, context_pos), pool)
        assert logits.shape == (1, cfg.vocab_size)
        assert (logits[-1] - _hf_logits(hf_model, ids)[-1]).abs().max() <= TOL


def test_config_reading_matches_transformers_own_reading():
    """from_hf_config on the raw dict equals it on transformers' normalised to_dict()."""
    for case in CASES:
        raw = _raw_config(case)
        fields = {key: value for key, value in raw.items() if key != "model_type"}
        normalised = AutoConfig.for_model(raw["model_type"], **fields).to_dict()
        assert ModelConfig.from_hf_config(raw) == ModelConfig.from_hf_config(normalised), case


def test_permuted_context_slots_use_positions_not_order():
    hf_model, ours, pool, cfg = _pair("llama_gqa_untied")
    ids = torch.randint(0, cfg.vocab_size, (PREFILL_LEN,))
    positions = torch.arange(PREFILL_LEN)
    out_slots = torch.randperm(pool.num_slots)[:PREFILL_LEN]   # slots scattered over the pool
    order = torch.randperm(PREFILL_LEN)                          # context listed out of order
    batch = ForwardBatch.single(ids, positions, out_slots, out_slots[order], positions[order], all_logits=True)
    assert (ours(batch, pool) - _hf_logits(hf_model, ids)).abs().max() <= TOL


def test_mixed_batch_prefill_chunk_and_decode_rows():
    """One forward: req0 fresh prefill, req1 second prefill chunk, req2 decode step."""
    hf_model, ours, pool, cfg = _pair("qwen3_qknorm_head_dim")
    seqs_ids = [torch.randint(0, cfg.vocab_size, (n,)) for n in (20, 40, 31)]
    cached = [0, 25, 30]  # tokens already in the pool per request
    ctx = []
    for ids, n_cached in zip(seqs_ids, cached):
        slots = pool.allocator.alloc(ids.numel())
        if n_cached:
            pos = torch.arange(n_cached)
            ours(ForwardBatch.single(ids[:n_cached], pos, slots[:n_cached], slots[:n_cached], pos), pool)
        ctx.append(slots)
    rows, pieces, seqs = [], [[], [], []], []
    for ids, n_cached, slots in zip(seqs_ids, cached, ctx):
        start = sum(piece.numel() for piece in pieces[0])
        pos = torch.arange(n_cached, ids.numel())
        pieces[0].append(ids[n_cached:]), pieces[1].append(pos), pieces[2].append(slots[n_cached:])
        seqs.append(SeqSlice(start, pos.numel(), slots, torch.arange(ids.numel())))
        rows.append(torch.arange(start, start + pos.numel()))
    batch = ForwardBatch(torch.cat(pieces[0]), torch.cat(pieces[1]), torch.cat(pieces[2]), tuple(seqs),
                         torch.cat(rows))
    logits = ours(batch, pool)
    offset = 0
    for ids, n_cached in zip(seqs_ids, cached):
        n_new = ids.numel() - n_cached
        expected = _hf_logits(hf_model, ids)[n_cached:]
        assert (logits[offset:offset + n_new] - expected).abs().max() <= TOL
        offset += n_new


def test_bf16_model_close_to_fp32_transformers():
    hf_model, _, _, cfg = _pair("llama_gqa_untied")
    ours = Decoder.from_config(cfg, dtype=torch.bfloat16)
    ours.load_hf_state_dict(hf_model.state_dict())
    pool = KVPool(64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (32,))
    slots, positions = pool.allocator.alloc(32), torch.arange(32)
    logits = ours(ForwardBatch.single(ids, positions, slots, slots, positions, all_logits=True), pool)
    expected = _hf_logits(hf_model, ids)
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() <= 0.05 * expected.abs().max()


def test_tied_lm_head_shares_embedding_and_may_be_absent():
    hf_model, ours, _, _ = _pair("llama_tied")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    sd = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    ours.load_hf_state_dict({**sd, "model.embed_tokens.weight": torch.ones_like(sd["model.embed_tokens.weight"])})
    assert bool((ours.lm_head.weight == 1).all())


def test_load_rejects_missing_unexpected_and_misshapen_keys():
    hf_model, ours, _, _ = _pair("qwen2_bias")
    sd = dict(hf_model.state_dict())
    with pytest.raises(ValueError, match="missing"):
        ours.load_hf_state_dict({k: v for k, v in sd.items() if k != "model.layers.0.self_attn.q_proj.bias"})
    with pytest.raises(ValueError, match="unexpected"):
        ours.load_hf_state_dict({**sd, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="size mismatch"):
        ours.load_hf_state_dict({**sd, "model.norm.weight": torch.zeros(3)})


def test_param_names_and_non_embedding_count_match_transformers():
    for case in CASES:
        torch.manual_seed(0)
        raw = _raw_config(case)
        hf_model = _hf_model(raw)
        ours = Decoder.from_config(ModelConfig.from_hf_config(raw))
        assert set(ours.state_dict()) == set(hf_model.state_dict()), case
        embedding = {"model.embed_tokens.weight", "lm_head.weight"}
        hf_count = sum(t.numel() for name, t in hf_model.state_dict().items() if name not in embedding)
        assert ours.cfg.num_params_non_embedding == hf_count, case


@pytest.mark.parametrize("raw, message", [
    (dict(BASE, model_type="gpt2"), "gpt2"),
    (dict(BASE, model_type="llama", rope_scaling=dict(rope_type="dynamic", factor=2.0)), "dynamic"),
    (dict(BASE, model_type="llama", hidden_act="gelu"), "gelu"),
    ({k: v for k, v in dict(BASE, model_type="llama").items() if k != "vocab_size"}, "vocab_size"),
])
def test_bad_configs_raise_value_error_naming_the_problem(raw, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(raw)


def test_config_fields_eos_list_head_dim_and_legacy_rope():
    raw = dict(BASE, model_type="qwen3", head_dim=48, eos_token_id=[5, 7], rope_theta=1e6,
               rope_scaling=dict(type="yarn", factor=2.0, beta_fast=16))
    cfg = ModelConfig.from_hf_config(raw)
    assert cfg.head_dim == 48 and cfg.eos_token_ids == (5, 7) and cfg.qk_norm
    assert cfg.rope.kind == "yarn" and cfg.rope.theta == 1e6 and cfg.rope.beta_fast == 16
    assert cfg.rope.original_max_position_embeddings == BASE["max_position_embeddings"]
    assert ModelConfig.from_hf_config(dict(BASE, model_type="llama")).eos_token_ids == (2,)
    assert ModelConfig.from_hf_config(dict(BASE, model_type="llama", partial_rotary_factor=0.5)).rope.rotary_dim == 8


def _phi3_to_llama_names(sd: dict, cfg: ModelConfig) -> dict:
    """Split Phi3's fused qkv_proj ([q; k; v]) and gate_up_proj ([gate; up]) into llama names."""
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for name, tensor in sd.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            q, k, v = tensor.split([q_out, kv_out, kv_out])
            out.update({prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v})
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            out.update({prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up})
        else:
            out[name] = tensor
    return out


def test_partial_rotary_matches_transformers_phi3():
    torch.manual_seed(0)
    raw = dict(BASE, model_type="llama", partial_rotary_factor=0.5)
    phi3_fields = {k: v for k, v in raw.items() if k != "model_type"}
    hf_model = _hf_model(dict(phi3_fields, model_type="phi3", pad_token_id=0, sliding_window=None))
    cfg = ModelConfig.from_hf_config(raw)
    assert cfg.rope.rotary_dim == cfg.head_dim // 2
    ours = Decoder.from_config(cfg)
    ours.load_hf_state_dict(_phi3_to_llama_names(hf_model.state_dict(), cfg))
    pool = KVPool(64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    ids = torch.randint(0, cfg.vocab_size, (PREFILL_LEN,))
    slots, positions = pool.allocator.alloc(PREFILL_LEN), torch.arange(PREFILL_LEN)
    logits = ours(ForwardBatch.single(ids, positions, slots, slots, positions, all_logits=True), pool)
    assert (logits - _hf_logits(hf_model, ids)).abs().max() <= TOL
