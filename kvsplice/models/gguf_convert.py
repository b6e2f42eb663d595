"""Convert a llama.cpp GGUF file into an HF model directory (config.json, fp32 safetensors, tokenizer).

Supported architectures: llama (and mistral-as-llama), qwen2, qwen3, gemma3 (its text model, as
transformers' gemma3_text). Every tensor type that `gguf.quants.dequantize` understands (F32, F16,
BF16, Q8_0, Q4_0, Q4_1, Q5_*, K-quants, ...) is dequantized to fp32.

llama.cpp's convert_hf_to_gguf permutes the q/k rows of llama-family models into the
interleaved (2i, 2i+1) RoPE layout; we undo it so the weights are in transformers' rotate_half
layout (the same reversal as transformers' `LlamaTensorProcessor._reverse_permute_weights`).
Qwen2/Qwen3/Gemma3 GGUFs are written without that permutation.

Gemma's RMSNorms compute norm(x) * (1 + w); llama.cpp's converter stores 1 + w, so every norm weight
gets 1 subtracted again in fp32, as transformers' GGUF loader does (`Gemma2TensorProcessor`). What
llama.cpp fixes in code rather than in metadata is written out as it does: the sliding layers'
RoPE theta 10,000, every 6th layer global, and the attention scale.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kvsplice.models.manifest import ModelCacheError, check_cache, source_identity, write_manifest

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}
# GGUF architecture -> transformers model_type, where they differ
HF_MODEL_TYPES = {"gemma3": "gemma3_text"}
# Architectures whose GGUF norm weights hold 1 + w (zero-centred norms in transformers).
SHIFTED_NORM_ARCHITECTURES = {"gemma3"}
# Architectures whose q/k rows llama.cpp stores in the interleaved RoPE layout.
PERMUTED_QK_ARCHITECTURES = {"llama"}
GLOBAL_TENSOR_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp per-block names -> transformers names under model.layers.{N}.
BLOCK_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms the attention and MLP outputs too; its ffn_norm is the pre-feedforward norm.
GEMMA3_BLOCK_TENSOR_NAMES = {
    **BLOCK_TENSOR_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
BLOCK_NAMES_OF = {"gemma3": GEMMA3_BLOCK_TENSOR_NAMES}
# llama.cpp's Gemma 3 constants (llama-model.cpp): the sliding layers' RoPE theta, and which
# layers are global (every 6th)
GEMMA3_LOCAL_THETA = 10_000.0
GEMMA3_SLIDING_PATTERN = 6
BLOCK_TENSOR_PATTERN = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
WEIGHTS_FILE = "model.safetensors"
# Recorded in every manifest; bump it when the output of a conversion changes, so caches written
# by an older converter are re-converted (when their GGUF is still there).
CONVERTER_VERSION = "2"


def interleaved_to_half_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute q/k projection rows from the interleaved RoPE layout to transformers' rotate_half layout.

    Within each head, interleaved rows are (x0, y0, x1, y1, ...) where (x_i, y_i) is rotated pair i;
    rotate_half wants (x0, x1, ..., y0, y1, ...). Inverse of llama.cpp's `LlamaModel.permute`;
    same as transformers' `_reverse_permute_weights`. Works for weights (rows, in) and biases (rows,).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} q/k rows cannot be split into {n_heads} heads of rotated pairs")
    pairs = rows // n_heads // 2
    return weight.reshape(n_heads, pairs, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def half_to_interleaved_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `interleaved_to_half_rows` (what llama.cpp's converter applies to HF q/k weights)."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} q/k rows cannot be split into {n_heads} heads of rotated pairs")
    pairs = rows // n_heads // 2
    return weight.reshape(n_heads, 2, pairs, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def open_gguf(gguf_path: str | Path) -> gguf.GGUFReader:
    """A GGUFReader over the file; ValueError if it is missing or not a GGUF file."""
    try:
        return gguf.GGUFReader(str(gguf_path))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read GGUF file {gguf_path}: {error}") from error


def field_value(reader: gguf.GGUFReader, key: str, default=None):
    """The decoded value of a GGUF metadata key (str, number, bool or list), or `default`."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name of architecture `arch` to its transformers name; ValueError for
    names we cannot place."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_TENSOR_NAMES and suffix in ("weight", "bias"):
        return f"{GLOBAL_TENSOR_NAMES[base]}.{suffix}"
    block_names = BLOCK_NAMES_OF.get(arch, BLOCK_TENSOR_NAMES)
    match = BLOCK_TENSOR_PATTERN.match(gguf_name)
    if match is None or match.group(2) not in block_names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no transformers equivalent in kvsplice")
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{block_names[part]}.{suffix}"


def gguf_architecture(reader: gguf.GGUFReader) -> str:
    """`general.architecture`, checked against the supported ones."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})")
    return arch


def build_hf_config(reader: gguf.GGUFReader) -> dict:
    """The transformers config dict implied by the GGUF metadata (keys under `{arch}.`) and tensor list."""
    arch = gguf_architecture(reader)
    tensor_names = {tensor.name for tensor in reader.tensors}

    def meta(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    if meta("rope.scaling.type", "none") not in ("none", None) and arch != "gemma3":
        raise ValueError(f"GGUF rope scaling {meta('rope.scaling.type')!r} is not supported")
    hidden_size, n_heads = meta("embedding_length"), meta("attention.head_count")
    embed_rows = next((int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed_rows is None:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    rope_theta = float32_metadata(meta("rope.freq_base", 10000.0))
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": HF_MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden_size,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta("attention.head_count_kv", n_heads),
        "head_dim": meta("attention.key_length", hidden_size // n_heads),
        "vocab_size": int(meta("vocab_size", embed_rows)),
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": float32_metadata(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        token_id = field_value(reader, f"tokenizer.ggml.{gguf_key}")
        if token_id is not None:
            config[hf_key] = int(token_id)
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "gemma3":
        del config["hidden_act"]   # Gemma3TextConfig reads hidden_activation
        config.update(gemma3_config(meta, config))
    if None in (config["intermediate_size"], config["num_hidden_layers"], hidden_size, n_heads):
        raise ValueError(f"GGUF file lacks required {arch}.* metadata (block_count, embedding_length, ...)")
    return config


def gemma3_config(meta, config: dict) -> dict:
    """The Gemma 3 keys of the transformers config (Gemma3TextConfig), from the `gemma3.*`
    metadata `meta(key, default)` reads and the common keys already in `config`."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    full = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    scaling = meta("rope.scaling.type", "none")
    if scaling == "linear":
        full.update(rope_type="linear", factor=float32_metadata(meta("rope.scaling.factor")))
    elif scaling not in ("none", None):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    local_theta = float32_metadata(meta("rope.freq_base_swa", GEMMA3_LOCAL_THETA))
    # llama.cpp scales scores by head_dim^-0.5, except the 27B (62 layers): (hidden / heads)^-0.5
    pre_attn_scalar = config["hidden_size"] // heads if layers == 62 else config["head_dim"]
    gemma = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": meta("attention.sliding_window"),
        "layer_types": ["sliding_attention" if (layer + 1) % GEMMA3_SLIDING_PATTERN else "full_attention"
                        for layer in range(layers)],
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        "query_pre_attn_scalar": pre_attn_scalar,
    }
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if meta(key) is not None:
            gemma[key] = float32_metadata(meta(key))
    return gemma


def float32_metadata(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def dequantized_tensor(tensor) -> torch.Tensor:
    """A GGUF tensor dequantized to fp32 in torch (rows, cols) order (GGUF lists shapes reversed)."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise ValueError(f"GGUF tensor {tensor.name}: type {tensor.tensor_type.name} cannot be dequantized") from error
    shape = tuple(int(size) for size in reversed(tensor.shape))
    # Copy: F32/F16 "dequantization" returns read-only views of the memory-mapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def convert_tensors(reader: gguf.GGUFReader, config: dict, progress: bool = True) -> dict[str, torch.Tensor]:
    """All GGUF tensors as an fp32 state dict in transformers names, q/k un-permuted where needed."""
    arch = gguf_architecture(reader)
    unpermute = arch in PERMUTED_QK_ARCHITECTURES
    shift_norms = arch in SHIFTED_NORM_ARCHITECTURES
    heads_of = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    state = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF tensors", disable=not progress):
        if tensor.name == "rope_freqs.weight":
            raise ValueError("GGUF has rope_freqs (llama3-style rope scaling), which kvsplice does not support")
        name = hf_tensor_name(tensor.name, arch)
        weight = dequantized_tensor(tensor)
        if shift_norms and tensor.name.endswith("norm.weight"):
            weight -= 1   # the GGUF holds 1 + w
        projection = next((proj for proj in heads_of if f".{proj}." in name), None)
        if unpermute and projection is not None:
            weight = interleaved_to_half_rows(weight, heads_of[projection])
        state[name] = weight
    return state


def save_gguf_tokenizer(gguf_path: Path, out_dir: Path, config: dict) -> None:
    """Write tokenizer.json, tokenizer_config.json (with chat_template) and generation_config.json.

    Uses transformers' GGUF tokenizer conversion (reads only metadata, never the network).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as error:
        raise ValueError(f"cannot convert the tokenizer stored in {gguf_path}: {error}") from error
    tokenizer.save_pretrained(str(out_dir))
    tokenizer_config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    if tokenizer.chat_template:
        # Older readers only look here; transformers 5 also writes chat_template.jinja.
        tokenizer_config["chat_template"] = tokenizer.chat_template
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id") if key in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True, replace: bool = False) -> Path:
    """Convert `gguf_path` into an HF directory at `out_dir` and return `out_dir`.

    Writes config.json, model.safetensors (fp32), tokenizer files, generation_config.json and,
    last, the manifest (`kvsplice.models.manifest`) into a temporary sibling directory, then
    renames it onto `out_dir`, so an interrupted conversion never leaves a partial `out_dir`. An
    existing `out_dir` is kept and returned as is unless `replace` (then the new conversion takes
    its place); if another process publishes `out_dir` first, theirs is kept. Raises ValueError for
    unreadable or unsupported GGUF files.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not replace:
        return out_dir
    reader = open_gguf(gguf_path)
    config = build_hf_config(reader)
    state = convert_tensors(reader, config, progress)
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        save_file(state, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        save_gguf_tokenizer(gguf_path, staging, config)
        write_manifest(staging, source_identity(gguf_path), CONVERTER_VERSION)
        publish_directory(staging, out_dir, replace)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def publish_directory(staging: Path, out_dir: Path, replace: bool) -> None:
    """Move a finished conversion into place; each step is one atomic rename.

        out_dir absent:   staging --rename--> out_dir
        replace:          out_dir --rename--> .out_dir.replaced-PID --rmtree
                          staging --rename--> out_dir
    If `out_dir` appears meanwhile (another process converted it), that one is kept.
    """
    if replace and out_dir.exists():
        retired = out_dir.parent / f".{out_dir.name}.replaced-{os.getpid()}"
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(out_dir, retired)
        shutil.rmtree(retired, ignore_errors=True)
    try:
        os.rename(staging, out_dir)
    except OSError:
        if not out_dir.exists():
            raise


def ensure_converted(source: Optional[Path], out_dir: Path, progress: bool = True) -> Path:
    """Return `out_dir` once it is an intact, current conversion of the GGUF `source`.

    `source` is None when the GGUF is unavailable. An intact cache is returned after stat calls
    only (see `check_cache`). A missing cache is converted; a damaged one, one without a manifest
    (older kvsplice) or a stale one (older converter, changed source) is re-converted from
    `source`, with one line on stderr saying why. A stale but intact cache is kept when `source`
    is None. Raises ModelCacheError (a ValueError) when the cache is unusable and `source` is None,
    or when the conversion cannot be written (disk full, read-only cache).
    """
    verdict = check_cache(out_dir, CONVERTER_VERSION, source)
    if verdict.problem is None or (verdict.usable and source is None):
        return out_dir
    if source is None:
        origin = (f"the GGUF it was converted from ({verdict.manifest.source.path}) is gone" if verdict.manifest
                  else "the GGUF it was converted from is unknown")
        raise ModelCacheError(f"the model cache {out_dir} {verdict.problem}, and {origin}: "
                              "put the GGUF back, or delete the directory and convert again")
    if out_dir.exists():
        print(f"kvsplice: the model cache {out_dir} {verdict.problem}; re-converting it from {source}",
              file=sys.stderr)
    try:
        return convert_gguf(source, out_dir, progress, replace=out_dir.exists())
    except OSError as error:  # a full disk or a read-only cache: say so instead of a traceback
        raise ModelCacheError(f"cannot write the model cache {out_dir}: {error}") from error
