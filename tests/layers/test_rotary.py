"""RoPE: inv_freq / scaling equal transformers' for every kind, apply_rope equals transformers'
(partial rotary against Phi3, the one llama-like transformers model that rotates part of a head),
and the SCR identity rerotate(apply_rope(k, p), d) == apply_rope(k, p + d)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rope
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rope

from kvsplice.layers.rotary import Rotary, apply_rope, inv_freq_and_scale, rerotate, rope_cos_sin
from kvsplice.models.config import rope_from_hf_config

HEAD_DIM = 32
MAX_POS = 256
ROPE_PARAMS = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    "yarn_mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=0.707,
                        beta_fast=16.0, beta_slow=2.0, original_max_position_embeddings=64, truncate=False),
    "yarn_attention_factor": dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, attention_factor=1.3,
                                  original_max_position_embeddings=128),
}
KINDS = list(ROPE_PARAMS)


def _config_dict(kind: str, partial: float = 1.0) -> dict:
    params = dict(ROPE_PARAMS[kind], partial_rotary_factor=partial)
    return dict(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM,
                max_position_embeddings=MAX_POS, rope_parameters=params)


def _hf_inv_freq(kind: str, partial: float) -> tuple[torch.Tensor, float]:
    d = _config_dict(kind, partial)
    if d["rope_parameters"]["rope_type"] == "default":
        return Phi3RotaryEmbedding.compute_default_rope_parameters(Phi3Config(**d))
    return ROPE_INIT_FUNCTIONS[d["rope_parameters"]["rope_type"]](LlamaConfig(**d))


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("kind", KINDS)
def test_inv_freq_and_scale_equal_transformers(kind, partial):
    rope = rope_from_hf_config(_config_dict(kind, partial), HEAD_DIM, MAX_POS)
    inv_freq, scale = inv_freq_and_scale(rope)
    hf_inv_freq, hf_scale = _hf_inv_freq(kind, partial)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (int(HEAD_DIM * partial) // 2,)
    assert torch.equal(inv_freq, hf_inv_freq.float())
    assert scale == pytest.approx(hf_scale, rel=1e-12)
    if kind.startswith("yarn"):
        assert scale != 1.0  # the case really exercises attention scaling


@pytest.mark.parametrize("kind", KINDS)
def test_apply_rope_equals_transformers_full_rotary(kind):
    torch.manual_seed(0)
    d = _config_dict(kind)
    hf_rotary = LlamaRotaryEmbedding(LlamaConfig(**d))
    positions = torch.randint(0, MAX_POS, (10,))
    q = torch.randn(10, 3, HEAD_DIM)
    hf_cos, hf_sin = hf_rotary(q, positions[None])
    hf_q, _ = llama_apply_rope(q[None], q[None], hf_cos, hf_sin, unsqueeze_dim=2)
    rotary = Rotary(rope_from_hf_config(d, HEAD_DIM, MAX_POS))
    cos, sin = rotary.cos_sin(positions)
    torch.testing.assert_close(cos, hf_cos[0], atol=0, rtol=0)
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q[0], atol=1e-6, rtol=1e-6)


def test_apply_rope_partial_equals_transformers_phi3():
    torch.manual_seed(0)
    d = _config_dict("default", partial=0.5)
    hf_rotary = Phi3RotaryEmbedding(Phi3Config(**d))
    positions = torch.arange(20)
    k = torch.randn(20, 2, HEAD_DIM)
    hf_cos, hf_sin = hf_rotary(k, positions[None])
    _, hf_k = phi3_apply_rope(k[None], k[None], hf_cos, hf_sin, unsqueeze_dim=2)
    cos, sin = Rotary(rope_from_hf_config(d, HEAD_DIM, MAX_POS)).cos_sin(positions)
    rotated = apply_rope(k, cos, sin)
    torch.testing.assert_close(rotated, hf_k[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(rotated[..., HEAD_DIM // 2:], k[..., HEAD_DIM // 2:])  # pass-through dims


def _rerotate_case(kind: str, partial: float, dtype: torch.dtype, seed: int):
    torch.manual_seed(seed)
    rotary = Rotary(rope_from_hf_config(_config_dict(kind, partial), HEAD_DIM, MAX_POS))
    n = 64
    # fp32 angle rounding grows with |pos|: keep positions moderate so 1e-5 is about rerotate, not fp32
    src_pos = torch.randint(0, 40, (n,))
    dst_pos = torch.randint(0, 40, (n,))
    delta = dst_pos - src_pos
    assert bool((delta < 0).any()) and bool((delta > 0).any())
    k = torch.randn(n, 2, HEAD_DIM)
    stored = apply_rope(k.to(dtype), *rotary.cos_sin(src_pos))
    moved = rerotate(stored, delta, rotary.inv_freq)
    fresh = apply_rope(k.to(dtype), *rotary.cos_sin(dst_pos))
    return moved, fresh


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("kind", KINDS)
def test_rerotate_equals_rotation_at_new_position(kind, partial):
    moved, fresh = _rerotate_case(kind, partial, torch.float32, seed=1)
    assert moved.dtype == torch.float32
    torch.testing.assert_close(moved, fresh, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["default", "yarn"])
def test_rerotate_bf16_keys_loose(kind):
    moved, fresh = _rerotate_case(kind, 1.0, torch.bfloat16, seed=2)
    assert moved.dtype == torch.bfloat16
    # two bf16 roundings (stored key, moved key) vs one: a few bf16 ulps of values ~ 1..4
    torch.testing.assert_close(moved.float(), fresh.float(), atol=0.05, rtol=0.02)


def test_rerotate_does_not_reapply_attention_scaling():
    rotary = Rotary(rope_from_hf_config(_config_dict("yarn"), HEAD_DIM, MAX_POS))
    assert rotary.attention_scaling > 1.0
    k = torch.randn(5, 1, HEAD_DIM)
    zero = torch.zeros(5, dtype=torch.int64)
    torch.testing.assert_close(rotary.rerotate(k, zero), k, atol=0, rtol=0)  # delta 0 is the identity
    # and a rotation keeps the norm
    moved = rotary.rerotate(k, torch.full((5,), -7))
    torch.testing.assert_close(moved.norm(dim=-1), k.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_rope_cos_sin_accepts_negative_positions():
    inv_freq = torch.tensor([1.0, 0.1])
    cos, sin = rope_cos_sin(torch.tensor([-3, 3]), inv_freq, 1.0)
    torch.testing.assert_close(cos[0], cos[1])
    torch.testing.assert_close(sin[0], -sin[1])
