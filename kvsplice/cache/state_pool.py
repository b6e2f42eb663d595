"""StatePool: the fixed-size states of linear-attention layers, one state slot per holder.

A hybrid model's linear layers (Gated DeltaNet) carry, per sequence, a conv state (the last
K-1 inputs of the short causal conv) and a recurrent state [Hv, Dk, Dv] instead of per-token K/V.
One **state slot** holds both, for every linear layer. Slots are handed out by a `SlotAllocator`
(the same free list, refcounts and integrity check as KV slots):

    free      on the free list
    cached    a radix-tree node's checkpoint (the exact state after the node's last token)
    in use    a running request's working state or one of its pending checkpoints, or a state an
              SCR session keeps from its previous sequence

Layout: `conv[linear_layer]` is `[num_slots, conv_dim, K-1]` in the model dtype, `rec[linear_layer]`
is `[num_slots, Hv, Dk, Dv]` in fp32 (the rule's state is accumulated in fp32, as transformers).
A slot of a real hybrid is large: `state_slot_bytes` (about 147 MiB for a Qwen3.5-27B-sized model,
74 MiB for Qwen3-Next-80B-A3B), which is why the checkpoint policy caps the tree's checkpoints.

A slot leaves the pool as named tensors (`snapshot`: {"conv": [layers, conv_dim, K-1],
"rec": [layers, Hv, Dk, Dv]}, fresh copies) and comes back through `restore`, which takes them only
when their names, shapes and dtypes are this pool's: the disk tier stores a checkpoint that way.
Several states (an SCR session's, by sequence length) travel as one flat dict (`pack_states`:
"<length>.conv", "<length>.rec"; `unpack_states` undoes it).
"""

from __future__ import annotations

import torch

from kvsplice.cache.kv_pool import SlotAllocator
from kvsplice.layer_configs import LinearAttnConfig


class StatePool:
    """Conv and recurrent states of `num_linear_layers` layers for `num_slots` holders."""

    def __init__(self, num_slots: int, num_linear_layers: int, lin: LinearAttnConfig,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.allocator = SlotAllocator(num_slots)
        self.conv = torch.zeros(num_linear_layers, num_slots, lin.conv_dim, lin.conv_kernel - 1,
                                dtype=dtype, device=device)
        self.rec = torch.zeros(num_linear_layers, num_slots, lin.num_v_heads, lin.k_head_dim,
                               lin.v_head_dim, dtype=torch.float32, device=device)

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def alloc_one(self) -> int | None:
        """One free slot (refcount 1, contents unspecified), or None when none is free."""
        slots = self.allocator.alloc(1)
        return None if slots is None else int(slots[0])

    def free(self, slots: list[int]) -> None:
        """Drop one reference on each slot (see `SlotAllocator.free`)."""
        if slots:
            self.allocator.free(torch.tensor(slots, dtype=torch.int64))

    def zero(self, slot: int) -> None:
        """Reset `slot` to the state of an empty sequence (all zeros), every layer."""
        self.conv[:, slot] = 0
        self.rec[:, slot] = 0

    def copy(self, src: int, dst: int) -> None:
        """Copy the state of slot `src` into slot `dst`, every layer."""
        self.conv[:, dst] = self.conv[:, src]
        self.rec[:, dst] = self.rec[:, src]

    def snapshot(self, slot: int) -> dict[str, torch.Tensor]:
        """The state in `slot` as fresh CPU tensors by name ({"conv", "rec"}, every linear layer):
        the caller may keep them while the slot is freed and reused."""
        return {"conv": self.conv[:, slot].cpu().clone(), "rec": self.rec[:, slot].cpu().clone()}

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether `tensors` is a `snapshot` of this pool's layout (same names, shapes, dtypes)."""
        layout = {"conv": self.conv[:, 0], "rec": self.rec[:, 0]}
        return set(tensors) == set(layout) and all(
            tensors[name].shape == like.shape and tensors[name].dtype == like.dtype for name, like in layout.items())

    def restore(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a `snapshot` into `slot`, every layer. Raises ValueError when it does not `fit`."""
        if not self.fits(tensors):
            raise ValueError("the state tensors do not match this StatePool's layout")
        self.conv[:, slot] = tensors["conv"].to(self.conv.device)
        self.rec[:, slot] = tensors["rec"].to(self.rec.device)

    def bytes_per_slot(self) -> int:
        """Memory of one slot over all linear layers (equals `state_slot_bytes` of its shape)."""
        return (self.conv[:, 0].numel() * self.conv.element_size()
                + self.rec[:, 0].numel() * self.rec.element_size())

    def check_integrity(self, cached: int, in_use: int) -> None:
        """free + cached + in_use == total (AssertionError otherwise); see `SlotAllocator`."""
        self.allocator.check_integrity(cached=cached, in_use=in_use)


def state_slot_bytes(num_linear_layers: int, lin: LinearAttnConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one state slot (one checkpoint) of a model with `num_linear_layers` Gated DeltaNet
    layers shaped `lin`, without allocating it: per layer a conv state [conv_dim, K-1] in `dtype` and a
    recurrent state [Hv, Dk, Dv] in fp32. E.g. 48 layers of 16 key / 48 value heads of 128 (a
    Qwen3.5-27B-sized model) in bf16: 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4) bytes = 146.8 MiB."""
    conv = lin.conv_dim * (lin.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
    rec = lin.num_v_heads * lin.k_head_dim * lin.v_head_dim * 4
    return num_linear_layers * (conv + rec)


def pack_states(snapshots: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Snapshots by sequence length as one flat dict of tensors named "<length>.<name>"."""
    return {f"{length}.{name}": tensor for length, snapshot in snapshots.items() for name, tensor in snapshot.items()}


def unpack_states(tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """`pack_states` undone: {sequence length: snapshot}. Raises ValueError on a name that is not
    "<positive length>.<name>"."""
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    for full_name, tensor in tensors.items():
        length, _, name = full_name.partition(".")
        if not length.isdigit() or int(length) <= 0 or not name:
            raise ValueError(f"not a packed state name: {full_name!r}")
        snapshots.setdefault(int(length), {})[name] = tensor
    return snapshots
