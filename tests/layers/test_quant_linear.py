"""Weight formats: quantize / dequantize, lossless detection of Q4_1-style data, PackedLinear's
packed kernels against its dense copy, fused projections."""

from __future__ import annotations

import pytest
import torch

from kvsplice.layers.quant_linear import (INT4_GROUP, PackedLinear, check_format, dequantize, is_lossless,
                                          quantize, round_to_format)


def _q4_1_weight(rows: int, cols: int) -> torch.Tensor:
    """What a GGUF Q4_1 tensor dequantizes to: per group of 32, w = d q + m with q in 0..15 (both
    ends used, as llama.cpp's quantizer does)."""
    q = torch.randint(0, 16, (rows, cols // INT4_GROUP, INT4_GROUP))
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(rows, cols // INT4_GROUP, 1) * 0.02 + 0.001
    m = -8 * d + 0.01 * torch.randn(rows, cols // INT4_GROUP, 1)
    return (d * q + m).view(rows, cols)


def test_int4_of_q4_1_data_is_lossless_up_to_bf16_scales(torch_seed):
    w = _q4_1_weight(48, 128)
    assert is_lossless(w, "int4") and is_lossless(w.bfloat16(), "int4")
    back = dequantize(quantize(w, "int4"))
    groups = w.view(48, 4, 32)
    scale = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    zero = groups.amin(-1, keepdim=True) + 8 * scale
    # every value back on its own grid step: the only error is the bf16 rounding (relative 2^-9)
    # of the scale, times up to 8 steps, and of the zero
    assert ((back - w).abs().view(48, 4, 32) <= (8 * scale + zero.abs()) * 2 ** -8 + 1e-7).all()
    assert not is_lossless(torch.randn(48, 128), "int4")


def test_int8_round_trip_error_is_at_most_half_a_step(torch_seed):
    w = torch.randn(16, 64)
    qw = quantize(w, "int8")
    step = qw.scales.float()[:, None]
    assert qw.values.dtype == torch.int8 and (dequantize(qw) - w).abs().le(step / 2 + 1e-3 * step).all()
    grid = torch.randint(-127, 128, (4, 64)).float()
    grid[:, 0] = 127
    assert is_lossless(grid * 0.25, "int8") and not is_lossless(w, "int8")


def test_round_to_format_keeps_dtype_and_dense_is_identity(torch_seed):
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    assert round_to_format(w, "dense") is w
    assert round_to_format(w, "int4").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="weight format"):
        check_format("int3")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_packed_kernel_matches_dense_copy_on_small_batches(torch_seed, fmt):
    w, b = torch.randn(96, 64), torch.randn(96)
    linear = PackedLinear.build([w], [b], fmt)
    assert linear.packed is not None and linear.fmt == fmt
    for rows in (1, 3):
        x = torch.randn(rows, 64)   # fp32: the kernel takes it rounded to bf16, answers in fp32
        got, expected = linear(x), linear.reference(x)
        assert got.dtype == torch.float32
        assert (got - expected).abs().max() <= 0.02 * expected.abs().max()
    big = torch.randn(64, 64)   # above small_batch_rows: exactly the dense product
    torch.testing.assert_close(linear(big), linear.reference(big))


def test_fused_build_splits_back_into_each_projection(torch_seed):
    weights = [torch.randn(n, 64) for n in (32, 16, 16)]
    fused = PackedLinear.build(weights, [None, torch.randn(16), None], "dense")
    x = torch.randn(5, 64)
    parts = fused(x).split([32, 16, 16], dim=1)
    torch.testing.assert_close(parts[0], x @ weights[0].T)
    torch.testing.assert_close(parts[1], x @ weights[1].T + fused.bias[32:48])
    assert fused.out_features == 64 and (fused.bias[:32] == 0).all()


def test_int4_needs_inputs_divisible_by_32(torch_seed):
    linear = PackedLinear.build([torch.randn(8, 48)], [None], "int4")
    assert linear.fmt == "dense" and linear.packed is None


def test_bucketed_linear_matches_linear_for_every_row_count():
    from kvsplice.layers.quant_linear import bucketed_linear
    from kvsplice.layers.shape_bucket import BUCKET as ROW_BUCKET

    torch.manual_seed(0)
    weight, bias = torch.randn(40, 32, dtype=torch.bfloat16), torch.randn(40, dtype=torch.bfloat16)
    for rows in (1, 5, 13, ROW_BUCKET, ROW_BUCKET + 1, 3 * ROW_BUCKET - 5):
        x = torch.randn(rows, 32, dtype=torch.bfloat16)
        got = bucketed_linear(x, weight, bias)
        assert got.shape == (rows, 40) and got.is_contiguous()
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=0, atol=0)
    x32 = torch.randn(13, 32)
    torch.testing.assert_close(bucketed_linear(x32, weight.float(), None), x32 @ weight.float().T)


def test_bucketed_linear_module_is_an_nn_linear_with_the_same_values():
    from kvsplice.layers.quant_linear import BucketedLinear
    from kvsplice.layers.shape_bucket import BUCKET as ROW_BUCKET

    torch.manual_seed(0)
    plain = torch.nn.Linear(32, 40, dtype=torch.bfloat16)
    bucketed = BucketedLinear(32, 40, dtype=torch.bfloat16)
    bucketed.load_state_dict(plain.state_dict())
    assert isinstance(bucketed, torch.nn.Linear)
    x = torch.randn(3, ROW_BUCKET + 7, 32, dtype=torch.bfloat16)   # leading dims flattened: 213 rows
    torch.testing.assert_close(bucketed(x), plain(x), rtol=0, atol=0)


def test_prepacked_dense_copy_gives_the_same_values_as_f_linear():
    """Where oneDNN runs bf16 natively, bf16 PackedLinears hold a prepacked copy of their dense
    weight and use it above the packed kernels' row limit (and for dense formats at every row
    count); elsewhere, and for fp32 weights, there is none."""
    from kvsplice.layers.quant_linear import SMALL_BATCH_ROWS_PREPACKED, can_prepack

    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    assert PackedLinear.build([weight.float()], [None], "int4").prepacked is None
    if not can_prepack(weight):
        pytest.skip("oneDNN has no native bf16 on this CPU: no prepacked weights here")
    dense, int4 = PackedLinear.build([weight], [bias], "dense"), PackedLinear.build([weight], [bias], "int4")
    assert dense.prepacked is not None and int4.prepacked is not None
    assert int4.small_batch_rows == SMALL_BATCH_ROWS_PREPACKED["int4"]
    for rows in (1, 7, 9, 64, 65, 300):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(dense(x), torch.nn.functional.linear(x, weight, bias))
        if rows > int4.small_batch_rows:
            torch.testing.assert_close(int4(x), int4.reference(x))
