"""`--hf-overrides JSON`: keys set on the model's config.json dict before the model config is read,
as vLLM's flag of that name does (its example: a YaRN `rope_scaling` and a longer
`max_position_embeddings` to serve a model past its native context).

Only the keys kvsplice reads for RoPE and the context length are taken; any other key, a key of a
RoPE dict kvsplice does not know, or a value of the wrong type is refused with a ValueError naming it
(the CLI's exit 2), never ignored. A top-level key replaces the config's value whole (vLLM's
semantics for a dict value). `rope_scaling` wins over `rope_parameters` when both are in the config
(transformers' precedence, `kvsplice.models.config`), so an override of `rope_parameters` drops the
config's `rope_scaling`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# the keys of a rope_scaling / rope_parameters dict (kvsplice.models.config.rope_from_hf_config), by type
_ROPE_KEYS: dict[str, type] = {
    "rope_type": str, "type": str, "factor": float, "original_max_position_embeddings": int,
    "low_freq_factor": float, "high_freq_factor": float, "beta_fast": float, "beta_slow": float,
    "mscale": float, "mscale_all_dim": float, "attention_factor": float, "truncate": bool,
    "rope_theta": float, "partial_rotary_factor": float,
}
_TOP_KEYS: dict[str, type] = {
    "rope_scaling": dict, "rope_parameters": dict, "rope_theta": float, "partial_rotary_factor": float,
    "max_position_embeddings": int, "original_max_position_embeddings": int,
}


def parse_hf_overrides(text: str) -> dict[str, Any]:
    """The overrides in `text` (a JSON object), checked; ValueError naming the first bad key."""
    try:
        overrides = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"expected a JSON object, got {type(overrides).__name__}")
    for key, value in overrides.items():
        if key not in _TOP_KEYS:
            raise ValueError(f"unknown key {key!r} (supported: {', '.join(_TOP_KEYS)})")
        _check(key, value, _TOP_KEYS[key])
        if isinstance(value, dict):
            _check_rope(key, value)
    return overrides


def apply_hf_overrides(hf_config: dict[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of `hf_config` with `overrides` set (`hf_config` itself unchanged)."""
    if not overrides:
        return hf_config
    config = dict(hf_config)
    if "rope_parameters" in overrides and "rope_scaling" not in overrides:
        config.pop("rope_scaling", None)
    config.update(overrides)
    return config


def _check(key: str, value: Any, kind: type) -> None:
    if kind is dict:
        ok = value is None or isinstance(value, dict)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    else:
        ok = isinstance(value, kind)
    if not ok:
        wanted = {dict: "an object or null", int: "a positive integer", float: "a positive number",
                  str: "a string", bool: "true or false"}[kind]
        raise ValueError(f"{key}: expected {wanted}, got {json.dumps(value)}")


def _check_rope(key: str, rope: dict[str, Any]) -> None:
    for name, value in rope.items():
        if name not in _ROPE_KEYS:
            raise ValueError(f"unknown key '{key}.{name}' (supported: {', '.join(_ROPE_KEYS)})")
        _check(f"{key}.{name}", value, _ROPE_KEYS[name])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ValueError(f"{key}.rope_type: {kind!r} is not one of {', '.join(_ROPE_TYPES)}")
