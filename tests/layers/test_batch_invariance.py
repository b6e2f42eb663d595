"""Batch invariance at bf16: a row's output does not depend on how many other rows share its call.

SCR recomputes a few rows of a prompt and reads the rest from relocated K/V; the recomputed rows
match a full prefill's only when every op gives a row the same bits at any row count. These tests
compare the same rows computed alone and inside larger batches, bitwise, for the dense and int4
PackedLinear paths above their small-batch kernels, the lm_head, the RMSNorm kernel and the
planned (position-masked) attention of a subset of queries against a full causal prefill.
"""

from __future__ import annotations

import pytest
import torch

from kvsplice.layers.attention import plan_sequence, planned_attention
from kvsplice.layers.norm import doubled_weight, rms_norm_via_layer_norm
from kvsplice.layers.quant_linear import ROW_TILE, PackedLinear, row_tiled_linear

# SmolLM2-135M's shapes (in, out): q|k|v, o, gate|up, down, lm_head
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 8192))
ROW_COUNTS = (9, 17, 33, 64, 100, 128, 200, 640)
FULL_ROWS = 1024


def _needs_bf16_matmul():
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN does not run bf16 natively on this CPU")


@pytest.mark.parametrize("fmt", ["dense", "int4"])
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_packed_linear_rows_alone_equal_rows_in_a_batch(fmt, in_features, out_features, torch_seed):
    _needs_bf16_matmul()
    weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
    linear = PackedLinear.build([weight], [None], fmt)
    x = torch.randn(FULL_ROWS, in_features).bfloat16()
    full = linear(x)
    for rows in ROW_COUNTS:
        for start in (0, FULL_ROWS - rows, 37):
            part = linear(x[start:start + rows].contiguous())
            assert torch.equal(part, full[start:start + rows]), (fmt, rows, start)


def test_row_tiled_linear_is_the_plain_product_tile_by_tile(torch_seed):
    weight = torch.randn(96, 64).bfloat16()
    x = torch.randn(3 * ROW_TILE + 5, 64).bfloat16()
    tiled = row_tiled_linear(x, weight, None)
    assert tiled.shape == (x.shape[0], 96)
    for start in range(0, x.shape[0], ROW_TILE):
        assert torch.equal(tiled[start:start + ROW_TILE], row_tiled_linear(x[start:start + ROW_TILE], weight, None))
    assert torch.allclose(tiled.float(), x.float() @ weight.float().t(), atol=0.05, rtol=0.02)


def test_rms_norm_rows_alone_equal_rows_in_a_batch(torch_seed):
    x = torch.randn(FULL_ROWS, 576).bfloat16()
    weight = doubled_weight(torch.rand(576).bfloat16())
    full = rms_norm_via_layer_norm(x, weight, 1e-5)
    for rows in (1, 7, 100, 640):
        assert torch.equal(rms_norm_via_layer_norm(x[-rows:], weight, 1e-5), full[-rows:])


@pytest.mark.parametrize("queries", [1, 5, 16, 32, 33, 100, 200])
def test_attention_of_some_queries_equals_the_full_causal_prefill(queries, torch_seed):
    """The last `queries` positions over a context in scattered slots (relocated K/V), planned as
    the engine plans an edited turn, give exactly the rows of the causal prefill of the whole context."""
    heads, kv_heads, dim, context = 9, 3, 64, 700
    k_layer = torch.randn(2048, kv_heads, dim).bfloat16()
    v_layer = torch.randn(2048, kv_heads, dim).bfloat16()
    q = torch.randn(context, heads, dim).bfloat16()
    positions = torch.arange(context)
    fresh = plan_sequence(positions, torch.arange(context), positions, 2048, torch.bfloat16, group=3)
    assert fresh.causal
    full = planned_attention(q, fresh, k_layer, v_layer, dim ** -0.5)
    scattered = torch.randperm(2048)[:context]
    k_moved, v_moved = k_layer.clone(), v_layer.clone()
    k_moved[scattered], v_moved[scattered] = k_layer[:context], v_layer[:context]
    tail = positions[-queries:]
    plan = plan_sequence(tail, scattered, positions, 2048, torch.bfloat16, group=3)
    part = planned_attention(q[-queries:], plan, k_moved, v_moved, dim ** -0.5)
    assert torch.equal(part, full[-queries:])
