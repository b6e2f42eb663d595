"""The engine on the fast path against the engine on the reference Decoder (fp32: same greedy
tokens, logprobs within 1e-4), with the arena on and off and under chunked prefill; the prefill
share under the step budget; dtype auto; weight format resolution."""

from __future__ import annotations

import pytest
import torch

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine, cpu_has_native_bf16, resolve_auto_dtype
from kvsplice.models.config import ModelConfig
from kvsplice.models.decoder import Decoder
from kvsplice.models.quantize import WeightFormat, resolve_weight_format
from kvsplice.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_model import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _prompts(lengths, vocab: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def _generate(model_dir, prompts, **kwargs):
    llm = LLM(engine=build_engine(EngineConfig(model=model_dir, num_slots=2048, **kwargs)))
    return llm.generate(prompts, GREEDY), llm.engine


@pytest.mark.parametrize("kwargs", [dict(), dict(decode_arena_tokens=0), dict(max_batch_tokens=16)])
def test_fast_path_matches_the_reference_decoder(model_dir, kwargs):
    prompts = _prompts((5, 23, 61, 9))
    reference, ref_engine = _generate(model_dir, prompts, fast_path=False)
    fast, engine = _generate(model_dir, prompts, **kwargs)
    assert ref_engine.runner.fast is None and engine.runner.fast is not None
    assert (engine.runner.arena is None) == (kwargs.get("decode_arena_tokens") == 0)
    for a, b in zip(reference, fast):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4
    engine.check_integrity()


def test_decoded_tokens_reach_the_pool_as_on_the_reference_path(model_dir):
    """Decode rows attend over the DecodeArena but their K/V also reach the pool (the truth that
    prefix caching and SCR reuse): it ends up as the reference Decoder leaves it."""
    prompts = _prompts((7, 30))
    _, ref_engine = _generate(model_dir, prompts, fast_path=False)
    _, engine = _generate(model_dir, prompts)
    used = ref_engine.runner.pool.k.abs().sum(dim=(0, 2, 3)) != 0
    assert int(used.sum()) >= sum(len(p) for p in prompts) + 2 * (GREEDY.max_tokens - 1)
    for ours, theirs in ((engine.runner.pool.k, ref_engine.runner.pool.k), (engine.runner.pool.v, ref_engine.runner.pool.v)):
        assert torch.allclose(ours[:, used], theirs[:, used], atol=1e-4, rtol=1e-4)


def test_prefix_hit_on_the_fast_path_equals_a_cold_run(model_dir):
    shared = _prompts((40,))[0]
    cold, _ = _generate(model_dir, [shared + [7, 8, 9]])
    llm = LLM(engine=build_engine(EngineConfig(model=model_dir, num_slots=2048)))
    llm.generate([shared + [1, 2]], GREEDY)
    [warm] = llm.generate([shared + [7, 8, 9]], GREEDY)
    assert warm.reuse.prefix_tokens > 0 and warm.token_ids == cold[0].token_ids


def test_long_prompt_is_chunked_by_the_step_budget_while_others_decode(model_dir):
    """A request decodes; a long prompt arrives: each step carries at most the budget's share of
    it (here the progress guarantee, the machine's timings aside), and it still finishes."""
    llm = LLM(engine=build_engine(EngineConfig(model=model_dir, num_slots=4096, step_budget_ratio=1.0,
                                               min_prefill_tokens=8)))
    engine = llm.engine
    engine.add_request(_prompts((6,))[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    while not engine.scheduler.running or not engine.scheduler.running[0].is_decoding:
        engine.step()
    engine.step()
    engine.step()  # decode-only steps: the budget now knows the decode step time
    long_rid = engine.add_request(_prompts((300,))[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    shares, done = [], False
    while not done:
        decodes, prefills = engine._schedule()
        chunks = decodes + prefills
        shares.append(sum(len(c.offsets) for c in chunks if not (c.req.is_decoding and len(c.offsets) == 1)))
        results = engine.runner.run(chunks)
        outs = [engine._postprocess(c, r) for c, r in zip(chunks, results)]
        done = any(o is not None and o.rid == long_rid and o.finished for o in outs)
    prefill_steps = [s for s in shares if s > 0]
    assert all(s >= 1 for s in prefill_steps)
    assert max(prefill_steps) < 300          # chunked, not one 300-token step next to the decode
    assert sum(prefill_steps) >= 300


def test_cpu_bf16_detection_reads_the_flags(tmp_path):
    with_amx, plain = tmp_path / "amx", tmp_path / "plain"
    with_amx.write_text("processor : 0\nflags : fpu avx2 avx512f amx_bf16 amx_tile\n")
    plain.write_text("processor : 0\nflags : fpu avx2 fma\n")
    assert cpu_has_native_bf16(str(with_amx)) and not cpu_has_native_bf16(str(plain))
    assert not cpu_has_native_bf16(str(tmp_path / "missing"))
    assert resolve_auto_dtype("float32") == torch.float32
    assert resolve_auto_dtype("auto") in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError):
        resolve_auto_dtype("int7")


def test_weight_format_auto_is_dense_in_fp32_and_int4_on_4bit_data_in_bf16():
    cfg = ModelConfig.from_hf_config(dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False))
    model = Decoder.from_config(cfg)
    assert resolve_weight_format("auto", model) == WeightFormat("dense", "dense")
    bf16 = Decoder.from_config(cfg, dtype=torch.bfloat16)
    assert resolve_weight_format("auto", bf16) == WeightFormat("dense", "dense")   # random weights: not 4-bit
    with torch.no_grad():
        for name, param in bf16.named_parameters():
            if name.endswith("proj.weight"):
                q = torch.randint(0, 16, param.shape).float()
                q[:, ::32], q[:, 1::32] = 0, 15
                param.copy_((q * 0.01 - 0.08).to(torch.bfloat16))
    assert resolve_weight_format("auto", bf16) == WeightFormat("int4", "dense")
    assert resolve_weight_format("int8", model) == WeightFormat("int8", "int8")
    assert resolve_weight_format("int4", model) == WeightFormat("int4", "int8")
    with pytest.raises(ValueError, match="weight format"):
        resolve_weight_format("fp4", model)


def test_engine_config_checks_the_new_fields():
    for bad in (dict(weight_format="q4"), dict(step_budget_ratio=0.5), dict(min_prefill_tokens=0),
                dict(decode_arena_tokens=-1)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


def test_cli_engine_flags_reach_the_engine_config():
    from kvsplice.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "--weight-format", "int4", "--no-fast-path", "--decode-arena-tokens",
                                      "0", "--step-budget-ratio", "3", "--min-prefill-tokens", "32"])
    config = engine_config_from_args(args, {})
    assert (config.dtype, config.weight_format, config.fast_path, config.decode_arena_tokens,
            config.step_budget_ratio, config.min_prefill_tokens) == ("auto", "int4", False, 0, 3.0, 32)
    default = engine_config_from_args(build_parser().parse_args(["serve"]), {})
    assert default.weight_format == "auto" and default.fast_path and default.step_budget_ratio == 2.5
