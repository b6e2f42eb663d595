"""Turning relocated bf16 / fp16 keys in one fused kernel: `kvsplice.layers.rotary_move.turn_layer_keys_`
(the eager fast path, itself equal to the reference `rotary.move_keys`) compiled by torch.compile
(inductor) into one pass over the keys, with the same bits.

The eager turn runs about twenty elementwise ops over a layer's keys (each half converted to fp32,
unrotated, rounded to the projection's grid, rotated to the destination, rounded), each a pass
over memory. Fused, every key is read once and written once. The formulas are rotary_move's:

    p1 = round((x1 cos(s) + x2 sin(s)) / a)      p2 = round((x2 cos(s) - x1 sin(s)) / a)
    x1' = round(p1 a cos(t) - p2 a sin(t))     x2' = round(p2 a cos(t) + p1 a sin(t))

The same bits need two things of inductor: the round trip through the key dtype kept
(`emulate_precision_casts`; by default inductor drops a cast pair such as fp32 -> bf16 -> fp32) and
products not contracted into fused multiply-adds (inductor's C++ flags keep -ffp-contract=off).
`build_fused_turn` checks the bits on probe keys before it hands the compiled turn out; where they
differ, or compiling fails, the eager turn serves and the reason is returned (logged once by the
caller). fp32 keys (one turn by the delta, four ops) always take the eager turn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from kvsplice.layers.rotary import Rotary
from kvsplice.layers.rotary_move import SpanTurn, span_turn, turn_layer_keys_

KeyTurner = Callable[[torch.Tensor, SpanTurn], torch.Tensor]
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
# probe lengths: distinct, above 1 (dynamo specialises size 1), one not a multiple of a vector width
PROBE_LENGTHS = (37, 301)


def turned_rotary_part(keys: torch.Tensor, cos_a: torch.Tensor, sin_a: torch.Tensor, cos_b: torch.Tensor,
                       sin_b: torch.Tensor, rotary_dim: int, scaling: float) -> torch.Tensor:
    """The turned first `rotary_dim` dims of `keys [n, heads, head_dim]` (bf16 / fp16), `[n, heads,
    rotary_dim]` in keys.dtype: rotary_move's low-precision turn with its SpanTurn tables `[n, 1,
    rotary_dim/2]`, op for op (the function torch.compile fuses; eager, it is the readable form)."""
    halves = keys[..., :rotary_dim].unflatten(-1, (2, rotary_dim // 2)).float()
    x1, x2 = halves[:, :, 0], halves[:, :, 1]
    first = x1 * cos_a + x2 * sin_a          # unrotate: back to the source's projection
    second = x2 * cos_a - x1 * sin_a
    if scaling != 1.0:
        first, second = first / scaling, second / scaling
    raw1, raw2 = first.to(keys.dtype).float(), second.to(keys.dtype).float()   # the projection's grid
    turned = torch.stack((raw1 * cos_b - raw2 * sin_b, raw2 * cos_b + raw1 * sin_b), dim=2)
    return turned.to(keys.dtype).flatten(-2)


@dataclass(frozen=True)
class FusedTurn:
    """A KeyTurner: low-precision turns through `compiled` (torch.compile of `turned_rotary_part`),
    fp32 turns through the eager `turn_layer_keys_`. Same contract as `turn_layer_keys_`: turns
    keys `[n, heads, head_dim]` in place and returns them."""

    compiled: Callable[..., torch.Tensor]

    def __call__(self, keys: torch.Tensor, turn: SpanTurn) -> torch.Tensor:
        return keys.copy_(self.turned(keys, turn))

    def turned(self, keys: torch.Tensor, turn: SpanTurn) -> torch.Tensor:
        """`keys` turned by `turn`, as a new tensor; `keys` (e.g. a view of the pool) is only read
        (what relocation calls: one copy fewer than turning a copy in place)."""
        if turn.cos_b is None or keys.shape[0] == 0:
            return turn_layer_keys_(keys.clone(), turn)
        part = self.compiled(keys, turn.cos_a, turn.sin_a, turn.cos_b, turn.sin_b, turn.rotary_dim,
                             turn.attention_scaling)
        return part if turn.rotary_dim == keys.shape[-1] else torch.cat((part, keys[..., turn.rotary_dim:]), dim=-1)


@dataclass(frozen=True)
class TurnChoice:
    """What relocation turns keys with, and the line that says why (for the log)."""

    turner: KeyTurner
    reason: str


def build_fused_turn(dtype: torch.dtype, num_kv_heads: int, head_dim: int, rotaries: Sequence[Rotary],
                     compile_fn: Optional[Callable] = None) -> TurnChoice:
    """Compile the fused turn and check it against `turn_layer_keys_` bit for bit on random keys of
    `dtype` at PROBE_LENGTHS, for every distinct RoPE in `rotaries`. Returns the FusedTurn, or the
    eager turn with the reason where compiling raised or a bit differed. `compile_fn` (default
    torch.compile with INDUCTOR_OPTIONS) is a seam for tests. Side effect: inductor compiles (seconds;
    its on-disk cache makes a second start faster)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return TurnChoice(turn_layer_keys_, f"fused relocation: not used for {dtype} keys (one turn by the delta)")
    started = time.perf_counter()
    compile_fn = compile_fn or _inductor_compile
    try:
        fused = FusedTurn(compile_fn(turned_rotary_part))
        for rotary in {id(r): r for r in rotaries}.values():
            for length in PROBE_LENGTHS:
                if not _same_bits(fused, rotary, dtype, num_kv_heads, head_dim, length):
                    return TurnChoice(turn_layer_keys_, f"fused relocation: off, the compiled turn of {length} "
                                      f"keys differs from the eager one; relocation turns keys eagerly")
    except Exception as exc:  # noqa: BLE001 -- any compile failure leaves the eager turn serving
        return TurnChoice(turn_layer_keys_, f"fused relocation: off, compiling failed ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); relocation turns keys eagerly")
    return TurnChoice(fused, f"fused relocation: on, compiled and checked in {time.perf_counter() - started:.1f} s")


def _inductor_compile(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True, fullgraph=True, options=INDUCTOR_OPTIONS)


def _same_bits(fused: FusedTurn, rotary: Rotary, dtype: torch.dtype, heads: int, head_dim: int, length: int) -> bool:
    """Whether `fused.turned` (relocation's call) and the eager turn give the same bits moving
    `length` random keys by a backward and a forward delta."""
    generator = torch.Generator().manual_seed(length)
    keys = (torch.randn(length, heads, head_dim, generator=generator) * 4).to(dtype)
    for src, dst in ((1000, 17), (17, 4000)):
        turn = span_turn(rotary, src, dst, length, dtype)
        if not torch.equal(fused.turned(keys, turn), turn_layer_keys_(keys.clone(), turn)):
            return False
    return True
