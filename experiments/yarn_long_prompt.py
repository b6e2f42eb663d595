"""Does SmolLM2-135M-Instruct, its 8K context stretched with YaRN (`--hf-overrides`), still end its turns
on a ~20K-token prompt, and what does the stretch cost it?

1. Fidelity, cheaply: the mean negative log-likelihood of a 12K-token text (the repository's docs), per
   4K-token band of positions, under the native RoPE run past 8K (`max_position_embeddings` raised
   alone, no scaling), YaRN x2 and YaRN x4. The first band is inside the native context: what YaRN costs
   there; the last is past it: what YaRN buys.
2. Ending turns: YaRN x4, a ~20K-token system prompt (the same docs) and short questions, greedy, up to
   256 tokens: the finish reason (stop: the model wrote <|im_end|>), the length and the reply.

    python experiments/yarn_long_prompt.py
"""
import argparse
import json
import time
from pathlib import Path

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
NATIVE = 8192
QUESTIONS = ("What is the capital of France?", "Say hello to the user in one short sentence.",
             "In one sentence, what is this documentation about?")


def yarn(factor: int) -> dict:
    return {"rope_scaling": {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": NATIVE},
            "max_position_embeddings": NATIVE * factor}


def docs_text() -> str:
    names = ("ARCHITECTURE.md", "SERVING.md", "COMPATIBILITY.md", "SECURITY.md", "BENCHMARKS_HISTORY.md")
    return "\n\n".join((ROOT / "docs" / name).read_text() for name in names)


def llm(overrides: dict) -> LLM:
    return LLM(engine=build_engine(EngineConfig(hf_overrides=overrides, dtype="auto", num_slots=40_000,
                                                max_batch_tokens=1024, compile_decode="off")))


def band_nll(model: LLM, ids: list[int], band: int) -> list[float]:
    """Mean NLL of the prompt's tokens per `band` positions."""
    result = model.generate(ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    nll = [-entry.logprob for entry in result.prompt_logprobs[1:]]
    return [round(sum(nll[i:i + band]) / len(nll[i:i + band]), 3) for i in range(0, len(nll), band)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nll-tokens", type=int, default=12_288)
    parser.add_argument("--prompt-tokens", type=int, default=20_000)
    parser.add_argument("--configs", nargs="+", default=["native past 8K", "yarn x2", "yarn x4"],
                        help="which NLL runs, in order; the last must be yarn x4 (the generation runs on it)")
    args = parser.parse_args()
    text = docs_text()
    report = {}
    configs = {"native past 8K": {"max_position_embeddings": 4 * NATIVE}, "yarn x2": yarn(2), "yarn x4": yarn(4)}
    for name in args.configs:
        overrides = configs[name]
        model = llm(overrides)
        ids = model.tokenizer.encode(text, add_special_tokens=False)[:args.nll_tokens]
        started = time.perf_counter()
        report[name] = {"nll per 4K band": band_nll(model, ids, 4096), "s": round(time.perf_counter() - started)}
        print(name, report[name], flush=True)
    # model is YaRN x4
    doc = model.tokenizer.decode(model.tokenizer.encode(text, add_special_tokens=False)[:args.prompt_tokens])
    for system in ("You are a helpful assistant. The project's documentation follows.\n\n" + doc,
                   "You are a helpful assistant."):
        for question in QUESTIONS:
            prompt = model.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                          {"role": "user", "content": question}])
            started = time.perf_counter()
            out = model.generate(prompt, SamplingParams(max_tokens=256, temperature=0.0))[0]
            row = {"prompt": len(prompt), "finish": out.finish_reason, "tokens": len(out.token_ids),
                   "s": round(time.perf_counter() - started), "reply": out.text}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
