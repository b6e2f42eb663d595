"""Rotary position embeddings (RoPE) in the HF half-split ("rotate_half", NeoX) layout ONLY.

Layout: of the first `rotary_dim` dims of a head, dim j pairs with dim j + rotary_dim/2 and both
turn by angle pos * inv_freq[j]; dims past `rotary_dim` (partial rotary) pass through unchanged.
The GPT-J interleaved layout (pairs 2j, 2j+1) is not implemented here; checkpoints in that layout
must have their q/k weights permuted by the loader.

Sources of each formula:
- base RoPE: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021),
  eq. 34: inv_freq[j] = theta^(-2j/d); half-split form as in transformers' `rotate_half`.
- linear ("position interpolation"): Chen et al. 2023 / kaiokendev: inv_freq / factor.
- llama3: Meta's llama3.1 reference (`apply_scaling` in llama-models), as transformers'
  `_compute_llama3_parameters`: wavelengths beyond original_ctx/low_freq_factor are divided by
  factor, those below original_ctx/high_freq_factor kept, the band in between blended smoothly.
- yarn: Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models" (2023),
  sec. 3.2 (NTK-by-parts ramp between interpolated and extrapolated inv_freq) and eq. 22
  (attention temperature 0.1 ln(s) + 1, folded into cos/sin as `attention_scaling`), with the
  DeepSeek mscale / mscale_all_dim variant, as transformers' `_compute_yarn_parameters`.

Every formula is computed in fp32 exactly as transformers 5.x computes it, so our keys match its
keys bit for bit up to matmul rounding.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kvsplice.layer_configs import RopeConfig


def _base_inv_freq(rope: RopeConfig) -> torch.Tensor:
    """RoFormer eq. 34: theta^(-2j/d) for j < d/2, d = rotary_dim, fp32."""
    exponents = torch.arange(0, rope.rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float) / rope.rotary_dim
    return 1.0 / (rope.theta ** exponents)


def _default(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(rope), 1.0


def _linear(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    # Position interpolation: scaling positions by 1/factor == scaling inv_freq by 1/factor.
    return _base_inv_freq(rope) / rope.factor, 1.0


def _llama3(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(rope)
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are interpolated, short ones kept as trained
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    # YaRN eq. 22 (sqrt(1/t) = 0.1 ln(s) + 1), DeepSeek-V2's mscale generalisation
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(rope: RopeConfig, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """YaRN sec. 3.2: the dims that turn beta_fast / beta_slow times over the original context."""
    dim, base, original = rope.rotary_dim, rope.theta, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    if factor is None:
        factor = rope.max_position_embeddings / rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    low, high = _yarn_correction_range(rope, rope.beta_fast or 32, rope.beta_slow or 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as transformers does
    pos_freqs = rope.theta ** (torch.arange(0, rope.rotary_dim, 2).to(dtype=torch.float) / rope.rotary_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(rope.rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                + inv_freq_extrapolation * extrapolation_factor)
    return inv_freq, float(attention_factor)


_SCALINGS: dict[str, Callable[[RopeConfig], tuple[torch.Tensor, float]]] = {
    "default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn,
}


def inv_freq_and_scale(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """fp32 inv_freq of length rotary_dim/2 and the attention_scaling that multiplies cos and sin
    (1.0 except for yarn), for every scaling kind exactly as transformers 5.x computes them."""
    if rope.kind not in _SCALINGS:
        raise ValueError(f"unsupported rope scaling kind {rope.kind!r}")
    return _SCALINGS[rope.kind](rope)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 attention_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[N, rotary_dim]` fp32 of angle positions[n] * inv_freq[j] (duplicated for the two
    halves), each multiplied by `attention_scaling`. `positions` may be negative (a delta)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(device=positions.device, dtype=torch.float32)
    emb = torch.cat((angles, angles), dim=-1)
    if attention_scaling == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [N, heads, head_dim]` by per-row `cos`/`sin [N, rotary_dim]`.

    Only the first rotary_dim dims turn (partial rotary); math in fp32; returns x.dtype. Pure.
    """
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot = x[..., :rotary_dim].to(torch.float32)
    rotated = x_rot * cos + _rotate_half(x_rot) * sin
    if rotary_dim < x.shape[-1]:
        rotated = torch.cat((rotated, x[..., rotary_dim:].to(torch.float32)), dim=-1)
    return rotated.to(x.dtype)


def rerotate(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Turn stored (already rotated) keys `k [N, heads, head_dim]` by `delta [N]` int64 positions.

    Rotations in the same planes compose: R(src_pos + delta) = R(delta) R(src_pos), so
    rerotate(apply_rope(k, src_pos), delta) == apply_rope(k, src_pos + delta). cos/sin of
    delta * inv_freq are computed directly in fp32 (delta may be negative; no table is indexed),
    and attention_scaling is NOT applied again (YaRN's mscale is already in the stored key).
    Returns k.dtype. Used by SCR relocation.
    """
    cos, sin = rope_cos_sin(delta, inv_freq, 1.0)
    return apply_rope(k, cos, sin)


def unrotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_scaling: float) -> torch.Tensor:
    """The inverse of `apply_rope(x, cos * attention_scaling, sin * attention_scaling)`: stored keys
    `k [N, heads, head_dim]` turned back by the angles of the unscaled `cos`/`sin [N, rotary_dim]`
    (the tables that rotated them) and divided by `attention_scaling`. fp32 out (not rounded). Pure."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x = k.to(torch.float32)
    x_rot = x[..., :rotary_dim]
    turned = x_rot * cos - _rotate_half(x_rot) * sin   # R(-angle) = R(angle) transposed
    if attention_scaling != 1.0:
        turned = turned / attention_scaling
    return torch.cat((turned, x[..., rotary_dim:]), dim=-1) if rotary_dim < k.shape[-1] else turned


def move_keys(k: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor, inv_freq: torch.Tensor,
              attention_scaling: float) -> torch.Tensor:
    """Stored keys `k [N, heads, head_dim]`, rotated at `src_pos [N]`, as a forward at `dst_pos [N]`
    would have stored them. Returns k.dtype. Used by SCR relocation.

    fp32 keys: `rerotate(k, dst_pos - src_pos)` (one turn by the delta; exact to fp32 rounding).
    bf16 / fp16 keys: a forward rounds the rotated key once, round(R(p) k_proj), where the
    projection k_proj is itself a bf16 / fp16 output, i.e. a point of that grid. Turning the
    rounded key by the delta and rounding again, round(R(d) round(R(p) k_proj)), carries the first
    rounding along and adds a second one to every element (docs/BENCHMARKS_HISTORY.md,
    "Figures formerly quoted in code"). Instead the key is turned back to the
    projection's grid and rounded there, which recovers k_proj exactly in most elements (the
    rounding error of the stored key is under half a grid step of the element), then rotated by
    the destination's own tables and rounded once, as the forward at dst_pos does:

        stored = round(R(src) k_proj)
        k_hat  = round(R(-src) stored)            == k_proj where recovered
        moved  = round(R(dst) k_hat)              == the fresh key, bit for bit, where recovered

    Where an element of small magnitude is not recovered (its pair partner is much larger), its
    error stays within the stored key's own rounding error, as before.
    """
    rows = max(1, MOVE_CHUNK_ELEMENTS // max(1, math.prod(k.shape[1:])))
    if k.shape[0] <= rows:
        return _move_rows(k, src_pos, dst_pos, inv_freq, attention_scaling)
    moved = torch.empty_like(k)
    for start in range(0, k.shape[0], rows):   # each row on its own: the same bits in any chunking
        end = start + rows
        moved[start:end] = _move_rows(k[start:end], src_pos[start:end], dst_pos[start:end], inv_freq,
                                      attention_scaling)
    return moved


# Rows of keys `move_keys` turns at a time, in elements: the fp32 temporaries of a chunk stay in the
# caches, several times faster on a long edit's sliding layers than one piece, bit for bit
# (docs/BENCHMARKS_HISTORY.md, "Moving keys in chunks of rows").
MOVE_CHUNK_ELEMENTS = 1 << 20


def _move_rows(k: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor, inv_freq: torch.Tensor,
               attention_scaling: float) -> torch.Tensor:
    """`move_keys` of one chunk of rows (see there)."""
    if k.dtype == torch.float32:
        return rerotate(k, dst_pos - src_pos, inv_freq)
    raw = unrotate(k, *rope_cos_sin(src_pos, inv_freq, 1.0), attention_scaling).to(k.dtype)
    return apply_rope(raw, *rope_cos_sin(dst_pos, inv_freq, attention_scaling))


class Rotary:
    """A model's RoPE: inv_freq (fp32, on `device`) and attention_scaling, computed once."""

    def __init__(self, rope: RopeConfig, device: str | torch.device = "cpu"):
        inv_freq, self.attention_scaling = inv_freq_and_scale(rope)
        self.inv_freq = inv_freq.to(device)
        self.rotary_dim = rope.rotary_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[N, rotary_dim]` fp32 for absolute positions (attention_scaling included)."""
        return rope_cos_sin(positions, self.inv_freq, self.attention_scaling)

    def rerotate(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`rerotate(k, delta, self.inv_freq)`."""
        return rerotate(k, delta, self.inv_freq)

    def move_keys(self, k: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor) -> torch.Tensor:
        """`move_keys(k, src_pos, dst_pos, self.inv_freq, self.attention_scaling)`."""
        return move_keys(k, src_pos, dst_pos, self.inv_freq, self.attention_scaling)


class LayerRotaries:
    """The RoPE of each layer, for models whose layers differ in it (Gemma 3: one theta for the
    sliding layers, another for the global ones): one Rotary per distinct RopeConfig."""

    def __init__(self, layer_ropes: tuple[RopeConfig, ...], kv_layers: tuple[int, ...],
                 device: str | torch.device = "cpu"):
        """`layer_ropes`: one per model layer; `kv_layers`: the model layers that keep K/V, in
        KV-pool order (the layers `move_keys` turns)."""
        by_config = {rope: Rotary(rope, device) for rope in dict.fromkeys(layer_ropes)}
        self.layers = tuple(by_config[rope] for rope in layer_ropes)
        self.kv_layers = tuple(self.layers[layer_id] for layer_id in kv_layers)

    def cos_sin(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin `[N, rotary_dim]` for `positions` (computed once per distinct RoPE)."""
        tables = {id(rotary): rotary.cos_sin(positions) for rotary in self.layers}
        return [tables[id(rotary)] for rotary in self.layers]

    def move_keys(self, k: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor) -> torch.Tensor:
        """`Rotary.move_keys` of keys `k [N, kv_layers * heads, head_dim]` (the KV-pool layers side
        by side, as SCR relocation passes them), each layer's heads by that layer's RoPE."""
        per_layer = k.view(k.shape[0], len(self.kv_layers), -1, k.shape[-1])
        groups: dict[int, list[int]] = {}   # layers of one RoPE turn together: one cos/sin per row
        for index, rotary in enumerate(self.kv_layers):
            groups.setdefault(id(rotary), []).append(index)
        if len(groups) == 1:
            return self.kv_layers[0].move_keys(k, src_pos, dst_pos)
        moved = torch.empty_like(per_layer)
        for indices in groups.values():
            chosen = per_layer[:, indices]
            turned = self.kv_layers[indices[0]].move_keys(chosen.reshape(k.shape[0], -1, k.shape[-1]), src_pos, dst_pos)
            moved[:, indices] = turned.view(chosen.shape)
        return moved.view(k.shape)
