"""The fast span move (`kvsplice.layers.rotary_move`, used by `reuse.relocate.relocate`) equals the
reference `move_keys` path (`relocate_reference`) bit for bit: every dtype the pool takes, every RoPE
kind, partial rotary, a RoPE per layer (LayerRotaries), deltas of both signs."""

from __future__ import annotations

import pytest
import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.layers.rotary import LayerRotaries, Rotary, apply_rope, rope_cos_sin, unrotate
from kvsplice.layers.rotary_move import span_turn, turn_layer_keys_
from kvsplice.models.config import rope_from_hf_config
from kvsplice.reuse.plan import Keep
from kvsplice.reuse.relocate import relocate, relocate_reference

HEAD_DIM = 64
ROPES = {
    "default": dict(rope_type="default", rope_theta=100000.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=1024),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rope(kind: str, partial: float = 1.0):
    config = dict(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=8192,
                  rope_parameters=dict(ROPES[kind], partial_rotary_factor=partial))
    return rope_from_hf_config(config, HEAD_DIM, 8192)


def _stored_pool(rotary: Rotary | LayerRotaries, layers: int, heads: int, dtype: torch.dtype, keep: Keep,
                 seed: int) -> KVPool:
    """A pool whose slots 0..keep.length hold keys a forward stored at keep.src_pos.. (a projection of
    `dtype` rotated in fp32 and rounded once) and random values."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(HEAD_DIM, generator=generator))
    k_proj = (torch.randn(keep.length, layers, heads, HEAD_DIM, generator=generator) * scale).to(dtype)
    src_pos = torch.arange(keep.src_pos, keep.src_end)
    rotaries = rotary.kv_layers if isinstance(rotary, LayerRotaries) else (rotary,) * layers
    pool = KVPool(3 * keep.length, layers, heads, HEAD_DIM, dtype=dtype)
    for layer, layer_rotary in enumerate(rotaries):
        pool.k[layer, :keep.length] = apply_rope(k_proj[:, layer], *layer_rotary.cos_sin(src_pos))
    pool.v[:, :keep.length] = torch.randn(layers, keep.length, heads, HEAD_DIM, generator=generator).to(dtype)
    return pool


def _assert_fast_equals_reference(rotary, layers: int, dtype: torch.dtype, keep: Keep, seed: int = 0) -> None:
    for dst in (torch.arange(2 * keep.length, 3 * keep.length),          # one ascending run (slices)
                torch.arange(2 * keep.length, 3 * keep.length).flip(0)):  # scattered: index_select / index_copy_
        _assert_equal_at(rotary, layers, dtype, keep, dst, seed)


def _assert_equal_at(rotary, layers: int, dtype: torch.dtype, keep: Keep, dst: torch.Tensor, seed: int) -> None:
    fast, reference = (_stored_pool(rotary, layers, 2, dtype, keep, seed) for _ in range(2))
    src = torch.arange(0, keep.length)
    relocate(fast, src, dst, keep, rotary)
    relocate_reference(reference, src, dst, keep, rotary)
    assert torch.equal(fast.k, reference.k)
    assert torch.equal(fast.v, reference.v)
    if keep.delta != 0:   # the test can fail: the keys did turn
        assert not torch.equal(fast.k[:, dst], fast.k[:, src])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(ROPES))
@pytest.mark.parametrize("delta", [-733, 2, 1500])
def test_fast_relocation_equals_the_reference_bit_for_bit(kind, dtype, delta):
    src_pos = 900
    _assert_fast_equals_reference(Rotary(_rope(kind)), 3, dtype, Keep(src_pos, src_pos + delta, 97))


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_equals_the_reference_and_leaves_the_rest(dtype):
    rotary = Rotary(_rope("llama3", partial=0.5))
    _assert_fast_equals_reference(rotary, 2, dtype, Keep(300, 40, 64))
    keys = torch.randn(8, 2, HEAD_DIM).to(dtype)
    moved = turn_layer_keys_(keys.clone(), span_turn(rotary, 300, 40, 8, dtype))
    assert torch.equal(moved[..., HEAD_DIM // 2:], keys[..., HEAD_DIM // 2:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rope_per_layer_equals_the_reference(dtype):
    """Gemma 3's layout: sliding layers on one theta, global ones on another (LayerRotaries)."""
    local, wide = _rope("default"), _rope("yarn")
    layer_ropes = (local, local, wide, local, wide)
    rotaries = LayerRotaries(layer_ropes, kv_layers=(0, 1, 2, 3, 4))
    _assert_fast_equals_reference(rotaries, 5, dtype, Keep(1200, 100, 50))


def test_no_rotary_or_no_delta_copies_keys_as_they_are():
    keep = Keep(10, 10, 16)
    pool = _stored_pool(Rotary(_rope("default")), 2, 2, torch.bfloat16, keep, seed=5)
    src, dst = torch.arange(0, 16), torch.arange(32, 48)
    relocate(pool, src, dst, keep, Rotary(_rope("default")))
    assert torch.equal(pool.k[:, dst], pool.k[:, src])
    moved = Keep(10, 3, 16)
    relocate(pool, src, dst, moved, None)
    assert torch.equal(pool.k[:, dst], pool.k[:, src]) and torch.equal(pool.v[:, dst], pool.v[:, src])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer_ropes", [("default",) * 4, ("default", "yarn", "default", "yarn")])
def test_layer_rotaries_turn_each_layer_as_its_own_rope_does(dtype, layer_ropes):
    """LayerRotaries.move_keys turns the layers of one RoPE in one call (the window pool's sliding
    layers share one): bit for bit each layer's own Rotary.move_keys."""
    ropes = tuple(_rope(kind) for kind in layer_ropes)
    rotaries = LayerRotaries(ropes, kv_layers=tuple(range(len(ropes))))
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(40, len(ropes) * 2, HEAD_DIM, generator=generator).to(dtype)
    src, dst = torch.arange(100, 140), torch.arange(7, 47)
    moved = rotaries.move_keys(keys, src, dst).view(40, len(ropes), 2, HEAD_DIM)
    per_layer = keys.view(40, len(ropes), 2, HEAD_DIM)
    for index, rotary in enumerate(rotaries.kv_layers):
        assert torch.equal(moved[:, index], rotary.move_keys(per_layer[:, index], src, dst))


@pytest.mark.parametrize("rows", [0, 1, 6000])
def test_move_keys_in_chunks_equals_one_piece(rows):
    """move_keys turns long inputs in chunks of rows: the same bits as one piece, and no rows at all
    gives no rows."""
    rotary = Rotary(_rope("default"))
    generator = torch.Generator().manual_seed(4)
    keys = torch.randn(rows, 3, HEAD_DIM, generator=generator).to(torch.bfloat16)
    src, dst = torch.arange(50, 50 + rows), torch.arange(9, 9 + rows)
    chunked = rotary.move_keys(keys, src, dst)
    assert chunked.shape == keys.shape
    if rows:
        whole = apply_rope(unrotate(keys, *rope_cos_sin(src, rotary.inv_freq, 1.0), rotary.attention_scaling)
                           .to(keys.dtype), *rotary.cos_sin(dst))
        assert torch.equal(chunked, whole)
