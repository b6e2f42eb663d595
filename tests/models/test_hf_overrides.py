"""--hf-overrides: config keys set before the model config is read (RoPE scaling, context length)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import build_engine
from kvsplice.layers.rotary import inv_freq_and_scale
from kvsplice.models.config import ModelConfig
from kvsplice.models.hf_overrides import apply_hf_overrides, parse_hf_overrides
from tests.models.test_gguf_convert import write_tiny_gguf
from tests.tiny_model import make_tiny_model_dir, tiny_llama_config

YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        "max_position_embeddings": 16384}


def test_yarn_override_changes_the_rope_and_the_context():
    base = tiny_llama_config(384)
    plain = ModelConfig.from_hf_config(base)
    config = ModelConfig.from_hf_config(apply_hf_overrides(base, parse_hf_overrides(json.dumps(YARN))))
    assert (plain.rope.kind, plain.max_position_embeddings) == ("default", 4096)
    assert (config.rope.kind, config.rope.factor, config.rope.original_max_position_embeddings) == ("yarn", 4.0, 4096)
    assert config.max_position_embeddings == 16384 and config.rope.theta == plain.rope.theta
    inv_plain, scale_plain = inv_freq_and_scale(plain.rope)
    inv_yarn, scale_yarn = inv_freq_and_scale(config.rope)
    assert scale_plain == 1.0 and scale_yarn > 1.0
    assert torch.equal(inv_yarn[0], inv_plain[0]) and inv_yarn[-1] < inv_plain[-1]   # low frequencies stretched
    assert "rope_scaling" not in base   # the checkpoint's dict is not changed


def test_rope_parameters_override_replaces_a_rope_scaling():
    base = {**tiny_llama_config(384), "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    overrides = parse_hf_overrides('{"rope_parameters": {"rope_type": "default", "rope_theta": 500000}}')
    rope = ModelConfig.from_hf_config(apply_hf_overrides(base, overrides)).rope
    assert (rope.kind, rope.theta) == ("default", 500000.0)
    assert apply_hf_overrides(base, None) is base


@pytest.mark.parametrize("text,named", [
    ('{"vocab_size": 3}', "'vocab_size'"),
    ('{"rope_scaling": {"rope_type": "yarn", "factr": 4}}', "'rope_scaling.factr'"),
    ('{"rope_scaling": {"rope_type": "ntk"}}', "rope_scaling.rope_type"),
    ('{"rope_scaling": {"factor": "4"}}', "rope_scaling.factor"),
    ('{"max_position_embeddings": 32768.5}', "max_position_embeddings"),
    ('{"max_position_embeddings": true}', "max_position_embeddings"),
    ('{"rope_theta": -1}', "rope_theta"),
    ('{"rope_scaling": [4]}', "rope_scaling"),
    ('[1]', "JSON object"),
    ('{"rope_scaling": ', "not JSON"),
])
def test_unknown_or_ill_typed_keys_are_refused_by_name(text, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.").replace("[", r"\[")):
        parse_hf_overrides(text)


def test_engine_config_keeps_the_overrides_as_json_and_stays_frozen():
    config = EngineConfig(hf_overrides=YARN)
    assert json.loads(config.hf_overrides) == YARN and hash(config) == hash(EngineConfig(hf_overrides=YARN))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hf_overrides = None
    with pytest.raises(ValueError, match="'num_layers'"):
        EngineConfig(hf_overrides={"num_layers": 2})


def test_engine_of_an_hf_dir_and_of_a_gguf_uses_the_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSPLICE_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", tied=True)
    models = {"hf": (str(make_tiny_model_dir(tmp_path / "hf")), 4096), "gguf": (str(tmp_path / "tiny.gguf"), 256)}
    for name, (model, native) in models.items():
        overrides = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": native},
                     "max_position_embeddings": 4 * native}
        plain = build_engine(EngineConfig(model=model, num_slots=512, max_batch_tokens=64))
        engine = build_engine(EngineConfig(model=model, num_slots=512, max_batch_tokens=64, hf_overrides=overrides))
        assert plain.max_model_len == native and engine.max_model_len == 4 * native, name
        assert (plain.model_config.rope.kind, engine.model_config.rope.kind) == ("default", "yarn"), name
