"""Upper bounds on one request, checked before any work that grows with the input.

    body bytes ─(read: 413 past max_body_bytes)─> JSON ─(depth <= max_json_depth)─> pydantic models
        (messages <= max_messages, stop entries <= max_stop, each <= max_stop_chars,
         session_id / cache_salt / rid <= max_id_chars, completions prompts <= max_prompts)
        ─> tokenization, templates, the engine

Defaults follow from the context length where a fixed number would be wrong for some model: a body
holds a max-length prompt as JSON at BYTES_PER_TOKEN bytes per token (a token is rarely more than 4
characters, and JSON escapes a character in at most 6 bytes: \\uXXXX) plus BODY_OVERHEAD for the
request's structure (message objects, tools, settings); every message renders to at least one token,
so more messages than context tokens can never fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

BYTES_PER_TOKEN = 16
BODY_OVERHEAD = 1 << 20
MAX_STOP = 16
MAX_STOP_CHARS = 512
MAX_ID_CHARS = 256
MAX_JSON_DEPTH = 64
MAX_PROMPTS = 64


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds (flags of `kvsplice serve`).

    max_body_bytes: request body size; None: context tokens x BYTES_PER_TOKEN + BODY_OVERHEAD.
    max_messages:   chat messages; None: the context length in tokens.
    max_stop:       entries in `stop` and, separately, in `stop_token_ids`.
    max_stop_chars: characters of one stop string.
    max_id_chars:   characters of `session_id`, `cache_salt`, the routing-key header and /generate's `rid`.
    max_json_depth: nesting of arrays and objects in the body.
    max_prompts:    prompts in one /v1/completions request (a batch).

    A None field counts as unbounded until `resolve` fills it in; the server always resolves.
    """

    max_body_bytes: Optional[int] = None
    max_messages: Optional[int] = None
    max_stop: int = MAX_STOP
    max_stop_chars: int = MAX_STOP_CHARS
    max_id_chars: int = MAX_ID_CHARS
    max_json_depth: int = MAX_JSON_DEPTH
    max_prompts: int = MAX_PROMPTS

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if value is None and spec.name in ("max_body_bytes", "max_messages"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{spec.name}: must be an int >= 1, got {value!r}")

    def resolve(self, context_tokens: int) -> "RequestLimits":
        """These limits with the context-derived defaults filled in for a model of `context_tokens`."""
        return dataclasses.replace(
            self,
            max_body_bytes=self.max_body_bytes or context_tokens * BYTES_PER_TOKEN + BODY_OVERHEAD,
            max_messages=self.max_messages or context_tokens)
