"""What the shims know of the server under test: its address and the model directory it serves.

Both come from the environment `tests/peers/conftest.py` sets before any test file is imported:
`KVSPLICE_PEER_URL` (http://host:port, no trailing slash) and `KVSPLICE_PEER_MODEL_DIR`.
"""

import functools
import json
import os
from pathlib import Path

SERVED_MODEL_NAME = "test-model"


def server_url() -> str:
    return os.environ["KVSPLICE_PEER_URL"]


def model_dir() -> Path:
    return Path(os.environ["KVSPLICE_PEER_MODEL_DIR"])


@functools.lru_cache(maxsize=1)
def tokenizer():
    """The served model's Hugging Face tokenizer, loaded from its local directory (no download)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()))


def vocab_size() -> int:
    """The served model's vocabulary size as its config.json states it (the bound kvsplice checks
    token ids against)."""
    return int(json.loads((model_dir() / "config.json").read_text())["vocab_size"])


class NotInKvsplice:
    """A peer's own Python class: importable so a test file collects, unusable so a test that calls it
    fails loudly (those tests are deselected: they test the peer's code, not its HTTP API)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is the peer's own code, not part of kvsplice's HTTP API")
