"""Hybrid decoders (qwen3_5_text, qwen3_5 text part, qwen3_next): logits equal transformers'
forward on random tiny configs, prefill of 64 tokens then 16 decode steps, fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.state_pool import StatePool
from kvsplice.layers.forward_batch import ForwardBatch, LinearSeq, Segment, SeqSlice
from kvsplice.models.config import ModelConfig
from kvsplice.models.decoder import Decoder

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
            linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6,
            tie_word_embeddings=False)


def hf_tiny(model_type: str, seed: int = 0, **overrides):
    """A random transformers hybrid (norm weights and gates perturbed so nothing is trivial)."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextForCausalLM

    params = dict(TINY, **overrides)
    torch.manual_seed(seed)
    if model_type == "qwen3_next":
        config = Qwen3NextConfig(num_experts=0, **params)
        model = Qwen3NextForCausalLM(config)
    else:
        config = Qwen3_5TextConfig(**params)
        model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
            elif name.endswith(("A_log", "dt_bias")):
                param.add_(0.1 * torch.randn_like(param))
            elif param.dim() >= 2:
                param.normal_(0.0, 0.08)
    return model.float().eval()


def ours_from_hf(hf_model) -> tuple[Decoder, ModelConfig]:
    cfg = ModelConfig.from_hf_config(hf_model.config.to_dict())
    model = Decoder.from_config(cfg)
    model.load_hf_state_dict(hf_model.state_dict())
    return model, cfg


class SingleSeq:
    """One sequence run through our decoder step by step with its own pools (no engine)."""

    def __init__(self, model: Decoder, cfg: ModelConfig, capacity: int = 256):
        self.model, self.cfg = model, cfg
        self.pool = KVPool(capacity, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim)
        self.states = StatePool(4, cfg.num_linear_layers, cfg.linear_attn)
        self.state_slot = 0
        self.length = 0

    def feed(self, ids: list[int], segments: tuple[Segment, ...] | None = None) -> torch.Tensor:
        """Compute `ids` after what was fed before; logits of every new row."""
        n, start = len(ids), self.length
        positions = torch.arange(start, start + n)
        seq = SeqSlice(0, n, torch.arange(start + n), torch.arange(start + n))
        segments = segments or (Segment(0, n),)
        batch = ForwardBatch(torch.tensor(ids), positions, positions.clone(), (seq,), torch.arange(n),
                             (LinearSeq(self.state_slot, segments),))
        self.length += n
        return self.model(batch, self.pool, self.states)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_prefill_and_decode_match_transformers(model_type):
    hf = hf_tiny(model_type)
    model, cfg = ours_from_hf(hf)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.rope.rotary_dim == 4 and cfg.num_kv_layers == 1
    ids = torch.randint(0, TINY["vocab_size"], (80,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
    run = SingleSeq(model, cfg)
    prefill = run.feed(ids[:64])
    decode = torch.cat([run.feed([token]) for token in ids[64:]])
    assert (prefill - expected[:64]).abs().max() <= 1e-4
    assert (decode - expected[64:]).abs().max() <= 1e-4
    assert expected.std() > 0.05  # random enough that the comparison means something


def test_segments_and_checkpoints_change_nothing():
    """Cutting a prefill into segments with a checkpoint in the middle gives the same logits,
    and resuming a second sequence from that checkpoint equals running its prefix cold."""
    hf = hf_tiny("qwen3_5_text", seed=3)
    model, cfg = ours_from_hf(hf)
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = SingleSeq(model, cfg).feed(ids)
    cut = SingleSeq(model, cfg)
    pieces = cut.feed(ids, (Segment(0, 13, save_to=1), Segment(13, 14), Segment(14, 40)))
    # fp32 sums in another order (AVX2 and AVX-512 kernels differ): within 1e-5, relative or absolute
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)
    resumed = SingleSeq(model, cfg)
    resumed.states = cut.states
    resumed.pool = cut.pool
    resumed.state_slot, resumed.length = 2, 13
    resumed.states.copy(1, 2)
    torch.testing.assert_close(resumed.feed(ids[13:]), whole[13:], rtol=1e-5, atol=1e-5)


def test_qwen3_5_wrapper_config_and_weight_names():
    """A `qwen3_5` (vision-language) config and checkpoint load their text part."""
    hf = hf_tiny("qwen3_5_text", seed=4)
    text = hf.config.to_dict()
    wrapper = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False,
               "vision_config": {"depth": 1}}
    cfg = ModelConfig.from_hf_config(wrapper)
    assert cfg.model_type == "qwen3_5_text" and cfg.is_hybrid
    sd = {("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
          for k, v in hf.state_dict().items()}
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(2)
    sd["mtp.fc.weight"] = torch.zeros(2)
    model = Decoder.from_config(cfg)
    model.load_hf_state_dict(sd)
    assert torch.equal(model.model.layers[0].linear_attn.A_log, hf.model.layers[0].linear_attn.A_log)


def test_qwen3_next_moe_is_refused():
    with pytest.raises(ValueError, match="MoE"):
        ModelConfig.from_hf_config(dict(TINY, model_type="qwen3_next", num_hidden_layers=4,
                                        num_attention_heads=4, num_experts=8))
