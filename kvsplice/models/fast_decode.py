"""FastDecoder: the forward of an attention-only Decoder, flattened for speed. The Decoder
(`kvsplice.models.decoder`) stays the readable reference; tests compare the two.

On a small model a decode step is mostly per-op overhead, not FLOPs, so this path cuts ops:

  - fused projections: q|k|v in one matmul, gate|up in one (`PackedLinear`, built once);
  - weights in a packed format for small batches (int8 / int4 kernels, `--weight-format`);
  - RMSNorm as one layer_norm kernel (`rms_norm_via_layer_norm`), RoPE on q and k together;
  - decode rows attend over their DecodeArena rows (contiguous K/V, one batched SDPA per layer)
    instead of gathering their context slots from the pool in every layer;
  - no per-request Python inside the layer loop except for the non-decode chunks, which take
    the reference attention exactly as the Decoder does, with their SequencePlans (context view or
    gather, position mask) made once per forward instead of once per layer.

Per layer, T rows (decode rows first):

    h -> rms_norm -> qkv -> [q | k | v] -> rope(q, k) -> pool[out_slots] <- k, v
                                            decode rows:  arena[row, pos] <- k, v; SDPA over arena rows
                                            other rows:   planned_attention (planned once per forward)
      -> o_proj + h -> rms_norm -> gate|up -> act(gate) * up -> down + h

Gemma 3 (sandwich norms) norms the attention and the MLP outputs too, with (1 + weight) norms:

      -> norm(o_proj) + h -> norm -> gate|up -> gelu_tanh(gate) * up -> norm(down) + h

A sliding-window layer of width W reads only the window: its decode rows read the arena columns
from min(lengths) - W on (with a windowed pool, the arena's ring of W columns instead), and a prefill chunk is cut into blocks of W queries, each over the
context positions (first - W, last] of its block, so its cost grows with the window, not with
the context.

With `compile_decode`, a batch of arena decode rows only runs instead as one compiled graph of
`arena_decode_hidden` (kvsplice.models.compiled_decode); this eager path stays its reference. A
model with both sliding and full layers (Gemma 3) takes it over a windowed pool's window slots and
the arena's rings:

    layer i full:     pool k/v[full index]    at out_slots           arena k/v[full index]   (row, position)
    layer i sliding:  window k/v[ring index]  at the window slots    ring k/v[ring index]    (row, position % W)

Where the checkpoint stores its lm_head as int8 blocks (a GGUF Q8_0 head) and the model runs in
bf16 or fp16 on the CPU, the logits of up to 8 rows come from those blocks by a C kernel
(kvsplice.layers.block_int8_head: the exact weights, in half the bytes of the bf16 copy); more rows
use the dense head.

Eligible models (`FastDecoder.supports`): every layer attention (full or sliding window) without
an output gate, full-width RoPE (one, or one per layer: Gemma 3); optional q/k norm (qwen3,
Gemma 3), biases, zero-centred norms, sandwich norms, scaled embeddings, a GELU-tanh MLP, logit
softcapping. Others (the hybrids: `FastDecoder.refusal` says why) use the Decoder for every batch.
The compiled decode step takes them all but a model whose every layer slides (`FastDecoder.compile_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from kvsplice.cache.decode_arena import DecodeArena
from kvsplice.cache.kv_pool import KVPool
from kvsplice.layers.attention import (SequencePlan, contiguous_decode_attention, length_mask,
                                      plan_sequence, planned_attention)
from kvsplice.layers.block_int8_head import BlockInt8Head, Int8Blocks, build_row_head, row_head_serves
from kvsplice.layers.forward_batch import ForwardBatch
from kvsplice.layers.norm import doubled_weight, rms_norm_via_layer_norm
from kvsplice.layers.gguf_linear import GGUFPlanesLinear
from kvsplice.layers.mlp import ACTIVATIONS
from kvsplice.layers.quant_linear import PackedLinear
from kvsplice.layers.rotary import LayerRotaries, Rotary
from kvsplice.models.compiled_decode import CompiledDecode, DecodeBuilder, GraphSpec
from kvsplice.models.config import ModelConfig
from kvsplice.models.decoder import Decoder
from kvsplice.models.default_model import cache_dir
from kvsplice.utils.thread_policy import ThreadPolicy


# `--weight-format gguf`: rows up to this many multiply the GGUF blocks' int4 planes, more rows the
# dense copy (the kernel dequantizes per row; on Gemma 3 270M's head, one row on the planes was
# faster than the bf16 matmul, more rows slower: benchmarks/gemma3.py)
GGUF_PLANE_ROWS = 1


@dataclass(frozen=True)
class DecodeStep:
    """The arena decode rows of one forward: rows 0..count-1 of the batch and of the arena, at
    `positions`; the longest context `width`, the length mask (None when all are `width`), the
    arena's K/V views of those rows per layer (`DecodeArena.step_views`), and whether the batch
    is these rows only (`only`: no slicing of the rows in every layer). Sliding-window layers
    read the columns from `window_start` on, masked by `window_mask` (None: all visible)."""

    count: int
    rows: torch.Tensor
    positions: torch.Tensor
    width: int
    mask: Optional[torch.Tensor]
    k_rows: tuple[torch.Tensor, ...]
    v_rows: tuple[torch.Tensor, ...]
    only: bool
    window_start: int = 0
    window_mask: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class PlannedRows:
    """Rows `rows` of the batch (one request's queries, or a block of them) and their plan."""

    rows: slice
    plan: SequencePlan


@dataclass(frozen=True)
class FastLayer:
    """One decoder layer's weights as the fast path uses them (norm weights doubled, see
    `rms_norm_via_layer_norm`; zero-centred ones as 1 + weight in fp32). `post_norm` norms the
    MLP input, or with sandwich norms the attention output (then `pre_ffn_norm` norms the MLP
    input and `post_ffn_norm` its output). `rope`: the index of this layer's RoPE among the
    model's distinct ones; `window`: its sliding window (None: full attention)."""

    input_norm: torch.Tensor
    qkv: PackedLinear
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    o_proj: PackedLinear
    post_norm: torch.Tensor
    gate_up: PackedLinear
    down: PackedLinear
    pre_ffn_norm: Optional[torch.Tensor] = None
    post_ffn_norm: Optional[torch.Tensor] = None
    rope: int = 0
    window: Optional[int] = None


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and the signed sin `[T, 1, D]` such that rope(x) = x cos + roll(x, D/2) sin_signed:
    rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1 .. -1, 1 .. 1] (RoFormer, half-split layout)."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos[:, None, :], signed[:, None, :]


def fast_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` for a full-width rotary: x `[T, H, D]`, fp32 tables from `_rope_tables`; math
    in fp32 (a bf16 x is promoted inside each op, exactly as if converted first), returns x.dtype."""
    rotated = torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
    return rotated if x.dtype is torch.float32 else rotated.to(x.dtype)


@torch.no_grad()
def _fuse(linears: list[nn.Linear], fmt: str) -> PackedLinear:
    """One PackedLinear for `linears` side by side. Side effect: each module's weight (and bias)
    becomes a view of the PackedLinear's dense copy, so the reference path keeps computing with
    exactly the same numbers and the model's weights are held once, not twice."""
    packed = PackedLinear.build([m.weight for m in linears], [m.bias for m in linears], fmt)
    start = 0
    for module in linears:
        end = start + module.out_features
        module.weight = nn.Parameter(packed.weight[start:end], requires_grad=False)
        if module.bias is not None:
            module.bias = nn.Parameter(packed.bias[start:end], requires_grad=False)
        start = end
    return packed


class FastDecoder:
    """Runs ForwardBatches on `model`'s weights, fused and packed in `weight_format` (the model's
    own weights must already be rounded to that format, see `kvsplice.models.quantize`).
    Construction re-points `model`'s projection weights to views of the fused copies (`_fuse`)."""

    def __init__(self, model: Decoder, weight_format: str = "dense", lm_head_format: str | None = None,
                 compile_decode: bool = False, threads: ThreadPolicy | None = None,
                 decode_builder: DecodeBuilder | None = None):
        cfg = model.cfg
        if not self.supports(cfg):
            raise ValueError(f"{cfg.model_type}: the fast path needs an attention-only model without "
                             f"output gates or partial rotary ({self.refusal(cfg)})")
        self.cfg, self.rotary = cfg, model.rotary
        layer_rotaries = (model.rotary.layers if isinstance(model.rotary, LayerRotaries)
                          else (model.rotary,) * cfg.num_layers)
        # the distinct RoPEs (Gemma 3: the sliding layers' and the global ones'), tables made once each
        self.rotaries: tuple[Rotary, ...] = tuple({id(r): r for r in layer_rotaries}.values())
        rope_index = [self.rotaries.index(rotary) for rotary in layer_rotaries]
        self.embed = model.model.embed_tokens.weight.detach()
        # sqrt(hidden) rounded to the model dtype, as the Decoder (and transformers) multiply
        self.embed_scale = (torch.tensor(cfg.hidden_size ** 0.5, dtype=self.embed.dtype)
                            if cfg.scaled_embeddings else None)
        self.gguf_blocks = model.gguf_blocks if weight_format == "gguf" else {}
        self.layers = [self._fast_layer(i, layer, weight_format, rope_index[i], cfg.layer_window(i))
                       for i, layer in enumerate(model.model.layers)]
        self.windows = sorted({layer.window for layer in self.layers if layer.window is not None})
        # where each layer's K/V lie in the tensors `arena_decode_hidden` takes: with sliding and full
        # layers (a windowed pool, arena rings), its index among the layers of its kind, else its own
        sliding = [layer.window is not None for layer in self.layers]
        self.uses_rings = any(sliding) and not all(sliding)
        self.kv_index = (tuple(sliding[:i].count(kind) for i, kind in enumerate(sliding)) if self.uses_rings
                         else tuple(range(len(self.layers))))
        self.final_norm = self._norm_weight(model.model.norm.weight)
        head_format = lm_head_format or weight_format
        # a dense (possibly tied) lm_head is used as it is; a packed one has its own dense copy
        if head_format in ("dense", "gguf"):
            self.lm_head = PackedLinear.build([model.lm_head.weight], [None], "dense")
        else:
            self.lm_head = _fuse([model.lm_head], head_format)
        # the logits of up to 8 rows from the checkpoint's own int8 blocks (a GGUF Q8_0 head), in
        # place of a dense head or of the GGUF planes' two int4 planes of it (fewer bytes, exact);
        # as many rows as it measures faster than the dense head at
        self.row_head = self._row_head(model.head_blocks if head_format in ("dense", "gguf") else None)
        if self.row_head is not None:
            self.row_head.fit_rows(self.lm_head)
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        if head_format == "gguf" and head_name in model.gguf_blocks and self.row_head is None:
            self.lm_head = GGUFPlanesLinear([model.gguf_blocks[head_name]], self.lm_head, GGUF_PLANE_ROWS)
        self.eps = cfg.rms_norm_eps
        self.q_width = cfg.num_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        self.act = ACTIVATIONS[cfg.hidden_act]
        threads = threads or ThreadPolicy.from_config(None)
        self.compiled = self._compile(threads, decode_builder) if compile_decode else None

    def _row_head(self, blocks: Optional[Int8Blocks]) -> Optional[BlockInt8Head]:
        """The head of `blocks` where `row_head_serves` this model (its kernel built into kvsplice's
        cache, `native/`), else None."""
        if blocks is None or not row_head_serves(self.embed.dtype, self.embed.device):
            return None
        return build_row_head(blocks, self.embed.dtype, cache_dir() / "native")

    @staticmethod
    def supports(cfg: ModelConfig) -> bool:
        """True when every layer is attention of a kind this path implements."""
        return FastDecoder.refusal(cfg) is None

    @staticmethod
    def refusal(cfg: ModelConfig) -> str | None:
        """What in `cfg` this path does not implement (None: it runs the model)."""
        reasons = {"linear-attention layers": cfg.is_hybrid, "an attention output gate": cfg.attn_output_gate,
                   "partial rotary": any(cfg.layer_rope(i).rotary_dim != cfg.head_dim for i in range(cfg.num_layers)),
                   "an unknown MLP activation": cfg.hidden_act not in ACTIVATIONS}
        found = [reason for reason, present in reasons.items() if present]
        return ", ".join(found) if found else None

    @staticmethod
    def compile_refusal(cfg: ModelConfig) -> str | None:
        """What in `cfg` the compiled decode step (`arena_decode_hidden`) does not implement, on top
        of `refusal` (None: it compiles the model). Sliding layers it takes beside full ones only:
        their K/V then live in a windowed pool and the arena's rings, which it reads; a model whose
        every layer slides keeps the plain pool, read through window columns."""
        every_layer_slides = all(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
        return FastDecoder.refusal(cfg) or ("sliding windows on every layer" if every_layer_slides else None)

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The doubled weight `rms_norm_via_layer_norm` takes for an RMSNorm of `weight`: a zero-centred
        norm's as 1 + weight in fp32 (its product is computed in fp32 and rounded once, as
        ZeroCenteredRMSNorm does)."""
        return doubled_weight(1.0 + weight.detach().float() if self.cfg.norm_zero_centered else weight)

    def _fast_layer(self, layer_id: int, layer, fmt: str, rope: int, window: Optional[int]) -> FastLayer:
        attn, mlp = layer.self_attn, layer.mlp
        sandwich = self.cfg.sandwich_norms

        def fused(prefix: str, module, names: tuple[str, ...]):
            return self._fused([getattr(module, name) for name in names],
                               [f"model.layers.{layer_id}.{prefix}.{name}.weight" for name in names], fmt)

        return FastLayer(
            input_norm=self._norm_weight(layer.input_layernorm.weight),
            qkv=fused("self_attn", attn, ("q_proj", "k_proj", "v_proj")),
            q_norm=self._norm_weight(attn.q_norm.weight) if attn.qk_norm else None,
            k_norm=self._norm_weight(attn.k_norm.weight) if attn.qk_norm else None,
            o_proj=fused("self_attn", attn, ("o_proj",)),
            post_norm=self._norm_weight(layer.post_attention_layernorm.weight),
            gate_up=fused("mlp", mlp, ("gate_proj", "up_proj")),
            down=fused("mlp", mlp, ("down_proj",)),
            pre_ffn_norm=self._norm_weight(layer.pre_feedforward_layernorm.weight) if sandwich else None,
            post_ffn_norm=self._norm_weight(layer.post_feedforward_layernorm.weight) if sandwich else None,
            rope=rope, window=window)

    def _fused(self, linears: list[nn.Linear], names: list[str], fmt: str):
        """`_fuse(linears, fmt)`; for "gguf", the fused dense copy with the GGUF blocks of `names`
        for few rows (a GGUFPlanesLinear), where the checkpoint has them all."""
        if fmt != "gguf":
            return _fuse(linears, fmt)
        dense = _fuse(linears, "dense")
        if not all(name in self.gguf_blocks for name in names):
            return dense
        return GGUFPlanesLinear([self.gguf_blocks[name] for name in names], dense, GGUF_PLANE_ROWS)

    def _compile(self, threads: ThreadPolicy, builder: DecodeBuilder | None) -> CompiledDecode:
        """The compiled decode step at the thread counts `threads` runs decode steps at, built by
        `builder` in the background (see kvsplice.models.compiled_decode). It needs few-row kernels
        the graph can trace: packed int4 / int8 projections, or GGUF blocks' int4 planes (a GGUF
        part without planes, Q6_K, multiplies its dense copy in the graph)."""
        refused = self.compile_refusal(self.cfg)
        if refused is not None:
            raise ValueError(f"--compile-decode does not run {self.cfg.model_type} ({refused}); leave it off")
        linears = [linear for layer in self.layers for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        if not all(isinstance(linear, GGUFPlanesLinear) or linear.packed is not None for linear in linears):
            raise ValueError("--compile-decode needs int4 or int8 projections (--weight-format int4|int8|auto "
                             "on a checkpoint whose weights it packs) or a GGUF's blocks (--weight-format gguf)")
        cfg = self.cfg
        ring_count = sum(layer.window is not None for layer in self.layers) if self.uses_rings else 0
        spec = GraphSpec(min(linear.small_batch_rows for linear in linears), cfg.num_layers - ring_count,
                         cfg.num_kv_heads, cfg.head_dim, self.embed.dtype, threads.compiled_step_counts(),
                         ring_count, self.windows[0] if ring_count else None)
        return CompiledDecode(self.arena_decode_hidden, spec, builder)

    @property
    def few_row_limit(self) -> int:
        """The most rows any projection (the lm_head too) multiplies with a few-row kernel (0: none
        has one). A forward of more rows than this computes every row by the dense path, whose bf16
        bits do not depend on the row count (kvsplice.layers.quant_linear, "Batch invariance")."""
        linears = [linear for layer in self.layers for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        return max(linear.few_row_limit for linear in [*linears, self.lm_head])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, arena: Optional[DecodeArena] = None) -> torch.Tensor:
        """Same contract as `Decoder.forward` (fp32 logits of `batch.logit_rows`; writes every
        token's K/V into `pool`), plus: the `batch.arena_rows` leading decode rows attend over
        `arena` rows 0..arena_rows-1 and their K/V is also written there."""
        return self.logits(self.final_hidden(batch, pool, arena))

    def final_hidden(self, batch: ForwardBatch, pool: KVPool, arena: Optional[DecodeArena] = None,
                     allow_compiled: bool = True) -> torch.Tensor:
        """`forward` up to the lm_head: the final-normed hidden states of `batch.logit_rows`. A
        batch of arena decode rows only runs on the compiled step where there is one, it covers
        the batch and `allow_compiled`."""
        if pool.k.dtype != self.embed.dtype:
            raise ValueError(f"the pool holds {pool.k.dtype}, the model computes in {self.embed.dtype}")
        if allow_compiled and self._compiled_covers(batch, arena):
            hidden = self.compiled(*self._compiled_inputs(batch, pool, arena))
            return hidden[batch.logit_rows]
        hidden = self._embed(batch.input_ids)
        tables = [_rope_tables(*rotary.cos_sin(batch.positions)) for rotary in self.rotaries]
        decode = self._decode_step(batch, arena)
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        # once, not in every layer: the full layers' plans, and each window's
        # (a windowed pool: the sliding layers' plans over the batch in window slots)
        plans = {window: plan_rows(batch.for_layer(window is not None), self._layer_rows(pool, window),
                                   self.embed.dtype, group, window) for window in [None, *self.windows]}
        for layer_id, layer in enumerate(self.layers):
            hidden = self._layer(layer_id, layer, hidden, tables[layer.rope], batch, pool, arena, decode,
                                 plans[layer.window])
        return rms_norm_via_layer_norm(hidden[batch.logit_rows], self.final_norm, self.eps)

    def _layer_rows(self, pool: KVPool, window: Optional[int]) -> int:
        """Rows of the pool tensor that layers of `window` read (window slots in a windowed pool)."""
        layer_id = next(i for i, layer in enumerate(self.layers) if layer.window == window)
        return pool.k_layer(layer_id).shape[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed)
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def arena_decode_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
                            mask: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                            arena_k: torch.Tensor, arena_v: torch.Tensor,
                            window_slots: Optional[torch.Tensor] = None, ring_mask: Optional[torch.Tensor] = None,
                            window_k: Optional[torch.Tensor] = None, window_v: Optional[torch.Tensor] = None,
                            ring_k: Optional[torch.Tensor] = None, ring_v: Optional[torch.Tensor] = None
                            ) -> torch.Tensor:
        """`final_hidden` of a batch that is arena decode rows only, from plain tensors: the
        function `kvsplice.models.compiled_decode` compiles (no Python objects that change
        between steps, so one graph serves every step).

        Rows 0..B-1 of the arena decode `input_ids [B]` at `positions [B]`; `mask` is
        `length_mask(lengths, width)` for their context lengths and longest context `width`.
        Writes each row's K/V into the pool (`KVPool.k / v`, `[layers, slots, Hkv, D]`) at
        `out_slots` and into the arena (`DecodeArena.k / v`, `[layers, rows, Hkv, capacity, D]`) at
        (row, position), as `final_hidden` does. Each write indexes the whole input tensor, layer
        included, so that the compiled graph updates it in place (a write into a view made inside
        the graph makes inductor copy the whole buffer back), and a few tensors, not one per layer,
        are what the graph's guards check before every step.

        With sliding and full layers (`uses_rings`: a WindowedKVPool and arena rings), `pool_k / v`
        and `arena_k / v` hold the full layers only, and the sliding ones write `window_k / v`
        (`WindowedKVPool.window_k / v`) at `window_slots` (the rows' window slots) and the rings
        (`DecodeArena.ring_k / v`, W columns) at (row, position % W), and attend over all W
        columns, masked by `ring_mask` (`length_mask(min(lengths, W), W)`: a width that never
        changes, so that no graph specialises on a context shorter or longer than the window).
        ValueError when the model needs them and they are missing."""
        if self.uses_rings and ring_k is None:
            raise ValueError("a model with sliding and full layers decodes over a windowed pool and arena rings")
        rows = torch.arange(input_ids.shape[0])
        hidden = self._embed(input_ids)
        tables = [_rope_tables(*rotary.cos_sin(positions)) for rotary in self.rotaries]
        for layer_id, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, hidden, *tables[layer.rope])
            index = self.kv_index[layer_id]
            if layer.window is not None and self.uses_rings:
                attended = _write_and_attend(q, k, v, index, window_slots, window_k, window_v, ring_k, ring_v,
                                             rows, positions % ring_k.shape[3], ring_mask, self.scale)
            else:
                attended = _write_and_attend(q, k, v, index, out_slots, pool_k, pool_v, arena_k, arena_v,
                                             rows, positions, mask, self.scale)
            hidden = self._out_and_mlp(layer, hidden, attended)
        return rms_norm_via_layer_norm(hidden, self.final_norm, self.eps)

    def _compiled_covers(self, batch: ForwardBatch, arena: Optional[DecodeArena]) -> bool:
        """True when `batch` is arena decode rows only and a compiled graph takes them (a model with
        sliding layers: over the arena's rings)."""
        count = batch.arena_rows
        if self.compiled is None or arena is None or count == 0 or batch.seqs or count != batch.input_ids.shape[0]:
            return False
        if self.uses_rings != bool(arena.ring_layers) or (self.uses_rings and batch.window is None):
            return False   # rings need the batch in window slots too
        return self.compiled.covers(count, max(arena.lengths[:count]), arena.rows, arena.capacity)

    def _compiled_inputs(self, batch: ForwardBatch, pool: KVPool, arena: DecodeArena) -> tuple:
        """`arena_decode_hidden`'s arguments for `batch` (every mask a tensor, even where all is
        visible, so that one graph takes every step)."""
        lengths = torch.tensor(arena.lengths[:batch.arena_rows])
        inputs = (batch.input_ids, batch.positions, batch.out_slots, length_mask(lengths, int(lengths.max())),
                  pool.k, pool.v, arena.k, arena.v)
        if not self.uses_rings:
            return inputs
        held = lengths.clamp(max=arena.ring_width)   # a ring holds min(length, W) columns of its row
        return (*inputs, batch.window.out_slots, length_mask(held, arena.ring_width),
                pool.window_k, pool.window_v, arena.ring_k, arena.ring_v)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of `final_hidden`'s rows (the lm_head): up to 8 rows on `row_head` where there
        is one (the checkpoint's exact weights), more rows on the dense head (those weights in the
        model dtype); softcapped where the model says (tanh(logits / cap) cap)."""
        logits = self.row_head(hidden) if self.row_head is not None and self.row_head.covers(hidden) else None
        if logits is None:
            logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _decode_step(self, batch: ForwardBatch, arena: Optional[DecodeArena]) -> Optional[DecodeStep]:
        """What every layer needs to know of the arena decode rows, or None without any."""
        count = batch.arena_rows
        if count == 0:
            return None
        if arena is None or len(arena.lengths) < count:
            raise ValueError("a batch with arena rows needs the DecodeArena that holds them")
        lengths = arena.lengths[:count]
        width = max(lengths)
        mask = None if min(lengths) == width else length_mask(torch.tensor(lengths), width)
        k_rows, v_rows = arena.step_views(count, width)
        window_start, window_mask = 0, None
        if self.windows and arena.ring_layers:   # rings of W columns: a row of length L holds min(L, W)
            window_mask = ring_mask(lengths, arena.ring_width)
        elif self.windows:
            window_start, window_mask = window_columns(lengths, self._single_window())
        return DecodeStep(count, torch.arange(count), batch.positions[:count], width, mask, k_rows, v_rows,
                          only=not batch.seqs and count == batch.input_ids.shape[0],
                          window_start=window_start, window_mask=window_mask)

    def _single_window(self) -> int:
        if len(self.windows) != 1:
            raise ValueError(f"the fast path takes one sliding window width, not {self.windows}")
        return self.windows[0]

    def _layer(self, layer_id: int, layer: FastLayer, hidden: torch.Tensor, tables,
               batch: ForwardBatch, pool: KVPool, arena: Optional[DecodeArena],
               decode: Optional[DecodeStep], plans: tuple[PlannedRows, ...]) -> torch.Tensor:
        q, k, v = self._qkv(layer, hidden, *tables)
        out_slots = batch.for_layer(layer.window is not None).out_slots
        pool.k_layer(layer_id).index_copy_(0, out_slots, k)
        pool.v_layer(layer_id).index_copy_(0, out_slots, v)
        attended = self._attention(layer_id, layer, q, k, v, batch, pool, arena, decode, plans)
        return self._out_and_mlp(layer, hidden, attended)

    def _qkv(self, layer: FastLayer, hidden: torch.Tensor, cos, sin_signed):
        """q `[T, Hq, D]`, k and v `[T, Hkv, D]` of `hidden [T, H]`: norm, fused projection, RoPE."""
        cfg, rows = self.cfg, hidden.shape[0]
        qkv = layer.qkv(rms_norm_via_layer_norm(hidden, layer.input_norm, self.eps))
        heads = qkv.view(rows, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)   # [q heads | k | v]
        k_end = cfg.num_heads + cfg.num_kv_heads
        v = heads[:, k_end:]
        if layer.q_norm is None:   # q and k side by side: one rotation for both
            qk = fast_rope(heads[:, :k_end], cos, sin_signed)
            return qk[:, :cfg.num_heads], qk[:, cfg.num_heads:], v
        q = rms_norm_via_layer_norm(heads[:, :cfg.num_heads], layer.q_norm, self.eps)
        k = rms_norm_via_layer_norm(heads[:, cfg.num_heads:k_end], layer.k_norm, self.eps)
        return fast_rope(q, cos, sin_signed), fast_rope(k, cos, sin_signed), v

    def _out_and_mlp(self, layer: FastLayer, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention: o_proj and residual, then the gated MLP and
        residual (with sandwich norms, each output normed before it joins the residual)."""
        out = layer.o_proj(attended.reshape(hidden.shape[0], self.q_width))
        if layer.post_ffn_norm is None:
            hidden = hidden + out
            gate_up = layer.gate_up(rms_norm_via_layer_norm(hidden, layer.post_norm, self.eps))
            width = gate_up.shape[1] // 2
            return hidden + layer.down(self.act(gate_up[:, :width]) * gate_up[:, width:])
        hidden = hidden + rms_norm_via_layer_norm(out, layer.post_norm, self.eps)
        gate_up = layer.gate_up(rms_norm_via_layer_norm(hidden, layer.pre_ffn_norm, self.eps))
        width = gate_up.shape[1] // 2
        down = layer.down(self.act(gate_up[:, :width]) * gate_up[:, width:])
        return hidden + rms_norm_via_layer_norm(down, layer.post_ffn_norm, self.eps)

    def _attention(self, layer_id: int, layer: FastLayer, q, k, v, batch: ForwardBatch, pool: KVPool,
                   arena: Optional[DecodeArena], decode: Optional[DecodeStep],
                   plans: tuple[PlannedRows, ...]) -> torch.Tensor:
        """Arena attention for the decode rows, the planned path for the rest."""
        k_layer, v_layer = pool.k_layer(layer_id), pool.v_layer(layer_id)
        if decode is None:
            return attend_planned(q, plans, k_layer, v_layer, self.scale)
        count = decode.count
        # the decode rows lead the batch (no slicing when they are all of it)
        q_rows, k_rows, v_rows = (q, k, v) if decode.only else (q[:count], k[:count], v[:count])
        arena.write(layer_id, k_rows, v_rows, decode.rows, decode.positions)
        keys, values, mask = decode.k_rows[layer_id], decode.v_rows[layer_id], decode.mask
        if layer.window is not None:
            start = decode.window_start
            keys, values, mask = keys[:, :, start:], values[:, :, start:], decode.window_mask
        decoded = contiguous_decode_attention(q_rows, keys, values, mask, self.scale)
        if not batch.seqs:
            return decoded
        out = attend_planned(q, plans, k_layer, v_layer, self.scale)
        out[:count] = decoded
        return out


def _write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int, slots: torch.Tensor,
                      pool_k: torch.Tensor, pool_v: torch.Tensor, arena_k: torch.Tensor, arena_v: torch.Tensor,
                      rows: torch.Tensor, columns: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One layer's K/V of the decode rows written at layer `index` of the pool tensors (at `slots`)
    and of the arena tensors (at (row, column)), then the rows' attention over their first
    `mask.shape[-1]` arena columns. Indexes the whole tensors (see `arena_decode_hidden`)."""
    layer_index = torch.full_like(slots, index)
    pool_k.index_put_((layer_index, slots), k)
    pool_v.index_put_((layer_index, slots), v)
    arena_k[layer_index, rows, :, columns] = k
    arena_v[layer_index, rows, :, columns] = v
    width, count = mask.shape[-1], q.shape[0]
    return contiguous_decode_attention(q, arena_k[index, :count, :, :width], arena_v[index, :count, :, :width],
                                       mask, scale)


def window_columns(lengths: list[int], window: int) -> tuple[int, Optional[torch.Tensor]]:
    """The arena columns a sliding layer of width `window` reads for rows of `lengths` (each row's
    own token the last): from `start` = min(lengths) - window on, and the `[B, 1, 1, width - start]`
    mask of each row's window [length - window, length) there (None when every row sees all).

        row lengths 9, 6; window 4:   columns 2 .. 8     row 0 sees 5..8, row 1 sees 2..5
    """
    width, start = max(lengths), max(0, min(lengths) - window)
    if min(lengths) == width:
        return start, None
    columns = torch.arange(start, width)[None, :]
    ends = torch.tensor(lengths)[:, None]
    visible = (columns < ends) & (columns >= ends - window)
    return start, visible[:, None, None, :]


def ring_mask(lengths: list[int], ring_width: int) -> Optional[torch.Tensor]:
    """The `[B, 1, 1, min(max(lengths), ring_width)]` mask of DecodeArena rings (a windowed pool's
    sliding layers): row b's first min(lengths[b], ring_width) columns hold its window; None when
    every row's are all of them."""
    held = [min(length, ring_width) for length in lengths]
    if min(held) == max(held):
        return None
    return length_mask(torch.tensor(held), max(held))


def plan_rows(batch: ForwardBatch, num_slots: int, dtype: torch.dtype, group: int,
              window: Optional[int]) -> tuple[PlannedRows, ...]:
    """The attention plans of `batch`'s requests (`seqs`) over a pool layer of `num_slots` rows:
    one per request for full attention; for a
    sliding window of width W, one per block of up to W queries, over the context entries at
    positions (first query - W, last query] only (the rest is outside every query's window):

        positions   0 ............ 1000 ...... 1511 | queries 1000..1511 (W = 512)
        block 1     keys 489 .. 1511, queries 1000 .. 1511

    so a long chunk costs O(queries x W) on that layer, not O(queries x context)."""
    planned = []
    for seq in batch.seqs:
        query_pos = batch.positions[seq.query_start:seq.query_start + seq.query_len]
        if window is None:
            plan = plan_sequence(query_pos, seq.context_slots, seq.context_pos, num_slots, dtype, None, group)
            planned.append(PlannedRows(slice(seq.query_start, seq.query_start + seq.query_len), plan))
            continue
        for first in range(0, seq.query_len, window):
            block = query_pos[first:first + window]
            keep = (seq.context_pos > block.min() - window) & (seq.context_pos <= block.max())
            plan = plan_sequence(block, seq.context_slots[keep], seq.context_pos[keep], num_slots, dtype,
                                 window, group)
            start = seq.query_start + first
            planned.append(PlannedRows(slice(start, start + block.numel()), plan))
    return tuple(planned)


def attend_planned(q: torch.Tensor, plans: tuple[PlannedRows, ...], k_layer: torch.Tensor,
                   v_layer: torch.Tensor, scale: float) -> torch.Tensor:
    """`q [T, Hq, D]`'s attention, each planned block of rows over its plan's keys; the rows no plan
    covers (arena decode rows) are left for the caller. Returns `[T, Hq, D]`."""
    out = torch.empty_like(q)
    for entry in plans:
        out[entry.rows] = planned_attention(q[entry.rows], entry.plan, k_layer, v_layer, scale)
    return out
