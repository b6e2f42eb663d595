"""DecodeArena: rows filled from the pool, kept while their request decodes, compacted when one
leaves, grown without losing content, bounded in memory."""

from __future__ import annotations

import torch

from kvsplice.cache.decode_arena import DecodeArena
from kvsplice.cache.kv_pool import KVPool
from kvsplice.engine.request import Req
from kvsplice.sampling_params import SamplingParams

LAYERS, HEADS, DIM = 2, 2, 4


def _pool() -> KVPool:
    pool = KVPool(2048, LAYERS, HEADS, DIM)
    pool.k.copy_(torch.randn_like(pool.k))
    pool.v.copy_(torch.randn_like(pool.v))
    return pool


def _req(length: int, slots: torch.Tensor, rid: str = "r") -> Req:
    req = Req(rid, [1] * (length - 1), SamplingParams(max_tokens=600), output_ids=[2])
    req.seq_slots, req.num_slotted, req.pending = slots, length, [length - 1]
    return req


def _grow(req: Req, slot: int) -> None:
    req.output_ids.append(3)
    req.seq_slots = torch.cat([req.seq_slots, torch.tensor([slot])])


def _row_matches_pool(arena: DecodeArena, row: int, req: Req, pool: KVPool, upto: int) -> bool:
    slots = req.seq_slots[:upto]
    return bool(torch.equal(arena.k[:, row, :, :upto], pool.k[:, slots].transpose(1, 2))
                and torch.equal(arena.v[:, row, :, :upto], pool.v[:, slots].transpose(1, 2)))


def test_rows_fill_from_pool_and_count_this_steps_token(torch_seed):
    pool, arena = _pool(), DecodeArena(LAYERS, HEADS, DIM, torch.float32, max_tokens=10_000)
    a, b = _req(5, torch.randperm(2048)[:5], "a"), _req(9, torch.randperm(2048)[:9], "b")
    assert arena.assign([a, b], pool) == [a, b]
    assert arena.lengths == [5, 9]
    assert _row_matches_pool(arena, 0, a, pool, 4) and _row_matches_pool(arena, 1, b, pool, 8)
    k_new = torch.randn(2, HEADS, DIM)
    arena.write(0, k_new, k_new, torch.arange(2), torch.tensor([4, 8]))
    assert torch.equal(arena.k[0, 0, :, 4], k_new[0]) and torch.equal(arena.k[0, 1, :, 8], k_new[1])
    k_rows, _ = arena.step_views(2, 9)[0][0], None
    assert k_rows.shape == (2, HEADS, 9, DIM)


def test_a_leaving_request_is_replaced_by_the_last_row(torch_seed):
    pool, arena = _pool(), DecodeArena(LAYERS, HEADS, DIM, torch.float32, max_tokens=10_000)
    reqs = [_req(n, torch.randperm(2048)[:n], f"r{n}") for n in (3, 4, 6)]
    arena.assign(reqs, pool)
    for row, req in enumerate(reqs):   # this step's tokens reach the arena as the fast path writes them
        pool.k[:, req.seq_slots[-1]] = arena.k[:, row, :, req.seq_len - 1]
        pool.v[:, req.seq_slots[-1]] = arena.v[:, row, :, req.seq_len - 1]
    for req in reqs:
        _grow(req, 2000 + req.seq_len)
    assert arena.assign([reqs[0], reqs[2]], pool) == [reqs[0], reqs[2]]
    assert arena.lengths == [reqs[0].seq_len, reqs[2].seq_len]
    assert _row_matches_pool(arena, 1, reqs[2], pool, reqs[2].seq_len - 1)


def test_out_of_step_rows_refill_and_capacity_grows(torch_seed):
    pool, arena = _pool(), DecodeArena(LAYERS, HEADS, DIM, torch.float32, max_tokens=10_000)
    req = _req(250, torch.randperm(2048)[:250])
    arena.assign([req], pool)
    assert arena.capacity == 256
    for slot in range(300, 310):    # ten tokens appear without a step (e.g. a recompute): refilled
        _grow(req, slot)
    arena.assign([req], pool)
    assert arena.capacity > 256 and arena.lengths == [req.seq_len]
    assert _row_matches_pool(arena, 0, req, pool, req.seq_len - 1)


def test_memory_bound_leaves_requests_out(torch_seed):
    pool, arena = _pool(), DecodeArena(LAYERS, HEADS, DIM, torch.float32, max_tokens=512)
    reqs = [_req(100, torch.randperm(2048)[:100], f"r{i}") for i in range(3)]
    held = arena.assign(reqs, pool)
    assert held == reqs[:2] and arena.rows * arena.capacity <= 512
    arena.clear()
    assert arena.assign([], pool) == [] and arena.rows == 0


def test_min_rows_holds_at_least_that_many_rows(torch_seed):
    """The compiled decode step's graphs take arenas of 2 rows or more: one request still gets 2."""
    pool, arena = _pool(), DecodeArena(LAYERS, HEADS, DIM, torch.float32, max_tokens=10_000, min_rows=2)
    req = _req(5, torch.randperm(2048)[:5])
    assert arena.assign([req], pool) == [req]
    assert arena.rows == 2 and arena.lengths == [5] and _row_matches_pool(arena, 0, req, pool, 4)
    tight = DecodeArena(LAYERS, HEADS, DIM, torch.float32, max_tokens=300, min_rows=2)
    assert tight.assign([_req(200, torch.randperm(2048)[:200])], pool) == []   # 2 rows x 256 do not fit
    grows = DecodeArena(LAYERS, HEADS, DIM, torch.float32, max_tokens=600, min_rows=2)
    long = _req(250, torch.randperm(2048)[:250])
    assert grows.assign([long], pool) == [long]
    for slot in range(10):   # past 256 positions: 2 rows x 512 would break the bound, so the row goes
        _grow(long, 1900 + slot)
        held = grows.assign([long], pool)
        assert grows.rows * grows.capacity <= 600
    assert held == []
