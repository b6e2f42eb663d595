"""kvsplice.layers.block_int8_head: the checkpoint's Q8_0 blocks recovered exactly from their fp32
dequantization (and nothing else taken for blocks), and the compiled one-row loop computing them."""

import torch

from kvsplice.layers.block_int8_head import BLOCK, BlockInt8Head, int8_blocks


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
    assert torch.equal(blocks.values, values.permute(1, 2, 0))
    assert blocks.scales.dtype == torch.float16 and torch.equal(blocks.scales, scales.t())   # held in fp16
    assert torch.equal(blocks.dequantize(), weight)


def test_scales_that_are_no_fp16_numbers_stay_fp32():
    values, scales, _ = q8_0_weight(40, 2 * BLOCK)
    wide = torch.full_like(scales.float(), 2.0 ** -7 * (1 + 2.0 ** -12))   # 13 significant bits: no fp16 number
    blocks = int8_blocks((values.float() * wide.unsqueeze(-1)).reshape(40, 2 * BLOCK))
    assert blocks.scales.dtype == torch.float32 and torch.equal(blocks.scales, wide.t())


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
    assert torch.equal(blocks.scales[0], torch.ones(4)) and not blocks.values[0].any()
    assert torch.equal(blocks.dequantize(), weight)


def test_the_compiled_row_is_the_block_product_and_closer_to_the_checkpoint_than_bf16():
    _, _, weight = q8_0_weight(1000, 6 * BLOCK, seed=1)
    head = BlockInt8Head(int8_blocks(weight), torch.bfloat16)
    with torch.inference_mode():   # a row made as the engine makes its rows
        x = torch.randn(1, 6 * BLOCK).bfloat16()
        got = head(x)
    assert got.dtype == torch.float32 and got.shape == (1, 1000)
    torch.testing.assert_close(got, head.reference(x), rtol=1e-5, atol=1e-5)
    truth = x.double() @ weight.double().t()
    bf16 = torch.nn.functional.linear(x, weight.bfloat16()).double()
    assert (got.double() - truth).abs().max() < (bf16 - truth).abs().max() / 4


def test_covers_one_contiguous_row_of_its_dtype_only_and_a_refused_call_returns_none():
    _, _, weight = q8_0_weight(64, 2 * BLOCK)
    head = BlockInt8Head(int8_blocks(weight), torch.bfloat16)
    row = torch.randn(1, 2 * BLOCK).bfloat16()
    assert head.covers(row)
    assert not head.covers(torch.randn(2, 2 * BLOCK).bfloat16())
    assert not head.covers(row.float())
    assert not head.covers(torch.randn(2 * BLOCK, 2).bfloat16().t()[:1])   # inputs not adjacent
    with torch.inference_mode():   # a row of a wider tensor: another row stride, the same loop
        wide = torch.randn(1, 4 * BLOCK).bfloat16()[:, :2 * BLOCK]
        assert head.covers(wide)
        torch.testing.assert_close(head(wide), head.reference(wide), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        assert head(torch.randn(1, 2 * BLOCK)) is None   # fp32: the guards refuse, nothing compiles
    assert head.fallbacks == 1
