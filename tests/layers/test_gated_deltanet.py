"""Gated delta rule: chunked == recurrent == transformers' torch reference; state carried across
cuts; causal conv with a state equals one pass."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kvsplice.layers.gated_deltanet import (causal_conv, chunk_gated_delta_rule, l2_normalize,
                                            recurrent_gated_delta_rule)


def inputs(num_tokens: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(num_tokens, heads, dk, generator=gen)) * dk ** -0.5
    k = l2_normalize(torch.randn(num_tokens, heads, dk, generator=gen))
    v = torch.randn(num_tokens, heads, dv, generator=gen)
    g = -F.softplus(torch.randn(num_tokens, heads, generator=gen))
    beta = torch.rand(num_tokens, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("num_tokens,chunk", [(1, 64), (5, 4), (37, 8), (64, 16)])
def test_chunked_equals_recurrent(num_tokens, chunk):
    q, k, v, g, beta, state = inputs(num_tokens)
    out_r, state_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out_c, state_c = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk)
    assert (out_r - out_c).abs().max() <= 1e-5
    assert (state_r - state_c).abs().max() <= 1e-5


def test_matches_transformers_reference():
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                     torch_recurrent_gated_delta_rule)
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 30, 3, 8, generator=gen), torch.randn(1, 30, 3, 8, generator=gen)
    v = torch.randn(1, 30, 3, 6, generator=gen)
    g, beta = -F.softplus(torch.randn(1, 30, 3, generator=gen)), torch.rand(1, 30, 3, generator=gen)
    state = torch.randn(1, 3, 8, 6, generator=gen)
    ref_out, ref_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=state,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_rec, _ = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = l2_normalize(q[0]) * 8 ** -0.5, l2_normalize(k[0])
    out, new_state = chunk_gated_delta_rule(qn, kn, v[0], g[0], beta[0], state[0], chunk_size=16)
    assert (out - ref_out[0]).abs().max() <= 1e-5
    assert (out - ref_rec[0]).abs().max() <= 1e-5
    assert (new_state - ref_state[0]).abs().max() <= 1e-5


def test_state_carries_across_cuts():
    q, k, v, g, beta, state = inputs(40, seed=2)
    whole, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    first, mid = chunk_gated_delta_rule(q[:17], k[:17], v[:17], g[:17], beta[:17], state, chunk_size=16)
    second, end = recurrent_gated_delta_rule(q[17:], k[17:], v[17:], g[17:], beta[17:], mid)
    assert (torch.cat([first, second]) - whole).abs().max() <= 1e-5
    assert (end - final).abs().max() <= 1e-5


def test_causal_conv_with_state():
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(20, 5, generator=gen), torch.randn(5, 4, generator=gen)
    zeros = torch.zeros(5, 3)
    whole, _ = causal_conv(x, zeros, weight)
    expected = F.silu(F.conv1d(x.T[None], weight[:, None], padding=3, groups=5)[0, :, :20]).T
    assert (whole - expected).abs().max() <= 1e-6
    first, state = causal_conv(x[:7], zeros, weight)
    second, _ = causal_conv(x[7:], state, weight)
    assert (torch.cat([first, second]) - whole).abs().max() <= 1e-6
