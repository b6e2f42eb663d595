"""Relocate: copy a span's K/V to new slots and turn its keys to the new positions.

The only tensor code of the reuse package. For one kept span (see `plan.Keep`):

    old sequence   ... [ src_pos ........ src_pos+length ) ...      K rotated at src positions
                              | copy every layer's K and V
                              v
    new sequence   ........ [ dst_pos ........ dst_pos+length ) ... K turned to dst positions

Keys are stored after RoPE, and rotations in the same planes compose
(R(src + delta) = R(delta) R(src), RoFormer, Su et al. 2021, eq. 13-16), so turning a stored key
gives the key a fresh forward at dst would have stored - for the token's own projection. In fp32
that is one turn by delta. In bf16 / fp16 the stored key is already rounded, and a turn by delta
would round it a second time; `kvsplice.layers.rotary.move_keys` turns it back to the projection's
grid first and rounds once at dst, as the forward does. What relocation cannot fix is that the K/V
were computed while attending to the old context: that is SCR's approximation, bounded by
recomputing each span's tail. V is position-free and is copied as is.
"""

from __future__ import annotations

import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.layers.rotary import Rotary
from kvsplice.reuse.plan import Keep


def relocate(pool: KVPool, src_slots: torch.Tensor, dst_slots: torch.Tensor, keep: Keep,
             rotary: Rotary | None) -> None:
    """Copy K/V of `src_slots` (the old sequence's positions keep.src_pos ...) into `dst_slots`
    (positions keep.dst_pos ...) in every layer, keys turned to the new positions (skipped when
    `rotary` is None: the NO_REROTATE control, ReuseConfig.no_rerotate, set only in code).

    Side effect: writes pool.k / pool.v at dst_slots. src and dst must not overlap.
    """
    if not src_slots.numel() == dst_slots.numel() == keep.length:
        raise ValueError(f"{src_slots.numel()} source slots and {dst_slots.numel()} destinations "
                         f"for a span of {keep.length}")
    keys = pool.k[:, src_slots]                                   # [layers, n, kv_heads, head_dim]
    if rotary is not None and keep.delta != 0:
        layers, n, heads, dim = keys.shape
        # one [n, layers*heads, dim] call: cos/sin are computed once per token
        flat = keys.permute(1, 0, 2, 3).reshape(n, layers * heads, dim)
        src_pos = torch.arange(keep.src_pos, keep.src_end, dtype=torch.int64, device=keys.device)
        flat = rotary.move_keys(flat, src_pos, src_pos + keep.delta)
        keys = flat.reshape(n, layers, heads, dim).permute(1, 0, 2, 3)
    pool.k[:, dst_slots] = keys
    pool.v[:, dst_slots] = pool.v[:, src_slots]
