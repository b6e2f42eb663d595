"""`relocate_spans`: all of an edit's spans moved in one pass per layer give the bits of moving each
span alone with `relocate` (deltas of both signs and zero, every pool dtype, a RoPE per layer)."""

from __future__ import annotations

import pytest
import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.layers.rotary import LayerRotaries, Rotary
from kvsplice.reuse.plan import Keep
from kvsplice.reuse.relocate import relocate, relocate_spans
from tests.layers.test_rotary_move import HEAD_DIM, _rope

# old positions 0..399 in slots 0..399; the new sequence's slots start at 1000 (scattered for one span)
KEEPS = (Keep(src_pos=0, dst_pos=0, length=40),        # delta 0: copied, not turned
         Keep(src_pos=60, dst_pos=45, length=90),      # moved back
         Keep(src_pos=150, dst_pos=200, length=120),   # moved forward
         Keep(src_pos=300, dst_pos=330, length=70))


def _pool(dtype: torch.dtype, layers: int = 3, seed: int = 0) -> KVPool:
    generator = torch.Generator().manual_seed(seed)
    pool = KVPool(1600, layers, 2, HEAD_DIM, dtype=dtype)
    pool.k[:, :400] = (torch.randn(layers, 400, 2, HEAD_DIM, generator=generator) * 3).to(dtype)
    pool.v[:, :400] = torch.randn(layers, 400, 2, HEAD_DIM, generator=generator).to(dtype)
    return pool


def _spans(keeps=KEEPS) -> list[tuple[torch.Tensor, torch.Tensor, Keep]]:
    old_slots, new_slots = torch.arange(400), torch.arange(1000, 1500)
    new_slots[200:320] = new_slots[200:320].flip(0)   # one destination run not ascending
    return [(old_slots[k.src_pos:k.src_end], new_slots[k.dst_pos:k.dst_end], k) for k in keeps]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary", [Rotary(_rope("default")), Rotary(_rope("yarn", 0.5)),
                                    LayerRotaries((_rope("default"), _rope("llama3"), _rope("default")), (0, 1, 2)),
                                    None])
def test_all_spans_at_once_equal_each_span_alone(dtype, rotary):
    together, alone = _pool(dtype), _pool(dtype)
    relocate_spans(together, _spans(), rotary)
    for src, dst, keep in _spans():
        relocate(alone, src, dst, keep, rotary)
    assert torch.equal(together.k, alone.k) and torch.equal(together.v, alone.v)
    if rotary is not None:   # the test can fail: the moved keys did turn, the delta-0 span did not
        src, dst, _ = _spans()[1]
        assert not torch.equal(together.k[:, dst], together.k[:, src])
        src, dst, _ = _spans()[0]
        assert torch.equal(together.k[:, dst], together.k[:, src])


def test_no_spans_and_a_bad_span_length():
    pool = _pool(torch.bfloat16)
    before = pool.k.clone()
    relocate_spans(pool, [], Rotary(_rope("default")))
    assert torch.equal(pool.k, before)
    with pytest.raises(ValueError, match="source slots"):
        relocate_spans(pool, [(torch.arange(3), torch.arange(1000, 1004), Keep(0, 0, 4))], None)
