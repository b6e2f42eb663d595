"""One tokenizer interface over a transformers fast tokenizer or a llama2.c BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvsplice.tokenizer_llama2c import BOS_ID as LLAMA2C_BOS_ID
from kvsplice.tokenizer_llama2c import EOS_ID as LLAMA2C_EOS_ID
from kvsplice.tokenizer_llama2c import Llama2cBPE

Backend = Union[PreTrainedTokenizerBase, Llama2cBPE]


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(item) for item in value)


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """`eos_token_id` (int or list) from `generation_config.json` in `model_dir`, or () if absent."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        return _as_id_tuple(json.loads(path.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: unreadable eos_token_id: {error}") from error


def generation_max_new_tokens(model_dir: str | Path) -> Optional[int]:
    """`max_new_tokens` from `generation_config.json` in `model_dir` (the completion budget of a request
    that sets none, as vLLM reads it), or None if absent."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_new_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{path}: max_new_tokens must be an integer >= 1, got {value!r}")
    return value


# generation_config.json's sampling settings a request that leaves them unset gets (vLLM's
# `--generation-config auto`, its default, reads the same five)
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_sampling_defaults(model_dir: str | Path) -> dict[str, float]:
    """The GENERATION_SAMPLING_KEYS that `generation_config.json` in `model_dir` sets ({} if none);
    ValueError naming one that is not a number."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    defaults = {key: config[key] for key in GENERATION_SAMPLING_KEYS if config.get(key) is not None}
    for key, value in defaults.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
    return defaults


class Tokenizer:
    """Text <-> token ids, chat templating and stop ids for one model.

    `backend` is a transformers tokenizer (any `PreTrainedTokenizerBase`) or a `Llama2cBPE`.
    `extra_eos_ids` (e.g. from generation_config.json) are added to the backend's own eos id;
    `max_new_tokens` (generation_config.json's) is the completion budget of a request that sets none,
    `sampling_defaults` (its GENERATION_SAMPLING_KEYS) the sampling settings of one that leaves them unset.
    """

    def __init__(self, backend: Backend, extra_eos_ids: tuple[int, ...] = (), max_new_tokens: Optional[int] = None,
                 sampling_defaults: Optional[dict[str, float]] = None):
        self.backend = backend
        self.max_new_tokens = max_new_tokens
        self.sampling_defaults = dict(sampling_defaults or {})
        own_eos = LLAMA2C_EOS_ID if isinstance(backend, Llama2cBPE) else backend.eos_token_id
        ordered = _as_id_tuple(own_eos) + tuple(extra_eos_ids)
        self._eos_token_ids = tuple(dict.fromkeys(ordered))

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json / tokenizer_config.json (+ chat_template.jinja) and generation_config.json.

        Never touches the network. ValueError if the directory has no loadable tokenizer.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json or tokenizer_config.json")
        try:
            backend = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"cannot load the tokenizer in {path}: {error}") from error
        return cls(backend, generation_eos_ids(path), generation_max_new_tokens(path),
                   generation_sampling_defaults(path))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (tokenizer eos first, then generation_config eos ids)."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> Optional[int]:
        """The beginning-of-sequence id, or None if the tokenizer has none."""
        if isinstance(self.backend, Llama2cBPE):
            return LLAMA2C_BOS_ID
        return self.backend.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return self.backend.vocab_size if isinstance(self.backend, Llama2cBPE) else len(self.backend)

    @property
    def has_chat_template(self) -> bool:
        """Whether `apply_chat_template` can be used."""
        return not isinstance(self.backend, Llama2cBPE) and bool(self.backend.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the model adds by default (e.g. BOS)."""
        if isinstance(self.backend, Llama2cBPE):
            return self.backend.encode(text, add_bos=add_special_tokens)
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """One token's text as OpenAI legacy logprobs show it (decode of that token alone, specials kept)."""
        if isinstance(self.backend, Llama2cBPE):
            return self.backend.token_str(token_id)
        return self.backend.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self, messages: list[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
    ) -> str:
        """The chat template applied to `messages` (and `tools`), as text: `chat_template` (Jinja
        source, as `--chat-template` gives) in place of the model's own where given.

        ValueError if there is no template to apply or the template rejects the messages.
        """
        if isinstance(self.backend, Llama2cBPE) or not (chat_template or self.has_chat_template):
            raise ValueError("this model has no chat template; use the completions endpoint with a raw prompt")
        try:
            return self.backend.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False,
                chat_template=chat_template,
            )
        except Exception as error:  # jinja2 raises TemplateError subclasses and plain exceptions
            raise ValueError(f"the chat template rejected the messages: {error}") from error

    def apply_chat_template(
        self, messages: list[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
    ) -> list[int]:
        """Token ids of the rendered chat (`render_chat`); the template itself supplies any
        BOS/special tokens."""
        text = self.render_chat(messages, tools, add_generation_prompt, chat_template)
        return self.encode(text, add_special_tokens=False)
