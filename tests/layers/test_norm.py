"""The fast path's RMSNorm (one layer_norm kernel over [x, -x]) against RMSNorm."""

from __future__ import annotations

import torch

from kvsplice.layers.norm import RMSNorm, doubled_weight, rms_norm_via_layer_norm


def test_rms_norm_via_layer_norm_equals_rms_norm(torch_seed):
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(96))
    x = 3 * torch.randn(5, 7, 96) + 0.5      # a non-zero mean: RMSNorm must not subtract it
    got = rms_norm_via_layer_norm(x, doubled_weight(norm.weight), 1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got, norm(x), atol=2e-6, rtol=2e-6)
    bf16 = rms_norm_via_layer_norm(x.bfloat16(), doubled_weight(norm.weight.bfloat16()), 1e-5)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), norm(x), atol=0.05, rtol=0.02)
