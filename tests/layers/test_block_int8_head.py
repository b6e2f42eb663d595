"""kvsplice.layers.block_int8_head: the checkpoint's Q8_0 blocks recovered exactly from their fp32
dequantization (and nothing else taken for blocks), in tiles of 16 outputs, and the C kernel
computing up to 8 rows' logits from them: every code path the same bits, as the torch reference
computes them, closer to the checkpoint than the bf16 head, one row's logits whatever rows are
beside it."""

import platform
import time

import pytest
import torch

from kvsplice.layers.block_int8_head import (BLOCK, TILE, BlockInt8Head, build_row_head, int8_blocks,
                                             tile_product_reference)
from kvsplice.layers.native_build import NativeUnavailable, find_c_compiler

needs_cc = pytest.mark.skipif(find_c_compiler() is None, reason="no C compiler: the row head's kernel cannot be built")


def q8_0_weight(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random Q8_0 blocks as llama.cpp makes them (int8 values with one of +-127 per block, fp16
    scales) and their fp32 dequantization, as kvsplice's GGUF converter writes it. Returns
    (values [V, K/32, 32] int8, scales [V, K/32] fp16, weight [V, K] fp32)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-126, 127, (out_features, in_features // BLOCK, BLOCK), generator=gen, dtype=torch.int8)
    values[..., 0] = 127 * (1 - 2 * torch.randint(0, 2, values.shape[:2], generator=gen, dtype=torch.int8))
    scales = (torch.rand(values.shape[:2], generator=gen) * 0.01 + 1e-4).half()
    weight = (values.float() * scales.float().unsqueeze(-1)).reshape(out_features, in_features)
    return values, scales, weight


def test_the_fp32_dequantization_of_q8_0_gives_back_its_values_and_scales_exactly():
    values, scales, weight = q8_0_weight(300, 4 * BLOCK)
    blocks = int8_blocks(weight)
    assert blocks is not None and blocks.in_features == 4 * BLOCK
    assert blocks.out_features == 300 and blocks.values.shape == (19, 4, 16, TILE, 2)   # 300 = 18 tiles + 12
    t, b, s, lane, j = 3, 2, 5, 7, 1   # values[t, b, s, l, j] = q[16 t + l, 32 b + 2 s + j]
    assert blocks.values[t, b, s, lane, j] == values[TILE * t + lane, b, 2 * s + j]
    assert blocks.scales.dtype == torch.float16   # held in fp16
    assert torch.equal(blocks.scales.permute(0, 2, 1).reshape(-1, 4)[:300], scales)
    assert not blocks.values[-1, :, :, 12:].any()   # the padded outputs' weights are zero
    assert torch.equal(blocks.dequantize(), weight)


def test_scales_that_are_no_fp16_numbers_stay_fp32():
    values, scales, _ = q8_0_weight(40, 2 * BLOCK)
    wide = torch.full_like(scales.float(), 2.0 ** -7 * (1 + 2.0 ** -12))   # 13 significant bits: no fp16 number
    blocks = int8_blocks((values.float() * wide.unsqueeze(-1)).reshape(40, 2 * BLOCK))
    assert blocks.scales.dtype == torch.float32 and torch.equal(blocks.scales.permute(0, 2, 1).reshape(-1, 2)[:40], wide)
    with pytest.raises(NativeUnavailable, match="fp16"):   # the kernel reads fp16 scales only
        BlockInt8Head(blocks, torch.bfloat16)


def test_weights_that_are_not_int8_blocks_have_none():
    _, _, weight = q8_0_weight(300, 4 * BLOCK)
    assert int8_blocks(weight.bfloat16()) is None          # the bf16 copy rounds d q to 8 bits
    assert int8_blocks(torch.randn(300, 4 * BLOCK)) is None
    assert int8_blocks(torch.randn(8, BLOCK + 1)) is None   # the width does not split into blocks
    late = weight.clone()
    late[-1, 5] += 1e-3                                      # past the rows checked first
    assert int8_blocks(late) is None


def test_an_all_zero_block_gets_scale_one_and_zero_values():
    weight = torch.zeros(4, 2 * BLOCK)
    weight[0, BLOCK:] = 1.0
    blocks = int8_blocks(weight)
    assert torch.equal(blocks.scales[0, 0, :4], torch.ones(4)) and not blocks.values[0, 0].any()
    assert torch.equal(blocks.dequantize(), weight)


def _head(out_features: int = 1000, blocks: int = 6, seed: int = 1, **kwargs) -> tuple[BlockInt8Head, torch.Tensor]:
    _, _, weight = q8_0_weight(out_features, blocks * BLOCK, seed=seed)
    return BlockInt8Head(int8_blocks(weight), torch.bfloat16, **kwargs), weight


@needs_cc
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_kernel_is_the_reference_product_and_closer_to_the_checkpoint_than_bf16(rows, tmp_path):
    head, weight = _head(library_dir=tmp_path)
    with torch.inference_mode():   # rows made as the engine makes its rows
        x = torch.randn(rows, 6 * BLOCK).bfloat16()
        got = head(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 1000)
    torch.testing.assert_close(got, head.reference(x), rtol=1e-6, atol=1e-6 * float(got.abs().max()))
    truth = x.double() @ weight.double().t()
    bf16 = torch.nn.functional.linear(x, weight.bfloat16()).double()
    assert (got.double() - truth).abs().max() < (bf16 - truth).abs().max() / 4


@needs_cc
def test_a_rows_logits_are_the_same_bits_whatever_rows_are_beside_it_and_whatever_the_threads(tmp_path):
    head, _ = _head(out_features=4096 + 5, library_dir=tmp_path)
    x = torch.randn(8, 6 * BLOCK).bfloat16()
    together = head(x)
    for i in (0, 5, 7):
        assert torch.equal(head(x[i:i + 1]), together[i:i + 1])
    assert torch.equal(head(x[2:6]), together[2:6])
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(head(x), together)
    finally:
        torch.set_num_threads(previous)


@needs_cc
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the AVX paths are x86's")
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")])
def test_every_code_path_gives_the_same_bits(flags, tmp_path):
    """Built without AVX-512 (the AVX2 path where the CPU has AVX2) and without AVX2 (plain C), the
    kernel gives the bits of the path this machine picks."""
    native, _ = _head(library_dir=tmp_path / "native")
    other = BlockInt8Head(native.blocks, torch.bfloat16, tmp_path / "other", extra_flags=flags)
    expected = "portable" if "-mno-avx2" in flags or native.code_path == "portable" else "avx2"
    assert other.code_path == expected
    x = torch.randn(8, 6 * BLOCK).bfloat16()
    assert torch.equal(other(x), native(x))


@needs_cc
def test_covers_up_to_max_rows_of_its_dtype_and_a_row_that_is_not_finite_returns_none(tmp_path):
    head, _ = _head(out_features=64, blocks=2, library_dir=tmp_path)
    assert head.max_rows == 8
    assert head.covers(torch.randn(1, 2 * BLOCK).bfloat16()) and head.covers(torch.randn(8, 2 * BLOCK).bfloat16())
    assert not head.covers(torch.randn(9, 2 * BLOCK).bfloat16())
    assert not head.covers(torch.randn(1, 2 * BLOCK))            # fp32
    assert not head.covers(torch.randn(1, 3 * BLOCK).bfloat16())  # another width
    wide = torch.randn(2, 4 * BLOCK).bfloat16()[:, :2 * BLOCK]     # rows of a wider tensor
    torch.testing.assert_close(head(wide), head.reference(wide), rtol=1e-6, atol=1e-5)
    broken = torch.randn(2, 2 * BLOCK).bfloat16()
    broken[1, 3] = float("inf")
    assert head(broken) is None


def test_without_a_compiler_there_is_no_row_head_and_the_log_says_why(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    _, _, weight = q8_0_weight(64, 2 * BLOCK)
    with caplog.at_level("WARNING", logger="kvsplice.layers.block_int8_head"):
        assert build_row_head(int8_blocks(weight), torch.bfloat16, tmp_path) is None
    assert "no C compiler" in caplog.text


def test_the_reference_is_the_exact_product_to_the_int16_rounding_of_the_rows():
    _, _, weight = q8_0_weight(100, 4 * BLOCK, seed=3)
    blocks = int8_blocks(weight)
    x = torch.randn(3, 4 * BLOCK).bfloat16()
    truth = x.double() @ weight.double().t()
    error = (tile_product_reference(x, blocks).double() - truth).abs().max()
    assert error < 2.0 ** -14 * truth.abs().max()


@needs_cc
def test_fit_rows_keeps_the_most_rows_it_measured_at_least_as_fast_as_the_other_head(tmp_path):
    head, weight = _head(out_features=2048, library_dir=tmp_path)
    calls = []

    def instant(x):   # no head is faster: one row only
        calls.append(x.shape[0])
        return x

    assert head.fit_rows(instant, calls=3) == 1 and head.max_rows == 1
    assert sorted(set(calls)) == [2, 4, 8] and len(calls) == 9
    assert not head.covers(torch.randn(2, 6 * BLOCK).bfloat16())

    def slow(x):      # every head is faster: all 8
        torch.nn.functional.linear(x, weight.bfloat16())
        time.sleep(0.01)
        return x

    assert head.fit_rows(slow, calls=3) == 8 and head.covers(torch.randn(8, 6 * BLOCK).bfloat16())
