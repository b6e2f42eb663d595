"""Model configuration: what the decoder needs to know, read from a transformers config.json dict.

One table (`ARCH_FACTS`) holds what differs between the supported architectures; everything else
is read the same way for all of them. RoPE parameters are read as transformers 5.x does
(`modeling_rope_utils.RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` and
`standardize_rope_params`): a legacy `rope_scaling` dict wins over `rope_parameters`, and
`rope_theta` / `partial_rotary_factor` found at the top level fill in what the dict lacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

from kvsplice.layer_configs import HybridLayout, LinearAttnConfig, RopeConfig

LayerType = Literal["full_attention", "sliding_attention", "linear_attention"]
SlidingRule = Literal["none", "every_layer", "qwen_window_layers", "layer_pattern"]
Activation = Literal["silu", "gelu_pytorch_tanh"]

_ROPE_KINDS: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
_DEFAULT_THETA = 10_000.0


@dataclass(frozen=True)
class ArchFacts:
    """What one architecture fixes or defaults (the transformers config class defaults)."""

    qkv_bias: Optional[bool]          # None: follow config `attention_bias`
    o_bias_follows_config: bool       # o_proj has a bias iff `attention_bias` (llama, qwen3)
    qk_norm: bool                     # per-head RMSNorm on q and k before RoPE (qwen3)
    default_head_dim: Optional[int]   # None: hidden_size // num_heads
    default_kv_heads: Optional[int]   # None: num_heads
    default_max_pos: int
    default_bos: Optional[int]
    default_eos: Optional[int]
    sliding: SlidingRule
    hybrid: Optional[HybridLayout] = None  # Gated DeltaNet layers + gated attention (qwen3_5/next)
    gemma: bool = False   # Gemma 3 blocks: scaled embeddings, four zero-centred norms per layer,
                          # GELU-tanh, query_pre_attn_scalar, a RoPE per layer type, tied by default


ARCH_FACTS: dict[str, ArchFacts] = {
    "llama": ArchFacts(None, True, False, None, None, 2048, 1, 2, "none"),
    "mistral": ArchFacts(False, False, False, None, 8, 4096 * 32, 1, 2, "every_layer"),
    "qwen2": ArchFacts(True, False, False, None, 32, 32768, None, None, "qwen_window_layers"),
    "qwen3": ArchFacts(None, True, True, 128, 32, 32768, None, None, "qwen_window_layers"),
    # hybrids; "qwen3_5" (the multimodal wrapper) is read through its text_config
    "qwen3_5_text": ArchFacts(None, True, True, 256, 4, 32768, None, None, "none", "qwen3_5"),
    "qwen3_next": ArchFacts(None, True, True, 256, 2, 32768, None, None, "none", "qwen3_next"),
    # transformers' Gemma3TextConfig (the text model; a GGUF "gemma3" converts to it)
    "gemma3_text": ArchFacts(None, True, True, 256, 4, 131_072, 2, 1, "layer_pattern", gemma=True),
}
# Gemma3TextConfig: RoPE theta of the global and the sliding layers, and the default layer pattern
# (every 6th layer global, the others sliding)
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_WINDOW = 4096


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of one decoder-only model (llama family).

    `attention_bias` is the bias of q/k/v projections, `o_proj_bias` that of o_proj. `layer_types`
    has one entry per layer; `sliding_window` (tokens, counting the query itself) applies to the
    layers marked "sliding_attention".
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    rope: RopeConfig
    sliding_window: Optional[int] = None
    layer_types: tuple[LayerType, ...] = ()
    # hybrids (qwen3_5_text, qwen3_next): RMSNorm weights stored zero-centred (y = norm(x) * (1 + w)),
    # a sigmoid output gate on attention (q_proj emits [q | gate] per head), Gated DeltaNet layers
    norm_zero_centered: bool = False
    attn_output_gate: bool = False
    linear_attn: Optional[LinearAttnConfig] = None
    # Gemma 3: the RoPE of each layer (empty: every layer uses `rope`), embeddings times
    # sqrt(hidden_size), the norms around attention and MLP outputs too ("sandwich": input,
    # post-attention, pre-feedforward, post-feedforward), the MLP's activation, attention scores
    # scaled by query_pre_attn_scalar^-0.5 (None: head_dim^-0.5), logits capped by
    # cap * tanh(logits / cap) (None: not capped)
    layer_ropes: tuple[RopeConfig, ...] = ()
    scaled_embeddings: bool = False
    sandwich_norms: bool = False
    hidden_act: Activation = "silu"
    query_pre_attn_scalar: Optional[float] = None
    final_logit_softcapping: Optional[float] = None

    @property
    def is_hybrid(self) -> bool:
        """True when some layers are linear attention (they need a StatePool)."""
        return self.linear_attn is not None

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep per-token K/V (all but the linear-attention ones)."""
        return sum(1 for kind in self._types() if kind != "linear_attention")

    @property
    def num_linear_layers(self) -> int:
        return self.num_layers - self.num_kv_layers

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep per-token K/V, in KV-pool order."""
        return tuple(i for i, kind in enumerate(self._types()) if kind != "linear_attention")

    def kv_layer_index(self, layer_id: int) -> int:
        """Index of attention layer `layer_id` among the K/V-keeping layers (its KV pool layer)."""
        return sum(1 for kind in self._types()[:layer_id] if kind != "linear_attention")

    def linear_layer_index(self, layer_id: int) -> int:
        """Index of linear layer `layer_id` among the linear layers (its StatePool layer)."""
        return sum(1 for kind in self._types()[:layer_id] if kind == "linear_attention")

    def _types(self) -> tuple[LayerType, ...]:
        return self.layer_types or ("full_attention",) * self.num_layers

    def layer_rope(self, layer_id: int) -> RopeConfig:
        """The RoPE of layer `layer_id` (Gemma 3: its layer type's; otherwise `rope`)."""
        return self.layer_ropes[layer_id] if self.layer_ropes else self.rope

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by: query_pre_attn_scalar^-0.5, else head_dim^-0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer_id: int) -> Optional[int]:
        """The sliding window of layer `layer_id`, or None for full attention."""
        if self.layer_types and self.layer_types[layer_id] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def num_params_non_embedding(self) -> int:
        """Parameters outside embed_tokens and lm_head (per-token FLOPs ~ 2x this, plus attention;
        the lm_head adds 2 * hidden_size * vocab_size per logit row)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q_out * (1 + self.attn_output_gate) + 2 * kv_out) + q_out * self.hidden_size
        attn += (q_out + 2 * kv_out) * self.attention_bias + self.hidden_size * self.o_proj_bias
        attn += 2 * self.head_dim * self.qk_norm
        mlp = 3 * self.hidden_size * self.intermediate_size
        mlp += (2 * self.intermediate_size + self.hidden_size) * self.mlp_bias
        norms = (4 if self.sandwich_norms else 2) * self.hidden_size
        linear = self.linear_attn.num_params(self.hidden_size) if self.linear_attn is not None else 0
        return (self.num_kv_layers * attn + self.num_linear_layers * linear
                + self.num_layers * (mlp + norms) + self.hidden_size)

    @staticmethod
    def from_hf_config(d: dict[str, Any]) -> "ModelConfig":
        """Build from a transformers config.json dict (llama, mistral, qwen2, qwen3, gemma3_text, and
        the hybrids qwen3_5_text, qwen3_5 (its text part) and qwen3_next without MoE layers).

        Raises ValueError naming the problem for an unsupported model_type, rope type or
        activation, or a missing required key. Does not modify `d`.
        """
        if d.get("model_type") == "qwen3_5":
            d = _qwen3_5_text_part(d)
        model_type = d.get("model_type")
        facts = ARCH_FACTS.get(model_type)
        if facts is None:
            raise ValueError(f"unsupported model_type {model_type!r} (supported: {sorted(ARCH_FACTS)})")
        hidden_act = _activation(d, facts)
        hidden, num_heads = _required(d, "hidden_size"), _required(d, "num_attention_heads")
        num_layers = _required(d, "num_hidden_layers")
        head_dim = d.get("head_dim") or facts.default_head_dim or hidden // num_heads
        attention_bias = bool(d.get("attention_bias", False))
        max_pos = d.get("max_position_embeddings") or facts.default_max_pos
        if facts.hybrid is not None:
            d = _hybrid_defaults(d)
            sliding_window, layer_types = None, _hybrid_layer_types(d, num_layers)
        else:
            sliding_window, layer_types = _sliding(d, facts, num_layers)
        if facts.gemma:
            _check_gemma3(d)
            ropes = _gemma3_ropes(d, head_dim, max_pos)
            rope, layer_ropes = ropes["full_attention"], tuple(ropes[kind] for kind in layer_types)
        else:
            rope, layer_ropes = rope_from_hf_config(d, head_dim, max_pos), ()
        return ModelConfig(
            model_type=model_type,
            vocab_size=_required(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(d, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or facts.default_kv_heads or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", facts.gemma)),
            attention_bias=attention_bias if facts.qkv_bias is None else facts.qkv_bias,
            o_proj_bias=attention_bias and facts.o_bias_follows_config,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=facts.qk_norm,
            max_position_embeddings=max_pos,
            bos_token_id=d.get("bos_token_id", facts.default_bos),
            eos_token_ids=_eos_tuple(d.get("eos_token_id", facts.default_eos)),
            rope=rope,
            sliding_window=sliding_window,
            layer_types=layer_types,
            norm_zero_centered=facts.hybrid is not None or facts.gemma,
            attn_output_gate=facts.hybrid is not None,
            linear_attn=_linear_attn(d, facts.hybrid) if facts.hybrid is not None else None,
            layer_ropes=layer_ropes,
            scaled_embeddings=facts.gemma,
            sandwich_norms=facts.gemma,
            hidden_act=hidden_act,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)) if facts.gemma else None,
            final_logit_softcapping=_opt_float(d.get("final_logit_softcapping")) if facts.gemma else None,
        )


def _activation(d: dict[str, Any], facts: ArchFacts) -> Activation:
    """The MLP's activation: Gemma's `hidden_activation` (GELU-tanh by default), else `hidden_act`
    (SiLU by default); ValueError for any other."""
    if facts.gemma:
        act = d.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {act!r} (only gelu_pytorch_tanh)")
        return act
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
    return act


def _check_gemma3(d: dict[str, Any]) -> None:
    """ValueError for the Gemma 3 options kvsplice does not implement."""
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit softcapping (attn_logit_softcapping) is not supported")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (kvsplice decodes causally)")


def _gemma3_ropes(d: dict[str, Any], head_dim: int, max_pos: int) -> dict[str, RopeConfig]:
    """The RoPE of each Gemma 3 layer type, as Gemma3TextConfig.convert_rope_params_to_dict reads
    them: `rope_parameters` keyed by layer type, or the legacy `rope_theta` (global layers),
    `rope_local_base_freq` (sliding layers) and `rope_scaling` (global layers only)."""
    nested = d.get("rope_parameters") or {}
    if nested and not set(nested) <= set(_GEMMA3_THETA):
        raise ValueError(f"gemma3 rope_parameters must be keyed by layer type, got {sorted(nested)}")
    legacy_theta = {"full_attention": d.get("rope_theta"), "sliding_attention": d.get("rope_local_base_freq")}
    ropes = {}
    for kind, default_theta in _GEMMA3_THETA.items():
        params = dict(nested.get(kind) or {"rope_type": "default"})
        if kind == "full_attention" and d.get("rope_scaling"):
            params.update(d["rope_scaling"])
        params.setdefault("rope_theta", legacy_theta[kind] if legacy_theta[kind] is not None else default_theta)
        ropes[kind] = rope_from_hf_config({"rope_parameters": params}, head_dim, max_pos)
    return ropes


def _qwen3_5_text_part(d: dict[str, Any]) -> dict[str, Any]:
    """The text model of a `qwen3_5` (vision-language) config: its `text_config`, with the
    wrapper's tie_word_embeddings (transformers keeps it at the top level)."""
    text = dict(d.get("text_config") or {})
    if not text:
        raise ValueError("qwen3_5 config has no 'text_config'")
    text["model_type"] = "qwen3_5_text"
    text.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
    return text


def _hybrid_defaults(d: dict[str, Any]) -> dict[str, Any]:
    """A copy with the hybrids' config-class defaults transformers applies (partial rotary 0.25);
    raises ValueError for qwen3_next MoE layers, which are not implemented."""
    d = dict(d)
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if d.get("partial_rotary_factor") is None and "partial_rotary_factor" not in params:
        d["partial_rotary_factor"] = 0.25
    if d["model_type"] == "qwen3_next":
        num_experts, step = d.get("num_experts", 512), d.get("decoder_sparse_step", 1)
        mlp_only = set(d.get("mlp_only_layers") or [])
        moe = [i for i in range(d["num_hidden_layers"])
               if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0]
        if moe:
            raise ValueError(f"qwen3_next MoE layers are not supported (layers {moe[:4]}...); "
                             f"only configs with num_experts=0 or every layer in mlp_only_layers")
    return d


def _hybrid_layer_types(d: dict[str, Any], num_layers: int) -> tuple[LayerType, ...]:
    """`layer_types`, or transformers' default: every `full_attention_interval`-th layer (4) is
    full attention, the others linear."""
    if d.get("layer_types"):
        types = tuple(d["layer_types"])
        if set(types) - {"full_attention", "linear_attention"} or len(types) != num_layers:
            raise ValueError(f"bad layer_types {types!r} for {num_layers} layers")
        return types
    interval = d.get("full_attention_interval", 4)
    return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers))


def _linear_attn(d: dict[str, Any], layout: HybridLayout) -> LinearAttnConfig:
    lin = LinearAttnConfig(layout=layout, conv_kernel=int(d.get("linear_conv_kernel_dim", 4)),
                           num_k_heads=int(d.get("linear_num_key_heads", 16)),
                           num_v_heads=int(d.get("linear_num_value_heads", 32)),
                           k_head_dim=int(d.get("linear_key_head_dim", 128)),
                           v_head_dim=int(d.get("linear_value_head_dim", 128)))
    if lin.num_v_heads % lin.num_k_heads or lin.conv_kernel < 2:
        raise ValueError(f"bad linear attention shape {lin}")
    return lin


def _required(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"config has no {key!r}")
    return d[key]


def _eos_tuple(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(token) for token in eos)


def _sliding(d: dict[str, Any], facts: ArchFacts,
             num_layers: int) -> tuple[Optional[int], tuple[LayerType, ...]]:
    """Sliding window and per-layer attention types, as the transformers config classes set them."""
    window = d.get("sliding_window", _GEMMA3_WINDOW if facts.sliding == "layer_pattern" else None)
    if facts.sliding == "qwen_window_layers" and not d.get("use_sliding_window", False):
        window = None
    if facts.sliding == "layer_pattern":
        # Gemma 3: the layer types also choose each layer's RoPE, so they hold without a window;
        # with no layer_types, every `sliding_window_pattern`-th layer is global (Gemma3TextConfig)
        pattern = int(d.get("sliding_window_pattern") or _GEMMA3_SLIDING_PATTERN)
        types = _layer_types(d, num_layers) or tuple(
            "sliding_attention" if (layer_id + 1) % pattern else "full_attention" for layer_id in range(num_layers))
        return None if window is None else int(window), types
    if facts.sliding == "none" or window is None:
        return None, ("full_attention",) * num_layers
    if facts.sliding == "every_layer":
        return int(window), ("sliding_attention",) * num_layers
    if d.get("layer_types"):
        return int(window), _layer_types(d, num_layers)
    first_sliding = d.get("max_window_layers", 28)
    return int(window), tuple("sliding_attention" if layer_id >= first_sliding else "full_attention"
                              for layer_id in range(num_layers))


def _layer_types(d: dict[str, Any], num_layers: int) -> tuple[LayerType, ...]:
    """`layer_types` of full and sliding attention layers, checked (empty when absent)."""
    types = tuple(d.get("layer_types") or ())
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if types and (unknown or len(types) != num_layers):
        raise ValueError(f"bad layer_types {types!r} for {num_layers} layers")
    return types


def rope_from_hf_config(d: dict[str, Any], head_dim: int, max_pos: int) -> RopeConfig:
    """RopeConfig from a config.json dict, reading `rope_scaling` / `rope_parameters` /
    `rope_theta` / `partial_rotary_factor` with transformers 5.x precedence. ValueError on an
    unsupported rope type."""
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    params.setdefault("rope_theta", d.get("rope_theta", _DEFAULT_THETA))
    if d.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise ValueError(f"unsupported rope type {kind!r} (supported: {list(_ROPE_KINDS)})")
    if kind in ("llama3", "yarn"):
        # transformers: a top-level original_max_position_embeddings (Phi3 style) wins
        if d.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", max_pos)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ValueError(f"rotary_dim {rotary_dim} must be positive and even")
    if kind in ("linear", "llama3") and params.get("factor") is None:
        raise ValueError(f"rope type {kind!r} needs a 'factor'")
    if kind == "llama3" and (params.get("low_freq_factor") is None or params.get("high_freq_factor") is None):
        raise ValueError("rope type 'llama3' needs 'low_freq_factor' and 'high_freq_factor'")
    return RopeConfig(
        theta=float(params["rope_theta"]), head_dim=head_dim, rotary_dim=rotary_dim, kind=kind,
        factor=_opt_float(params.get("factor")),
        low_freq_factor=_opt_float(params.get("low_freq_factor")),
        high_freq_factor=_opt_float(params.get("high_freq_factor")),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        beta_fast=_opt_float(params.get("beta_fast")), beta_slow=_opt_float(params.get("beta_slow")),
        mscale=_opt_float(params.get("mscale")), mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
        attention_factor=_opt_float(params.get("attention_factor")),
        truncate=bool(params.get("truncate", True)), max_position_embeddings=max_pos,
    )


def _opt_float(value: Any) -> Optional[float]:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"rope parameter {value} is not finite")
    return value
