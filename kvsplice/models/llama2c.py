"""Read llama2.c legacy (v0) checkpoints (their `tokenizer.bin` is kvsplice.tokenizer_llama2c's).

A v0 `.bin` is a header of 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
seq_len) followed by fp32 tensors in the order run.c's `memory_map_weights` reads them. A negative
vocab_size means an untied classifier follows the stored RoPE tables.

The llama2.c (Meta) RoPE rotates adjacent pairs (2i, 2i+1) of each head; transformers rotates
(i, i + head_dim/2). We permute the q/k rows so the returned state dict gives the same logits in
an HF-layout decoder.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvsplice.models.gguf_convert import interleaved_to_half_rows
from kvsplice.tokenizer_llama2c import BOS_ID, EOS_ID

HEADER_FORMAT = "<7i"
HEADER_BYTES = struct.calcsize(HEADER_FORMAT)
# llama2.c v1/v2 exports start with this magic ("ak42"); only v0 (legacy) is supported here.
VERSIONED_MAGIC = 0x616B3432


@dataclass(frozen=True)
class Llama2cHeader:
    """The 7 int32 of a v0 checkpoint header; `shared_classifier` is `vocab_size > 0` in the file."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def read_header(raw: bytes) -> Llama2cHeader:
    """Parse the v0 header; ValueError for versioned exports or nonsensical sizes."""
    if len(raw) < HEADER_BYTES:
        raise ValueError("llama2.c checkpoint is shorter than its 28-byte header")
    if struct.unpack_from("<I", raw)[0] == VERSIONED_MAGIC:
        raise ValueError("llama2.c versioned (v1/v2) checkpoints are not supported; export with --version 0")
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = struct.unpack_from(HEADER_FORMAT, raw)
    fields = (dim, hidden_dim, n_layers, n_heads, n_kv_heads, abs(vocab_size), seq_len)
    if min(fields) <= 0 or dim % n_heads or n_heads % n_kv_heads:
        raise ValueError(f"not a llama2.c v0 checkpoint: implausible header {fields}")
    return Llama2cHeader(dim, hidden_dim, n_layers, n_heads, n_kv_heads, abs(vocab_size), seq_len, vocab_size > 0)


def llama2c_hf_config(header: Llama2cHeader) -> dict:
    """The transformers `LlamaConfig` dict equivalent to a llama2.c header (RoPE theta 10000, eps 1e-5)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": header.dim,
        "intermediate_size": header.hidden_dim,
        "num_hidden_layers": header.n_layers,
        "num_attention_heads": header.n_heads,
        "num_key_value_heads": header.n_kv_heads,
        "head_dim": header.head_dim,
        "vocab_size": header.vocab_size,
        "max_position_embeddings": header.seq_len,
        # run.c hard-codes both constants.
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": header.shared_classifier,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }


def _take(values: np.ndarray, cursor: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    count = int(np.prod(shape))
    if cursor + count > values.size:
        raise ValueError("llama2.c checkpoint is truncated: fewer weights than its header promises")
    return torch.from_numpy(values[cursor : cursor + count].copy()).reshape(shape), cursor + count


def load_llama2c(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a v0 `.bin` into (HF llama config dict, fp32 state dict in HF names and rotate_half layout).

    Raises ValueError for unreadable, versioned, truncated or oversized files.
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read llama2.c checkpoint {path}: {error}") from error
    header = read_header(raw)
    values = np.frombuffer(raw, dtype="<f4", offset=HEADER_BYTES, count=(len(raw) - HEADER_BYTES) // 4)
    h, layers = header, header.n_layers
    q_rows, kv_rows = h.n_heads * h.head_dim, h.n_kv_heads * h.head_dim
    # Order and shapes from run.c memory_map_weights(); matrices are stored (out, in) row-major.
    layout = [
        ("embed", (h.vocab_size, h.dim)),
        ("attn_norm", (layers, h.dim)),
        ("wq", (layers, q_rows, h.dim)),
        ("wk", (layers, kv_rows, h.dim)),
        ("wv", (layers, kv_rows, h.dim)),
        ("wo", (layers, h.dim, q_rows)),
        ("ffn_norm", (layers, h.dim)),
        ("w1", (layers, h.hidden_dim, h.dim)),
        ("w2", (layers, h.dim, h.hidden_dim)),
        ("w3", (layers, h.hidden_dim, h.dim)),
        ("final_norm", (h.dim,)),
        ("rope_tables", (2, h.seq_len * h.head_dim // 2)),
    ]
    if not h.shared_classifier:
        layout.append(("classifier", (h.vocab_size, h.dim)))
    parts, cursor = {}, 0
    for part_name, shape in layout:
        parts[part_name], cursor = _take(values, cursor, shape)
    if cursor != values.size:
        raise ValueError(f"llama2.c checkpoint has {values.size - cursor} unexpected trailing floats")
    return llama2c_hf_config(header), _hf_state_dict(header, parts)


def _hf_state_dict(header: Llama2cHeader, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {"model.embed_tokens.weight": parts["embed"], "model.norm.weight": parts["final_norm"]}
    state["lm_head.weight"] = parts.get("classifier", parts["embed"]).clone()
    for layer in range(header.n_layers):
        prefix = f"model.layers.{layer}."
        state[prefix + "input_layernorm.weight"] = parts["attn_norm"][layer]
        state[prefix + "post_attention_layernorm.weight"] = parts["ffn_norm"][layer]
        state[prefix + "self_attn.q_proj.weight"] = interleaved_to_half_rows(parts["wq"][layer], header.n_heads)
        state[prefix + "self_attn.k_proj.weight"] = interleaved_to_half_rows(parts["wk"][layer], header.n_kv_heads)
        state[prefix + "self_attn.v_proj.weight"] = parts["wv"][layer]
        state[prefix + "self_attn.o_proj.weight"] = parts["wo"][layer]
        state[prefix + "mlp.gate_proj.weight"] = parts["w1"][layer]
        state[prefix + "mlp.down_proj.weight"] = parts["w2"][layer]
        state[prefix + "mlp.up_proj.weight"] = parts["w3"][layer]
    return {name: tensor.contiguous() for name, tensor in state.items()}
