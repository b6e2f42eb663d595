"""The names a server answers to: the one it reports (`model` in every response, `/v1/models`, metrics'
`model_name` label) and the aliases a request's `model` may use.

    kvsplice serve --served-model-name NAME [NAME ...]   the first NAME is reported, any NAME is accepted
    kvsplice serve --model M                            one name derived from M (below); M itself and its
                                                        file or folder name are accepted too

The derived name is what a user would call the model, not a file-system accident:

    (no --model) or SmolLM2-135M-Instruct        -> SmolLM2-135M-Instruct
    .../SmolLM2-135M-Instruct.Q4_1.gguf          -> SmolLM2-135M-Instruct   (quantization suffix dropped)
    .../Llama-3.2-1B-Instruct-Q4_K_M.gguf        -> Llama-3.2-1B-Instruct
    .../stories260K/hf  (a generic folder name)  -> stories260K             (the nearest telling parent)
    .../models--org--name/snapshots/<hash>       -> org/name                (a Hugging Face cache folder)
    org/name (a hub id)                          -> org/name
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from kvsplice.models.default_model import DEFAULT_MODEL, find_default_gguf
from kvsplice.models.loader import HUB_ID_PATTERN

# Folder and file stems that say nothing about the model: look at the parent folder instead.
GENERIC_STEMS = frozenset({"hf", "model", "models", "weights", "checkpoint", "checkpoints", "snapshots",
                           "main", "final", "latest", "output", "out", "pytorch_model", "consolidated"})
# A trailing llama.cpp quantization or precision tag: `.Q4_1`, `-Q4_K_M`, `.IQ2_XXS`, `-f16`, `.BF16`.
QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d+(?:_[A-Z0-9]+)*|F16|F32|BF16|FP16|FP32)$", re.IGNORECASE)
SNAPSHOT_HASH = re.compile(r"^[0-9a-f]{40}$")
HF_CACHE_FOLDER = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>.+)$")
MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class ServedNames:
    """`reported`: the served names, the first is the one responses carry; `accepted`: every name a
    request's `model` may use (the reported ones and, without explicit names, the model's path)."""

    reported: tuple[str, ...]
    accepted: frozenset[str]

    @property
    def primary(self) -> str:
        """The name responses, `/v1/models` and metrics report."""
        return self.reported[0]

    def accepts(self, name: str) -> bool:
        return name in self.accepted


def check_served_names(names: Sequence[str]) -> tuple[str, ...]:
    """The names in order without repeats; ValueError for an empty list, an empty or blank name, or a
    name longer than MAX_NAME_CHARS."""
    if not names:
        raise ValueError("--served-model-name: give at least one name")
    for name in names:
        if not name.strip() or name != name.strip():
            raise ValueError(f"--served-model-name: {name!r} is empty or has leading/trailing spaces")
        if len(name) > MAX_NAME_CHARS:
            raise ValueError(f"--served-model-name: names are at most {MAX_NAME_CHARS} characters")
    return tuple(dict.fromkeys(names))


def _telling_name(path: Path) -> str:
    """The first of `path`, its parents, that is not a generic folder name (HF cache folders become
    `org/name`); `path.name` if every one is generic."""
    for part in (path, *path.parents):
        cache_folder = HF_CACHE_FOLDER.match(part.name)
        if cache_folder:
            return f"{cache_folder['org']}/{cache_folder['name']}"
        if part.name and part.name.lower() not in GENERIC_STEMS and not SNAPSHOT_HASH.match(part.name):
            return part.name
    return path.name


def _is_default_gguf(path: Path) -> bool:
    default_gguf = find_default_gguf()
    return default_gguf is not None and default_gguf.resolve() == path.resolve()


def default_model_name(model: Optional[str], loaded_name: str) -> str:
    """The name a server reports for `--model model` (None: the default model) when no
    --served-model-name is given. `loaded_name` (the loader's own name) is the fallback."""
    if model is None or model == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf" and _is_default_gguf(path):
            return DEFAULT_MODEL
        stem = QUANT_SUFFIX.sub("", path.stem) or path.stem
        return stem if stem.lower() not in GENERIC_STEMS else _telling_name(path.parent)
    if path.is_dir() or not HUB_ID_PATTERN.match(model):
        return _telling_name(path.resolve()) or loaded_name
    return model


def served_names(served_model_name: Sequence[str], model: Optional[str], loaded_name: str) -> ServedNames:
    """The server's names. With `served_model_name` (checked by check_served_names) exactly those;
    otherwise the derived default name, also accepting the loader's name, `model` as given and its
    last path component (what earlier versions reported and clients may still send)."""
    if served_model_name:
        names = check_served_names(served_model_name)
        return ServedNames(names, frozenset(names))
    primary = default_model_name(model, loaded_name)
    accepted = {primary, loaded_name}
    if model:
        accepted |= {model, Path(model).name}
    return ServedNames((primary,), frozenset(accepted))
