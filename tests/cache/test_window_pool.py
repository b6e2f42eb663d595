"""WindowedKVPool bookkeeping: window slots follow full slots, the usable-prefix rule, trimming
checkpoints, and the translation check that refuses a window the pool no longer holds."""

from __future__ import annotations

import pytest
import torch

from kvsplice.cache.window_pool import WindowedKVPool, WindowKeep, default_window_slots, usable_prefix
from kvsplice.layers.forward_batch import ForwardBatch

WINDOWS = (4, 4, None, 4)


def _pool(num_slots: int = 32, window_slots: int = 12) -> WindowedKVPool:
    return WindowedKVPool(num_slots, WINDOWS, num_kv_heads=2, head_dim=4, window_slots=window_slots)


def test_layers_live_in_their_own_slot_spaces():
    pool = _pool()
    assert pool.full_layers == (2,) and pool.sliding_layers == (0, 1, 3)
    assert pool.k_layer(2).shape[0] == 32 and pool.k_layer(0).shape[0] == 12
    assert pool.k.shape[0] == 1   # what relocation and other all-layer readers see: the full layers
    assert pool.bytes_per_slot() == pool.full_bytes_per_slot() + pool.window_bytes_per_slot()
    assert pool.window_bytes_per_slot() == 3 * pool.full_bytes_per_slot()


def test_window_slots_follow_their_full_slots():
    pool = _pool()
    slots = pool.allocator.alloc(16)
    assert pool.ensure_window(slots[:6]) and pool.window_allocator.num_used == 6
    assert pool.ensure_window(slots[:8]) and pool.window_allocator.num_used == 8   # only the lacking ones
    assert not pool.ensure_window(slots)                                           # 8 lacking, 4 free
    assert pool.window_allocator.num_used == 8                                     # nothing taken on failure
    assert pool.drop_window(slots[:3]) == 3 and pool.window_allocator.num_used == 5
    pool.allocator.incref(slots[3:4])
    pool.allocator.free(slots)                  # slot 3 still referenced: keeps its window
    assert pool.window_allocator.num_used == 1
    pool.check_integrity()
    pool.allocator.free(slots[3:4])
    assert pool.window_allocator.num_free == pool.window_slots and not bool(pool.has_window.any())
    pool.check_integrity()


def test_usable_prefix_needs_the_window_before_the_cut():
    held = torch.tensor([1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    assert usable_prefix(held, 3) == 11
    assert usable_prefix(held[:9], 3) == 9          # tokens 7, 8 held
    assert usable_prefix(held[:8], 3) == 3          # token 6 missing, and 3: back to 3 (tokens 1, 2 held)
    assert usable_prefix(torch.zeros(5, dtype=torch.bool), 3) == 0
    assert usable_prefix(torch.zeros(5, dtype=torch.bool), 1) == 5   # a window of 1 needs nothing before


def test_checkpoints_are_spaced_and_protect_their_window():
    keep = WindowKeep(window=4, tail_keep=8, checkpoint_spacing=10)
    assert keep.checkpoints([3, 5, 14, 20, 25]) == (3, 14, 25)
    assert keep.protected([3, 14]) == [range(0, 3), range(10, 14)]


def test_translate_refuses_a_window_it_does_not_hold():
    pool = _pool()
    slots = pool.allocator.alloc(8)
    pool.ensure_window(slots)
    batch = ForwardBatch.single(torch.zeros(2, dtype=torch.int64), torch.tensor([6, 7]), slots[6:8],
                                slots, torch.arange(8))
    window = pool.translate(batch)
    assert torch.equal(window.out_slots, pool.window_of[slots[6:8]])
    assert window.seqs[0].context_slots.numel() == 8
    pool.drop_window(slots[:3])              # positions 0..2: outside the window (4..7] of query 7, (3..6] of 6
    assert pool.translate(batch).seqs[0].context_pos.tolist() == [3, 4, 5, 6, 7]
    pool.drop_window(slots[3:4])             # position 3 is inside query 6's window
    with pytest.raises(RuntimeError, match="no longer holds"):
        pool.translate(batch)


def test_default_window_slots_stay_within_the_pool():
    assert default_window_slots(1000, 512, 2048, 8) == 1000
    assert default_window_slots(65_536, 512, 2048, 1) == 65_536 // 8 + 3 * 512 + 2048


def test_spare_windows_are_given_back_oldest_first_never_a_kept_one():
    pool = _pool()
    slots = pool.allocator.alloc(12)
    assert pool.ensure_window(slots)
    assert pool.mark_spare(slots[:4]) == 4 and pool.mark_spare(slots[4:8]) == 4
    assert pool.mark_spare(slots[:2]) == 0 and pool.spare_windows() == 8   # marked once, when first spare
    keep = torch.zeros(pool.num_slots, dtype=torch.bool)
    keep[slots[1]] = True
    assert pool.drop_spare(3, keep) == 3                                   # the oldest, except the kept one
    assert pool.has_window[slots].tolist() == [False, True, False, False] + [True] * 8
    assert pool.spare_windows() == 5 and pool.drop_spare(10, keep) == 4    # slot 1 stays
    assert pool.has_window[slots[1]] and pool.spare_windows() == 1
    pool.allocator.free(slots)
    assert pool.spare_windows() == 0 and pool.window_allocator.num_free == pool.window_slots
    pool.check_integrity()


class _Turn:
    """A rotary stand-in: turning a key by the position delta adds it (so the test can see it)."""

    def move_keys(self, keys, src_pos, dst_pos):
        return keys + (dst_pos - src_pos).to(keys.dtype)[:, None, None]


def test_move_window_hands_the_window_slot_over_with_its_keys_turned():
    pool = _pool()
    src, dst = pool.allocator.alloc(3), pool.allocator.alloc(3)
    assert pool.ensure_window(src)
    held = pool.window_of[src].clone()
    pool.window_k[:, held] = 1.0
    pool.window_v[:, held] = 2.0
    pool.move_window(src, dst, torch.tensor([10, 11, 12]), torch.tensor([4, 5, 6]), _Turn())
    assert not bool(pool.has_window[src].any()) and bool(pool.has_window[dst].all())
    assert torch.equal(pool.window_of[dst], held) and pool.window_allocator.num_used == 3
    assert bool((pool.window_k[:, held] == -5.0).all()) and bool((pool.window_v[:, held] == 2.0).all())
    with pytest.raises(ValueError, match="move_window"):
        pool.move_window(src, dst, torch.tensor([4, 5, 6]), torch.tensor([4, 5, 6]), None)
    pool.check_integrity()


def test_default_window_slots_hold_the_longest_sequence_beside_a_chunk():
    """An edited turn as long as the model's context relocates the sliding-layer K/V of the whole
    previous turn: the default pool keeps that many windows, plus one request's working set."""
    assert default_window_slots(65_536, 512, 2048, 8, longest=32_768) == 32_768 + 3 * 512 + 2048
    assert default_window_slots(65_536, 512, 2048, 8, longest=1024) == 65_536 // 8 + 2 * (3 * 512 + 2048)
    assert default_window_slots(20_000, 512, 2048, 8, longest=32_768) == 20_000   # never above the pool
