"""One config-driven decoder for the llama family (llama, mistral, qwen2, qwen3), Gemma 3 (text) and
the hybrids (qwen3_5_text / qwen3_5 text part, qwen3_next without MoE).

Parameter names are the HF checkpoint names, so an HF state dict loads directly:

    model.embed_tokens.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias where the config says)
    model.layers.{i}.self_attn.{q,k}_norm.weight      (qwen3)
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.{pre,post}_feedforward_layernorm.weight (gemma3)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight
    lm_head.weight                                     (tied: the same Parameter as embed_tokens)

Hybrids: a layer listed as "linear_attention" in `cfg.layer_types` has `model.layers.{i}.linear_attn.*`
(Gated DeltaNet, `kvsplice.layers.gated_deltanet`) instead of `self_attn`; attention layers have an
output gate (q_proj emits [q | gate] per head) and every RMSNorm weight is zero-centred. A
`qwen3_5` checkpoint's `model.language_model.*` keys load as `model.*`; its vision tower and MTP
head are ignored. Only attention layers have a KV-pool layer (`cfg.kv_layer_index`); linear
layers keep their state in a StatePool slot per request.

Gemma 3 (`cfg.sandwich_norms`): embeddings times sqrt(hidden_size); every norm zero-centred; the
attention and MLP outputs are normed too before they join the residual (so its
`post_attention_layernorm` norms the attention output, where llama's norms the MLP input); a
GELU-tanh MLP; scores scaled by query_pre_attn_scalar^-0.5; the sliding and the global layers each
with their own RoPE (`LayerRotaries`, which SCR relocation also turns keys with).

The model knows nothing of cache policy: a ForwardBatch says where each token's K/V goes and which
slots each request attends to. Keys are stored in the pool AFTER RoPE. All tokens of a forward go
through each projection as one matmul (prefill and mixed batches alike).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.state_pool import StatePool
from kvsplice.layers.attention import paged_attention, store_kv
from kvsplice.layers.block_int8_head import Int8Blocks
from kvsplice.layers.forward_batch import ForwardBatch
from kvsplice.layers.gated_deltanet import GatedDeltaNet
from kvsplice.layers.gguf_blocks import GroupedWeight
from kvsplice.layers.mlp import GatedMLP
from kvsplice.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from kvsplice.layers.quant_linear import BucketedLinear
from kvsplice.layers.rotary import LayerRotaries, Rotary, apply_rope
from kvsplice.models.config import ModelConfig


def make_norm(cfg: ModelConfig, dim: int, dtype: torch.dtype) -> nn.Module:
    """The RMSNorm flavour of this architecture."""
    norm_class = ZeroCenteredRMSNorm if cfg.norm_zero_centered else RMSNorm
    return norm_class(dim, cfg.rms_norm_eps, dtype)


class SelfAttention(nn.Module):
    """q/k/v projections, optional per-head q/k RMSNorm (qwen3), RoPE, paged attention, optional
    sigmoid output gate (hybrids), o_proj."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.gated = cfg.attn_output_gate
        self.q_proj = BucketedLinear(cfg.hidden_size, q_out * (1 + self.gated), bias=cfg.attention_bias, dtype=dtype)
        self.k_proj = BucketedLinear(cfg.hidden_size, kv_out, bias=cfg.attention_bias, dtype=dtype)
        self.v_proj = BucketedLinear(cfg.hidden_size, kv_out, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = BucketedLinear(q_out, cfg.hidden_size, bias=cfg.o_proj_bias, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg, cfg.head_dim, dtype)
            self.k_norm = make_norm(cfg, cfg.head_dim, dtype)
        self.qk_norm = cfg.qk_norm
        self.layer_id = cfg.kv_layer_index(layer_id)  # its layer in the KV pool
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.attention_scale
        self.sliding_window: Optional[int] = cfg.layer_window(layer_id)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """`x [T, hidden]` -> `[T, hidden]`. Side effect: writes this layer's K/V at batch.out_slots."""
        num_tokens = x.shape[0]
        gate = None
        if self.gated:  # per head [q | gate] (transformers' Qwen3NextAttention)
            q, gate = self.q_proj(x).view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(num_tokens, self.num_heads * self.head_dim)
        else:
            q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k, v = self.project_kv(x, cos, sin)
        if self.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin)
        # a windowed pool keeps a sliding layer's K/V in its own slots (kvsplice.cache.window_pool)
        batch = batch.for_layer(self.sliding_window is not None)
        store_kv(k, v, self.layer_id, batch.out_slots, pool)
        attended = paged_attention(q, self.layer_id, batch, pool, self.scale, self.sliding_window)
        attended = attended.reshape(num_tokens, self.num_heads * self.head_dim)
        if gate is not None:
            attended = attended * torch.sigmoid(gate)
        return self.o_proj(attended)


    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K (normed where the config says, then rotated) and V `[T, kv_heads, head_dim]` this
        layer stores for `x [T, hidden]` (already input-normed). Pure: writes nothing."""
        num_tokens = x.shape[0]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v


class DecoderLayer(nn.Module):
    """Pre-norm block: x + mixer(norm(x)), then + mlp(norm(.)); the mixer is attention
    (`self_attn`) or, for a hybrid's linear layers, Gated DeltaNet (`linear_attn`). With
    sandwich norms (Gemma 3): x + norm(attn(norm(x))), then + norm(mlp(norm(.)))."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, dtype)
        self.is_linear = bool(cfg.layer_types) and cfg.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.linear_attn, cfg.hidden_size, cfg.rms_norm_eps,
                                             cfg.linear_layer_index(layer_id), cfg.linear_attn.layout, dtype)
        else:
            self.self_attn = SelfAttention(cfg, layer_id, dtype)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, dtype)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, dtype)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, cfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, pool: KVPool, states: Optional[StatePool] = None) -> torch.Tensor:
        """`x [T, hidden]` -> `[T, hidden]`."""
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, batch, pool))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.is_linear:
            x = x + self.linear_attn(self.input_layernorm(x), batch, states)
        else:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """The HF `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, layer_id, dtype) for layer_id in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size, dtype)


# Keys an HF checkpoint may carry that are not weights (old llama checkpoints saved inv_freq).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# qwen3_5 checkpoints: the vision tower and the multi-token-prediction head are not used.
_IGNORED_PREFIXES = ("model.visual.", "mtp.")
_RENAMED_PREFIXES = (("model.language_model.", "model."),)


def _hf_name(name: str) -> str:
    for old, new in _RENAMED_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class Decoder(nn.Module):
    """A decoder-only LM built from a ModelConfig; see the module docstring for parameter names."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        # the WeightFormat the weights were rounded to (None: as loaded), and the FastDecoders built
        # on them, by (projections, lm_head) format: set by the ModelRunner, so that engines sharing
        # this Decoder compute with the same weights (rounding int4 data again moves some weights)
        self.applied_weight_format = None
        self.fast_decoders: dict = {}
        self.model = DecoderBody(cfg, dtype)
        self.lm_head = BucketedLinear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # one RoPE for every layer, or each layer's own (Gemma 3); SCR relocation turns keys with it
        self.rotary: Rotary | LayerRotaries = Rotary(cfg.rope)
        if cfg.layer_ropes:
            self.rotary = LayerRotaries(cfg.layer_ropes, cfg.kv_layers)
        # the lm_head as the checkpoint stores it, when that is int8 blocks (a GGUF Q8_0 head):
        # the exact weights the model-dtype lm_head rounds; the fast path's one-row head reads them
        self.head_blocks: Optional[Int8Blocks] = None
        # the checkpoint's GGUF blocks by parameter name, for `--weight-format gguf` (the fast path
        # multiplies few rows with them); empty unless the loader was asked for them
        self.gguf_blocks: dict[str, GroupedWeight] = {}

    @staticmethod
    def from_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> "Decoder":
        """A randomly initialised Decoder in `dtype` (load weights with `load_hf_state_dict`)."""
        return Decoder(cfg, dtype).eval()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor], head_blocks: Optional[Int8Blocks] = None) -> None:
        """Copy an HF state dict in (cast to this model's dtype). With tied embeddings `lm_head.weight`
        may be absent. `head_blocks`: the checkpoint's lm_head as int8 blocks (`Checkpoint.head_blocks`),
        kept as `self.head_blocks`; it must hold the weights the state dict's lm_head rounds.
        Raises ValueError listing missing or unexpected keys, or a shape mismatch."""
        sd = {_hf_name(name): tensor for name, tensor in sd.items()
              if not name.endswith(_IGNORED_SUFFIXES) and not name.startswith(_IGNORED_PREFIXES)}
        expected = set(self.state_dict())
        optional = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        missing = sorted(expected - set(sd) - optional)
        unexpected = sorted(set(sd) - expected)
        if missing or unexpected:
            raise ValueError(f"state dict does not fit {self.cfg.model_type}: "
                             f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                             f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
        if self.cfg.tie_word_embeddings:
            # one Parameter behind both names: load the embedding only, never a stale lm_head copy
            sd = {name: tensor for name, tensor in sd.items() if name != "lm_head.weight"}
        try:
            with torch.no_grad():
                self.load_state_dict(sd, strict=False)
        except RuntimeError as err:
            raise ValueError(f"state dict does not fit {self.cfg.model_type}: {err}") from err
        shape = (self.cfg.vocab_size, self.cfg.hidden_size)
        if head_blocks is not None and (head_blocks.out_features, head_blocks.in_features) != shape:
            raise ValueError(f"head_blocks of {head_blocks.out_features} x {head_blocks.in_features} "
                             f"do not fit an lm_head of {shape[0]} x {shape[1]}")
        self.head_blocks = head_blocks

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, states: Optional[StatePool] = None) -> torch.Tensor:
        """Run every token of `batch`; return fp32 logits `[len(batch.logit_rows), vocab]`.

        Side effects: writes each attention layer's K (after RoPE) and V of every token at
        batch.out_slots; for a hybrid (`states` and `batch.linear` required), updates each
        request's linear-layer state slot and the segments' checkpoint slots.
        """
        if self.cfg.is_hybrid and (states is None or len(batch.linear) != len(batch.seqs)):
            raise ValueError("a hybrid model needs a StatePool and one LinearSeq per request")
        hidden = self.model.embed_tokens(batch.input_ids)
        if self.cfg.scaled_embeddings:   # sqrt(hidden) rounded to the model dtype, as transformers
            hidden = hidden * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=hidden.dtype)
        tables = self._rope_tables(batch.positions)
        for layer, (cos, sin) in zip(self.model.layers, tables):
            hidden = layer(hidden, cos, sin, batch, pool, states)
        hidden = self.model.norm(hidden[batch.logit_rows])
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin for `positions`."""
        if isinstance(self.rotary, LayerRotaries):
            return self.rotary.cos_sin(positions)
        return [self.rotary.cos_sin(positions)] * self.cfg.num_layers
