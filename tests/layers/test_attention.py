"""paged_attention against a hand-written softmax attention over explicit position-ordered K/V."""

from __future__ import annotations

import math

import pytest
import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.layers.attention import paged_attention, position_mask, store_kv
from kvsplice.layers.forward_batch import ForwardBatch, SeqSlice

HQ, HKV, D = 4, 2, 8


def _naive_attention(q, k, v, q_pos, k_pos, window=None):
    """Loop-per-row softmax attention; k/v `[C, Hkv, D]` with positions k_pos; GQA by head // group."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for row in range(q.shape[0]):
        for head in range(q.shape[1]):
            visible = [c for c in range(k.shape[0]) if k_pos[c] <= q_pos[row]
                       and (window is None or k_pos[c] > q_pos[row] - window)]
            scores = torch.stack([q[row, head] @ k[c, head // group] for c in visible]) / math.sqrt(D)
            weights = torch.softmax(scores, dim=0)
            out[row, head] = sum(w * v[c, head // group] for w, c in zip(weights, visible))
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_two_requests_scattered_slots_match_naive(torch_seed, window):
    pool = KVPool(64, 1, HKV, D)
    seqs, qs, pos_list, slot_list, expected = [], [], [], [], []
    start = 0
    free_slots = torch.randperm(64)  # two disjoint sets of slots scattered over the pool
    for ctx_len, q_len in ((12, 4), (9, 1)):
        slots, free_slots = free_slots[:ctx_len], free_slots[ctx_len:]
        k, v = torch.randn(ctx_len, HKV, D), torch.randn(ctx_len, HKV, D)
        ctx_pos = torch.arange(ctx_len)
        q = torch.randn(q_len, HQ, D)
        q_pos = ctx_pos[-q_len:]
        # K/V of earlier tokens already cached; those of the query rows are written by store_kv below
        store_kv(k[:-q_len], v[:-q_len], 0, slots[:-q_len], pool)
        order = torch.randperm(ctx_len)  # context listed out of position order
        seqs.append(SeqSlice(start, q_len, slots[order], ctx_pos[order]))
        qs.append(q), pos_list.append(q_pos), slot_list.append(slots)
        expected.append(_naive_attention(q, k, v, q_pos, ctx_pos, window))
        store_kv(k[-q_len:], v[-q_len:], 0, slots[-q_len:], pool)
        start += q_len
    out_slots = torch.cat([slots[-len(q):] for slots, q in zip(slot_list, qs)])
    batch = ForwardBatch(torch.zeros(start, dtype=torch.long), torch.cat(pos_list), out_slots, tuple(seqs),
                         torch.arange(start))
    out = paged_attention(torch.cat(qs), 0, batch, pool, D ** -0.5, sliding_window=window)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_store_kv_writes_only_given_slots_in_pool_dtype(torch_seed):
    pool = KVPool(10, 2, HKV, D, dtype=torch.bfloat16)
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    slots = torch.tensor([7, 2, 5])
    store_kv(k, v, 1, slots, pool)
    assert torch.equal(pool.k_layer(1)[slots], k.to(torch.bfloat16))
    assert torch.equal(pool.v_layer(1)[slots], v.to(torch.bfloat16))
    untouched = torch.tensor([0, 1, 3, 4, 6, 8, 9])
    assert not pool.k_layer(1)[untouched].any() and not pool.k_layer(0).any()


def test_position_mask_is_by_position_not_order():
    mask = position_mask(torch.tensor([1, 3]), torch.tensor([3, 0, 2, 1]))
    assert mask.tolist() == [[False, True, False, True], [True, True, True, True]]
    windowed = position_mask(torch.tensor([3]), torch.tensor([3, 0, 2, 1]), sliding_window=2)
    assert windowed.tolist() == [[True, False, True, False]]


def test_bf16_query_against_fp32_pool(torch_seed):
    pool = KVPool(8, 1, HKV, D)
    k, v = torch.randn(8, HKV, D), torch.randn(8, HKV, D)
    slots, pos = torch.arange(8), torch.arange(8)
    store_kv(k, v, 0, slots, pool)
    q = torch.randn(8, HQ, D)
    batch = ForwardBatch.single(torch.zeros(8, dtype=torch.long), pos, slots, slots, pos, all_logits=True)
    out = paged_attention(q.to(torch.bfloat16), 0, batch, pool, D ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _naive_attention(q, k, v, pos, pos), atol=0.05, rtol=0.05)


def test_plain_causal_prefill_shortcut_equals_position_mask(torch_seed):
    """Ordered context == queries takes SDPA's is_causal path; listing it permuted takes the mask path."""
    pool = KVPool(16, 1, HKV, D)
    slots, pos = torch.arange(3, 13), torch.arange(10)
    k, v, q = torch.randn(10, HKV, D), torch.randn(10, HKV, D), torch.randn(10, HQ, D)
    store_kv(k, v, 0, slots, pool)
    ids = torch.zeros(10, dtype=torch.long)
    ordered = ForwardBatch.single(ids, pos, slots, slots, pos, all_logits=True)
    order = torch.randperm(10)
    permuted = ForwardBatch.single(ids, pos, slots, slots[order], pos[order], all_logits=True)
    fast = paged_attention(q, 0, ordered, pool, D ** -0.5)
    torch.testing.assert_close(fast, paged_attention(q, 0, permuted, pool, D ** -0.5), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fast, _naive_attention(q, k, v, pos, pos), atol=1e-5, rtol=1e-5)


def test_batched_decode_path_equals_the_reference(torch_seed):
    """A pure decode step of several requests (different context lengths, scattered and permuted
    slots) takes the padded single-call path; it must equal the per-request reference."""
    from kvsplice.layers.attention import paged_attention_reference

    pool = KVPool(128, 1, HKV, D)
    pool.k[0] = torch.randn(128, HKV, D)
    pool.v[0] = torch.randn(128, HKV, D)
    free_slots = torch.randperm(128)
    seqs, positions = [], []
    for row, ctx_len in enumerate((5, 17, 1, 30)):
        slots, free_slots = free_slots[:ctx_len], free_slots[ctx_len:]
        order = torch.randperm(ctx_len)                 # context listed out of position order
        seqs.append(SeqSlice(row, 1, slots[order], torch.arange(ctx_len)[order]))
        positions.append(ctx_len - 1)
    q = torch.randn(len(seqs), HQ, D)
    batch = ForwardBatch(torch.zeros(len(seqs), dtype=torch.int64), torch.tensor(positions),
                         torch.zeros(len(seqs), dtype=torch.int64), tuple(seqs), torch.arange(len(seqs)))
    assert batch.padded_decode is not None
    fast = paged_attention(q, 0, batch, pool, 1 / math.sqrt(D))
    reference = paged_attention_reference(q, 0, batch, pool, 1 / math.sqrt(D))
    torch.testing.assert_close(fast, reference, atol=1e-6, rtol=1e-5)


def test_contiguous_decode_attention_masks_by_length(torch_seed):
    from kvsplice.layers.attention import contiguous_decode_attention, length_mask

    lengths = torch.tensor([3, 7])
    q, k, v = torch.randn(2, HQ, D), torch.randn(2, HKV, 7, D), torch.randn(2, HKV, 7, D)
    out = contiguous_decode_attention(q, k, v, length_mask(lengths, 7), D ** -0.5)
    for row, n in enumerate(lengths.tolist()):
        positions = torch.arange(n)
        expected = _naive_attention(q[row:row + 1], k[row, :, :n].transpose(0, 1), v[row, :, :n].transpose(0, 1),
                                    positions[-1:], positions)
        torch.testing.assert_close(out[row:row + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_len, context_len, permute, window", [
    (100, 100, False, None),    # plain causal prefill: queries and keys padded alike
    (70, 150, False, None),     # a chunk after cached context: masked, both padded
    (3, 90, True, None),        # a few rows over a permuted context: power-of-two query padding
    (65, 130, False, 40),       # sliding window
])
def test_bf16_padding_is_invisible(torch_seed, query_len, context_len, permute, window):
    """In bf16 the reference pads queries and context to bucket sizes; the real rows' output must be
    the attention over the real context alone (naive fp32 over the same bf16 values)."""
    pool = KVPool(256, 1, HKV, D, dtype=torch.bfloat16)
    slots, pos = torch.randperm(256)[:context_len], torch.arange(context_len)
    k, v = torch.randn(context_len, HKV, D), torch.randn(context_len, HKV, D)
    store_kv(k, v, 0, slots, pool)
    order = torch.randperm(context_len) if permute else torch.arange(context_len)
    q = torch.randn(query_len, HQ, D).to(torch.bfloat16)
    q_pos = pos[-query_len:]
    batch = ForwardBatch.single(torch.zeros(query_len, dtype=torch.long), q_pos, slots[-query_len:],
                                slots[order], pos[order], all_logits=True)
    out = paged_attention(q, 0, batch, pool, D ** -0.5, sliding_window=window)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    expected = _naive_attention(q.float(), pool.k_layer(0)[slots].float(), pool.v_layer(0)[slots].float(),
                                q_pos, pos, window)
    torch.testing.assert_close(out.float(), expected, atol=0.03, rtol=0.03)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_len, first_slot", [(1, 10), (5, 10), (30, 0), (30, 98)])
def test_a_context_in_one_run_of_slots_is_read_as_a_view(torch_seed, dtype, query_len, first_slot):
    """A context whose slots are one ascending run is read from the pool without a gather, padding
    included (the slots after the run hold other entries: masked, they must not count); a run whose
    padding would pass the pool's end is gathered. Both equal the naive attention."""
    from kvsplice.layers.attention import plan_sequence

    context_len, num_slots = 30, 128
    pool = KVPool(num_slots, 1, HKV, D, dtype=dtype)
    pool.k[0], pool.v[0] = 50 * torch.randn(num_slots, HKV, D), 50 * torch.randn(num_slots, HKV, D)  # junk
    slots, pos = torch.arange(first_slot, first_slot + context_len), torch.arange(context_len)
    store_kv(torch.randn(context_len, HKV, D), torch.randn(context_len, HKV, D), 0, slots, pool)
    q = torch.randn(query_len, HQ, D).to(dtype)
    q_pos = pos[-query_len:]
    plan = plan_sequence(q_pos, slots, pos, num_slots, dtype)
    padded_end = first_slot + (32 if dtype is torch.bfloat16 else context_len)
    assert (plan.run_start is not None) == (padded_end <= num_slots)
    batch = ForwardBatch.single(torch.zeros(query_len, dtype=torch.long), q_pos, slots[-query_len:], slots, pos,
                                all_logits=True)
    out = paged_attention(q, 0, batch, pool, D ** -0.5)
    expected = _naive_attention(q.float(), pool.k_layer(0)[slots].float(), pool.v_layer(0)[slots].float(), q_pos, pos)
    tolerance = 0.03 if dtype is torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_a_run_too_close_to_the_pool_end_is_gathered():
    from kvsplice.layers.attention import plan_sequence

    slots = torch.arange(100, 128)        # 28 slots, padded to 32 in bf16: 132 > 128
    plan = plan_sequence(torch.arange(28), slots, torch.arange(28), 128, torch.bfloat16)
    assert plan.run_start is None and plan.slots.numel() == 32
    assert plan_sequence(torch.arange(28), slots, torch.arange(28), 128, torch.float32).run_start == 100
    scattered = plan_sequence(torch.arange(3), torch.tensor([4, 6, 5]), torch.arange(3), 128, torch.float32)
    assert scattered.run_start is None


@pytest.mark.parametrize("query_len", [3, 16, 40])
def test_folded_query_heads_give_the_same_attention(torch_seed, query_len):
    """A masked attention of at most FOLD_MAX_QUERY_ROWS rows stacks each kv head's q heads as rows
    of one head; the result is the unfolded one's."""
    from kvsplice.layers.attention import FOLD_MAX_QUERY_ROWS, plan_sequence, planned_attention

    context_len = 60
    pool = KVPool(128, 1, HKV, D, dtype=torch.bfloat16)
    slots, pos = torch.randperm(128)[:context_len], torch.arange(context_len)
    store_kv(torch.randn(context_len, HKV, D), torch.randn(context_len, HKV, D), 0, slots, pool)
    q = torch.randn(query_len, HQ, D).to(torch.bfloat16)
    q_pos = pos[-query_len:]
    folded = plan_sequence(q_pos, slots, pos, 128, torch.bfloat16, group=HQ // HKV)
    plain = plan_sequence(q_pos, slots, pos, 128, torch.bfloat16)
    padded_rows = folded.pad_q + query_len
    assert folded.fold == (HQ // HKV if padded_rows <= FOLD_MAX_QUERY_ROWS else 1) and plain.fold == 1
    assert folded.mask.shape[0] == folded.fold * padded_rows
    got = planned_attention(q, folded, pool.k_layer(0), pool.v_layer(0), D ** -0.5)
    expected = planned_attention(q, plain, pool.k_layer(0), pool.v_layer(0), D ** -0.5)
    torch.testing.assert_close(got, expected)
    causal = plan_sequence(pos[:8], slots[:8], pos[:8], 128, torch.bfloat16, group=HQ // HKV)
    assert causal.causal and causal.fold == 1
