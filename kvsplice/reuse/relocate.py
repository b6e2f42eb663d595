"""Relocate: copy a span's K/V to new slots and turn its keys to the new positions.

The only tensor code of the reuse package. For one kept span (see `plan.Keep`):

    old sequence   ... [ src_pos ........ src_pos+length ) ...      K rotated at src positions
                              | copy every layer's K and V
                              v
    new sequence   ........ [ dst_pos ........ dst_pos+length ) ... K turned by delta = dst - src

Keys are stored after RoPE, and rotations in the same planes compose
(R(src + delta) = R(delta) R(src), RoFormer, Su et al. 2021, eq. 13-16), so one rotation by
delta in fp32 gives exactly the key a fresh forward at dst would have stored - for the token's
own projection. What it cannot fix is that the K/V were computed while attending to the old
context: that is SCR's approximation, bounded by recomputing each span's tail.
V is position-free and is copied as is.
"""

from __future__ import annotations

import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.layers.rotary import Rotary


def relocate(pool: KVPool, src_slots: torch.Tensor, dst_slots: torch.Tensor, delta: int,
             rotary: Rotary | None) -> None:
    """Copy K/V of `src_slots` into `dst_slots` in every layer, keys re-rotated by `delta`
    positions (skipped when `rotary` is None: the KVREUSE_NO_REROTATE control).

    Side effect: writes pool.k / pool.v at dst_slots. src and dst must not overlap.
    """
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(f"{src_slots.numel()} source slots but {dst_slots.numel()} destinations")
    keys = pool.k[:, src_slots]                                   # [layers, n, kv_heads, head_dim]
    if rotary is not None and delta != 0:
        layers, n, heads, dim = keys.shape
        # one [n, layers*heads, dim] call: cos/sin of delta are computed once per token
        flat = keys.permute(1, 0, 2, 3).reshape(n, layers * heads, dim)
        deltas = torch.full((n,), delta, dtype=torch.int64, device=keys.device)
        flat = rotary.rerotate(flat, deltas)
        keys = flat.reshape(n, layers, heads, dim).permute(1, 0, 2, 3)
    pool.k[:, dst_slots] = keys
    pool.v[:, dst_slots] = pool.v[:, src_slots]
