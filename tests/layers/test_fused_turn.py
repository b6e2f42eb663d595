"""The fused key turn (`kvsplice.layers.fused_turn`): its function equals the eager turn
(`rotary_move.turn_layer_keys_`) bit for bit; compiled by inductor it still does, inside
`relocate` too; where compiling fails or a bit differs, the eager turn serves with the reason."""

from __future__ import annotations

import pytest
import torch

from kvsplice.layers.fused_turn import FusedTurn, build_fused_turn, turned_rotary_part
from kvsplice.layers.rotary import LayerRotaries, Rotary
from kvsplice.layers.rotary_move import span_turn, turn_layer_keys_
from kvsplice.models.compile_choice import find_cpp_compiler
from kvsplice.reuse.plan import Keep
from kvsplice.reuse.relocate import relocate, relocate_reference, relocate_spans
from tests.layers.test_rotary_move import HEAD_DIM, _rope, _stored_pool

needs_compiler = pytest.mark.skipif(find_cpp_compiler() is None, reason="no C++ compiler for inductor")


def _keys(length: int, dtype: torch.dtype, heads: int = 3, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(length, heads, HEAD_DIM, generator=generator) * 4).to(dtype)


def _eager_fused(keys: torch.Tensor, turn) -> torch.Tensor:
    """`FusedTurn` over the uncompiled function: what inductor is asked to fuse."""
    return FusedTurn(turned_rotary_part)(keys, turn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind, partial", [("default", 1.0), ("yarn", 0.5), ("llama3", 1.0)])
def test_the_function_is_the_eager_turn_bit_for_bit(dtype, kind, partial):
    rotary = Rotary(_rope(kind, partial))
    keys = _keys(300, dtype)
    for src, dst in ((2000, 5), (5, 3000)):
        turn = span_turn(rotary, src, dst, 300, dtype)
        turned = _eager_fused(keys.clone(), turn)
        assert torch.equal(turned, turn_layer_keys_(keys.clone(), turn))
        assert not torch.equal(turned, keys)   # the test can fail: the keys did turn


def test_fp32_turns_and_empty_spans_take_the_eager_turn():
    rotary = Rotary(_rope("default"))
    keys = _keys(50, torch.float32)
    turn = span_turn(rotary, 100, 7, 50, torch.float32)

    def never(*_):
        raise AssertionError("the compiled turn is for low-precision keys only")

    assert torch.equal(FusedTurn(never)(keys.clone(), turn), turn_layer_keys_(keys.clone(), turn))
    empty = _keys(0, torch.bfloat16)
    assert FusedTurn(never)(empty, span_turn(rotary, 100, 7, 0, torch.bfloat16)).shape == empty.shape


def test_float32_keys_are_not_compiled():
    choice = build_fused_turn(torch.float32, 2, HEAD_DIM, [Rotary(_rope("default"))],
                              compile_fn=lambda fn: pytest.fail("nothing to compile for fp32 keys"))
    assert choice.turner is turn_layer_keys_
    assert "float32" in choice.reason


def test_a_compile_failure_leaves_the_eager_turn_with_the_reason():
    def broken(fn):
        raise RuntimeError("no compiler here\nmore lines")

    choice = build_fused_turn(torch.bfloat16, 2, HEAD_DIM, [Rotary(_rope("default"))], compile_fn=broken)
    assert choice.turner is turn_layer_keys_
    assert "RuntimeError: no compiler here" in choice.reason and "more lines" not in choice.reason


def test_a_compiled_turn_with_other_bits_is_refused():
    def off_by_one_ulp(fn):
        return lambda keys, *tables: (fn(keys, *tables).view(torch.int16) + 1).view(keys.dtype)

    choice = build_fused_turn(torch.bfloat16, 2, HEAD_DIM, [Rotary(_rope("default"))], compile_fn=off_by_one_ulp)
    assert choice.turner is turn_layer_keys_
    assert "differs" in choice.reason


@pytest.fixture(scope="module")
def compiled_bf16():
    rotaries = [Rotary(_rope("default")), Rotary(_rope("yarn", 0.5))]
    choice = build_fused_turn(torch.bfloat16, 2, HEAD_DIM, rotaries)
    assert isinstance(choice.turner, FusedTurn), choice.reason
    return choice.turner


@needs_compiler
@pytest.mark.parametrize("kind, partial", [("default", 1.0), ("yarn", 0.5)])
@pytest.mark.parametrize("length, delta", [(2, 900), (517, -333), (1200, 41)])
def test_compiled_relocation_equals_the_reference(compiled_bf16, kind, partial, length, delta):
    rotary = Rotary(_rope(kind, partial))
    keep = Keep(src_pos=1000, dst_pos=1000 + delta, length=length)
    for dst in (torch.arange(2 * length, 3 * length), torch.arange(2 * length, 3 * length).flip(0)):
        fused, reference = (_stored_pool(rotary, 3, 2, torch.bfloat16, keep, seed=length) for _ in range(2))
        src = torch.arange(length)
        relocate(fused, src, dst, keep, rotary, turner=compiled_bf16)
        relocate_reference(reference, src, dst, keep, rotary)
        assert torch.equal(fused.k, reference.k) and torch.equal(fused.v, reference.v)
        assert not torch.equal(fused.k[:, dst], fused.k[:, src])


@needs_compiler
def test_compiled_relocation_turns_each_layer_with_its_own_rope(compiled_bf16):
    ropes = (_rope("default"), _rope("yarn", 0.5), _rope("default"))
    rotary = LayerRotaries(ropes, (0, 1, 2))
    keep = Keep(src_pos=50, dst_pos=700, length=90)
    fused, reference = (_stored_pool(rotary, 3, 2, torch.bfloat16, keep, seed=1) for _ in range(2))
    src, dst = torch.arange(90), torch.arange(180, 270)
    relocate(fused, src, dst, keep, rotary, turner=compiled_bf16)
    relocate_reference(reference, src, dst, keep, rotary)
    assert torch.equal(fused.k, reference.k)


@needs_compiler
def test_compiled_relocation_of_many_spans_equals_each_span_alone(compiled_bf16):
    from tests.reuse.test_relocate_spans import _pool, _spans

    rotary = Rotary(_rope("yarn", 0.5))
    together, alone = _pool(torch.bfloat16), _pool(torch.bfloat16)
    relocate_spans(together, _spans(), rotary, turner=compiled_bf16)
    for src, dst, keep in _spans():
        relocate(alone, src, dst, keep, rotary)
    assert torch.equal(together.k, alone.k) and torch.equal(together.v, alone.v)
