"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3-Next hybrids): pure-torch reference path.

Source of the math: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025 (arXiv 2412.06464). Per value head, with a state S [Dk, Dv] (eq. 10):

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T      (gated delta rule)
    o_t = S_t^T q_t

q and k are L2-normalised (eps inside the sqrt, as the FLA kernels) and q is scaled by Dk^-0.5.
The chunked form (sec. 3.3, the WY/UT representation of Yang et al. 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length") processes C tokens per step with
matmuls; the recurrent form is one token at a time (decode). Both take and return the state, so
a sequence can be cut into segments anywhere (prefix caching checkpoints, SCR splices) and the
result is the same as one pass up to float rounding.

Before the rule, q/k/v go through a short causal depthwise conv (kernel K, SiLU) whose state is
the last K-1 inputs; after it, a gated RMSNorm (norm(o) * silu(z)) and out_proj. Parameter names
and shapes are those of transformers' `Qwen3_5GatedDeltaNet` / `Qwen3NextGatedDeltaNet`:

    qwen3_5:     in_proj_qkv [2*key_dim + value_dim, H], in_proj_z, in_proj_b, in_proj_a
    qwen3_next:  in_proj_qkvz (grouped per key head: q, k, v-group, z-group), in_proj_ba
    both:        conv1d.weight [conv_dim, 1, K], dt_bias [Hv], A_log [Hv], norm.weight [Dv], out_proj

Which rows of a forward form a segment, and which state each segment starts from, is the
engine's business (`ForwardBatch.linear`); the states live in a `StatePool`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from kvsplice.cache.state_pool import StatePool
from kvsplice.layer_configs import LinearAttnConfig
from kvsplice.layers.forward_batch import ForwardBatch, LinearSeq
from kvsplice.layers.quant_linear import BucketedLinear

ProjLayout = Literal["qwen3_5", "qwen3_next"]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA kernels' form). Pure."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule (paper eq. 10) for any leading dims `...`.

    q, k `[..., Dk]` (normalised and scaled), v `[..., Dv]`, g and beta `[...]`, state
    `[..., Dk, Dv]`, all fp32. Returns (o `[..., Dv]`, new state). Pure.
    """
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., :, None]).sum(dim=-2)               # S^T k
    correction = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * correction[..., None, :]
    return (state * q[..., :, None]).sum(dim=-2), state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: q, k `[T, H, Dk]`, v `[T, H, Dv]`, g, beta `[T, H]`, state `[H, Dk, Dv]`
    (fp32, q/k normalised and scaled). Returns (o `[T, H, Dv]`, final state). Pure."""
    outs = []
    for t in range(q.shape[0]):
        o, state = delta_rule_step(q[t], k[t], v[t], g[t], beta[t], state)
        outs.append(o)
    return torch.stack(outs), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY) form of `recurrent_gated_delta_rule`: same arguments and results.

    Within a chunk, with cumulative log decay c_i = g_1 + ... + g_i and D_ij = exp(c_i - c_j)
    (i >= j): A = strictly-lower(diag(beta) K K^T * D); T = (I + A)^-1; U = T diag(beta) V and
    W = T diag(beta exp(c)) K. Then per chunk, with the incoming state S:
        V' = U - W S;  O = (Q exp(c)) S + lower(Q K^T * D) V';  S = exp(c_C) S + (K exp(c_C - c))^T V'.
    """
    num_tokens, heads, _ = q.shape
    pad = (-num_tokens) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    # [H, chunks, C, D]
    q, k, v = (x.transpose(0, 1).reshape(heads, -1, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.transpose(0, 1).reshape(heads, -1, chunk_size) for x in (g, beta))
    cum = g.cumsum(dim=-1)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay       # unit diagonal implied by the solve
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for chunk in range(q.shape[1]):
        v_new = u[:, chunk] - w[:, chunk] @ state
        out[:, chunk] = q_decayed[:, chunk] @ state + intra[:, chunk] @ v_new
        state = state * chunk_decay[:, chunk] + k_to_end[:, chunk].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, v.shape[-1])[:, :num_tokens].transpose(0, 1)
    return out, state


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of `x [T, C]` continuing from `conv_state [C, K-1]` (the
    previous K-1 inputs, zeros at a sequence start); `weight [C, K]`. Returns (y `[T, C]`,
    the new state: the last K-1 inputs). Pure."""
    full = torch.cat([conv_state.to(x.dtype), x.transpose(0, 1)], dim=-1)    # [C, K-1+T]
    y = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(y).transpose(0, 1).to(x.dtype), full[:, -(weight.shape[1] - 1):]


class GatedRMSNorm(nn.Module):
    """norm(x) * silu(z), as transformers' `Qwen3NextRMSNormGated`: normalise in fp32, cast back,
    multiply by weight, then by silu(z) in fp32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`x`, `z [..., dim]` -> `[..., dim]` in x.dtype."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(z.to(torch.float32))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; see the module docstring for names and math."""

    def __init__(self, lin: LinearAttnConfig, hidden_size: int, eps: float, linear_id: int,
                 layout: ProjLayout, dtype: torch.dtype):
        super().__init__()
        self.lin, self.layout, self.linear_id = lin, layout, linear_id
        key_dim, value_dim = lin.key_dim, lin.value_dim
        if layout == "qwen3_5":
            self.in_proj_qkv = BucketedLinear(hidden_size, 2 * key_dim + value_dim, bias=False, dtype=dtype)
            self.in_proj_z = BucketedLinear(hidden_size, value_dim, bias=False, dtype=dtype)
            self.in_proj_b = BucketedLinear(hidden_size, lin.num_v_heads, bias=False, dtype=dtype)
            self.in_proj_a = BucketedLinear(hidden_size, lin.num_v_heads, bias=False, dtype=dtype)
        else:
            self.in_proj_qkvz = BucketedLinear(hidden_size, 2 * key_dim + 2 * value_dim, bias=False, dtype=dtype)
            self.in_proj_ba = BucketedLinear(hidden_size, 2 * lin.num_v_heads, bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv_kernel, groups=lin.conv_dim,
                                bias=False, padding=lin.conv_kernel - 1, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(lin.num_v_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(lin.num_v_heads, dtype=dtype))
        self.norm = GatedRMSNorm(lin.v_head_dim, eps, dtype)
        self.out_proj = BucketedLinear(value_dim, hidden_size, bias=False, dtype=dtype)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> mixed qkv [T, conv_dim], z [T, Hv, Dv], b, a [T, Hv]."""
        lin, num_tokens = self.lin, x.shape[0]
        if self.layout == "qwen3_5":
            z = self.in_proj_z(x).view(num_tokens, lin.num_v_heads, lin.v_head_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # qwen3_next groups the projection per key head: [q | k | v of its value heads | z of them]
        per_group = lin.num_v_heads // lin.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(num_tokens, lin.num_k_heads, -1)
        q, k, v, z = torch.split(qkvz, [lin.k_head_dim, lin.k_head_dim, per_group * lin.v_head_dim,
                                        per_group * lin.v_head_dim], dim=-1)
        ba = self.in_proj_ba(x).view(num_tokens, lin.num_k_heads, 2 * per_group)
        b, a = torch.split(ba, [per_group, per_group], dim=-1)
        mixed = torch.cat([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)], -1)
        return (mixed, z.reshape(num_tokens, lin.num_v_heads, lin.v_head_dim),
                b.reshape(num_tokens, -1), a.reshape(num_tokens, -1))

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [..., conv_dim] -> fp32 q, k [..., Hv, Dk] (normalised, q scaled, key heads
        repeated for their value heads) and v [..., Hv, Dv]."""
        lin = self.lin
        q, k, v = torch.split(conv_out.to(torch.float32), [lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        lead = conv_out.shape[:-1]
        q = l2_normalize(q.reshape(*lead, lin.num_k_heads, lin.k_head_dim)) * lin.k_head_dim ** -0.5
        k = l2_normalize(k.reshape(*lead, lin.num_k_heads, lin.k_head_dim))
        if lin.num_v_heads != lin.num_k_heads:
            repeats = lin.num_v_heads // lin.num_k_heads
            q, k = q.repeat_interleave(repeats, dim=-2), k.repeat_interleave(repeats, dim=-2)
        return q, k, v.reshape(*lead, lin.num_v_heads, lin.v_head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, states: StatePool) -> torch.Tensor:
        """`x [T, hidden]` -> `[T, hidden]`. Each request's rows are run segment by segment
        (`batch.linear`), from and into its state slot. Side effects: updates this layer's conv
        and recurrent state in `states` at each request's slot; copies a state into a segment's
        `save_to` slot after it, and from its `load_from` slot before it."""
        mixed, z, b, a = self._project(x)
        beta = b.to(torch.float32).sigmoid()
        g = -self.A_log.to(torch.float32).exp() * F.softplus(a.to(torch.float32) + self.dt_bias.to(torch.float32))
        core = torch.empty(x.shape[0], self.lin.num_v_heads, self.lin.v_head_dim, dtype=torch.float32,
                           device=x.device)
        decode = [(seq, lin_seq) for seq, lin_seq in zip(batch.seqs, batch.linear) if _is_plain_step(seq, lin_seq)]
        if decode:
            self._decode_step(mixed, g, beta, decode, core, states)
        done = {id(seq) for seq, _ in decode}
        for seq, lin_seq in zip(batch.seqs, batch.linear):
            if id(seq) not in done:
                self._run_segments(mixed, g, beta, seq.query_start, lin_seq, core, states)
        out = self.norm(core.to(x.dtype), z)
        return self.out_proj(out.reshape(x.shape[0], -1))

    def _decode_step(self, mixed, g, beta, decode, core, states: StatePool) -> None:
        """All single-token requests at once: gather their states, one step, scatter back."""
        rows = torch.tensor([seq.query_start for seq, _ in decode], dtype=torch.int64, device=mixed.device)
        slots = torch.tensor([lin_seq.state_slot for _, lin_seq in decode], dtype=torch.int64,
                             device=mixed.device)
        conv_states, rec_states = states.conv[self.linear_id], states.rec[self.linear_id]
        weight = self.conv1d.weight[:, 0, :]
        full = torch.cat([conv_states[slots].to(mixed.dtype), mixed[rows][:, :, None]], dim=-1)  # [B, C, K]
        conv_out = F.silu((full.to(weight.dtype) * weight).sum(-1)).to(mixed.dtype)
        conv_states[slots] = full[:, :, 1:].to(conv_states.dtype)
        q, k, v = self._qkv(conv_out)
        out, new_state = delta_rule_step(q, k, v, g[rows], beta[rows], rec_states[slots])
        rec_states[slots] = new_state
        core[rows] = out

    def _run_segments(self, mixed, g, beta, query_start: int, lin_seq: LinearSeq, core,
                      states: StatePool) -> None:
        conv_states, rec_states = states.conv[self.linear_id], states.rec[self.linear_id]
        slot = lin_seq.state_slot
        weight = self.conv1d.weight[:, 0, :]
        for segment in lin_seq.segments:
            if segment.load_from is not None:
                conv_states[slot] = conv_states[segment.load_from]
                rec_states[slot] = rec_states[segment.load_from]
            rows = slice(query_start + segment.start, query_start + segment.end)
            conv_out, conv_states[slot] = causal_conv(mixed[rows], conv_states[slot], weight)
            q, k, v = self._qkv(conv_out)
            rule = recurrent_gated_delta_rule if segment.end - segment.start == 1 else chunk_gated_delta_rule
            core[rows], rec_states[slot] = rule(q, k, v, g[rows], beta[rows], rec_states[slot])
            if segment.save_to is not None:
                conv_states[segment.save_to] = conv_states[slot]
                rec_states[segment.save_to] = rec_states[slot]


def _is_plain_step(seq, lin_seq: LinearSeq) -> bool:
    """One token, one segment, no state swap: the batched decode path applies."""
    if seq.query_len != 1 or len(lin_seq.segments) != 1:
        return False
    segment = lin_seq.segments[0]
    return segment.load_from is None and segment.save_to is None

