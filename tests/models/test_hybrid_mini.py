"""The trained hybrid shipped in models/hybrid-mini (scripts/train_hybrid.py): kvsplice serves it
with transformers' logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.sampling_params import SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "models" / "hybrid-mini"


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="models/hybrid-mini is absent")
def test_hybrid_mini_matches_transformers():
    from transformers import AutoModelForCausalLM

    llm = LLM(engine=build_engine(EngineConfig(model=str(MODEL))))
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Read the docs of json."}])
    [out] = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1))
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    assert out.token_ids == expected.argmax(-1).tolist()
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    want = expected[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
    assert torch.max(torch.abs(got - want)).item() <= 1e-4
