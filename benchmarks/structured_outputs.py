"""Structured outputs on the default model: the per-token cost of grammar-constrained decoding against
unconstrained decoding, and how often strict json_schema replies validate.

    python benchmarks/structured_outputs.py [--model DIR] [--batch 1 8] [--requests 50] [--repeats 2]
                                            [--decode-tokens 96] [--out FILE]

1. mask cost: per decode step, filling the grammar bitmask of B rows (xgrammar) and applying it to the
   logits, against the sampler's own time on the same [B, vocab] logits (the baseline a step pays
   anyway), along real JSON replies.
2. decode cost: B concurrent requests with a json_schema constraint against the same prompts
   unconstrained, each run to the same number of tokens (ignore_eos): milliseconds per generated token
   and their ratio (best of --repeats runs each).
3. validity: --requests varied requests (5 schemas x prompts x seeds, temperature 0.7), strict
   json_schema: the share whose reply parses and validates (jsonschema).
Prints a table and writes JSON (--out). The CPU (model name, flags) is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvsplice.bench.machine import cpu_line
from kvsplice.config import EngineConfig
from kvsplice.engine.llm import LLM, build_engine
from kvsplice.layers.logits_processors import LogitsState, process_logits
from kvsplice.layers.sampler import sample
from kvsplice.sampling_params import SamplingParams
from kvsplice.structured.matcher import GrammarState
from kvsplice.structured.spec import StructuredSpec

SCHEMAS = [
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 100}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "temperatures": {"type": "array", "items": {"type": "number"}, "minItems": 1,
                                                       "maxItems": 5}},
     "required": ["city", "temperatures"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40}, "year": {"type": "integer"},
                                      "genres": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                 "maxItems": 3}},
     "required": ["title", "year", "genres"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},
     "required": ["person", "email"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "action": {"type": "string", "maxLength": 30}},
        "required": ["n", "action"], "additionalProperties": False}}},
     "required": ["steps"], "additionalProperties": False},
]
# one valid reply per schema, as the grammar writes JSON (compact), for --mask-only
EXAMPLES = [
    '{"answer": "yes", "confidence": 87}',
    '{"city": "Paris", "temperatures": [18.5, 21, 19.25, 17]}',
    '{"title": "The Long Way Home", "year": 1999, "genres": ["drama", "road movie"]}',
    '{"person": {"name": "Ada Lovelace", "age": 36}, "email": "ada@maths.com"}',
    '{"steps": [{"n": 1, "action": "mix flour and water"}, {"n": 2, "action": "knead for ten minutes"}]}',
]
TOPICS = ["the weather in Paris", "a film you like", "a person you know", "how to bake bread", "Python",
          "the sea", "a mountain trip", "a football match", "a library", "a train journey"]


def chat_prompt(llm: LLM, index: int) -> list[int]:
    topic = TOPICS[index % len(TOPICS)]
    messages = [{"role": "user", "content": f"Reply in JSON only. Tell me about {topic}."}]
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def mask_cost(llm: LLM, batch: int, replies: list[list[int]], repeats: int = 3) -> dict:
    """Microseconds per step of the grammar part of logits processing against the sampler itself,
    each row following its own constrained reply (row i: SCHEMAS[i % 5], as decode_cost made it)."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    specs = [StructuredSpec.json_schema(SCHEMAS[row % len(SCHEMAS)]) for row in range(batch)]
    steps = min(len(r) for r in replies[:batch])
    best_mask, best_sample = float("inf"), float("inf")
    for _ in range(repeats):
        states = [LogitsState.create(SamplingParams(structured=spec), [1], vocab, engine.tokenizer.eos_token_ids,
                                     GrammarState(engine.grammars.compile(spec))) for spec in specs]
        params = [SamplingParams(temperature=0.7)] * batch
        mask_s = sample_s = 0.0
        for step in range(steps):
            logits = torch.randn(batch, vocab)
            start = time.perf_counter()
            processed = process_logits(logits, states)
            mask_s += time.perf_counter() - start
            start = time.perf_counter()
            sample(processed, params, [None] * batch)
            sample_s += time.perf_counter() - start
            for row, state in enumerate(states):   # follow the real replies
                state.accept(replies[row][step])
        assert not any(state.grammar_broken for state in states)
        best_mask, best_sample = min(best_mask, mask_s / steps), min(best_sample, sample_s / steps)
    return {"batch": batch, "steps": steps, "mask_us_per_step": best_mask * 1e6,
            "sampler_us_per_step": best_sample * 1e6, "mask_over_sampler": best_mask / best_sample}


def decode_cost(llm: LLM, batch: int, repeats: int, max_tokens: int) -> tuple[dict, list[list[int]]]:
    """ms per generated token, constrained vs unconstrained to the same lengths."""
    prompts = [chat_prompt(llm, i) for i in range(batch)]
    constrained_params = [SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                         structured=StructuredSpec.json_schema(SCHEMAS[i % len(SCHEMAS)]))
                          for i in range(batch)]
    best_c, best_u, replies = float("inf"), float("inf"), []
    for _ in range(repeats):
        llm.engine.flush_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, constrained_params, scr="off")
        best_c = min(best_c, time.perf_counter() - start)
        replies = [o.token_ids for o in outs]
        free_params = [SamplingParams(max_tokens=max(1, len(r)), temperature=0.0, ignore_eos=True) for r in replies]
        llm.engine.flush_cache()
        start = time.perf_counter()
        llm.generate(prompts, free_params, scr="off")
        best_u = min(best_u, time.perf_counter() - start)
    tokens = sum(len(r) for r in replies)
    return ({"batch": batch, "tokens": tokens, "constrained_ms_per_token": best_c / tokens * 1e3,
             "unconstrained_ms_per_token": best_u / tokens * 1e3, "ratio": best_c / best_u}, replies)


def validity(llm: LLM, requests: int) -> dict:
    import jsonschema

    prompts, params = [], []
    for i in range(requests):
        prompts.append(chat_prompt(llm, i))
        params.append(SamplingParams(max_tokens=200, temperature=0.7, seed=i,
                                     structured=StructuredSpec.json_schema(SCHEMAS[i % len(SCHEMAS)])))
    outs = []
    for start in range(0, requests, 25):
        outs += llm.generate(prompts[start:start + 25], params[start:start + 25], scr="off")
    valid, failures = 0, []
    for i, out in enumerate(outs):
        try:
            jsonschema.validate(json.loads(out.text), SCHEMAS[i % len(SCHEMAS)])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as error:
            failures.append({"request": i, "finish_reason": out.finish_reason, "text": out.text, "error": str(error)[:200]})
    return {"requests": requests, "valid": valid, "share": valid / requests, "failures": failures,
            "mean_tokens": sum(len(o.token_ids) for o in outs) / requests,
            "example": outs[0].text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=96, help="max tokens of a decode-cost reply")
    parser.add_argument("--out", default=None)
    parser.add_argument("--mask-only", action="store_true",
                        help="only the mask cost, along fixed valid replies (no decoding: quick)")
    args = parser.parse_args()
    torch.manual_seed(0)
    llm = LLM(engine=build_engine(EngineConfig(model=args.model)))
    result = {"cpu": cpu_line(), "threads": torch.get_num_threads(), "model": llm.engine.name,
              "decode": [], "mask": []}
    print(f"model {llm.engine.name}, CPU {result['cpu']}, {result['threads']} threads")
    if args.mask_only:
        eos = llm.tokenizer.eos_token_ids[0]
        replies = [llm.tokenizer.encode(EXAMPLES[row % len(EXAMPLES)], add_special_tokens=False) + [eos]
                   for row in range(max(args.batch))]
        for rows in args.batch:
            mask = mask_cost(llm, rows, replies)
            result["mask"].append(mask)
            print(f"mask    B={rows}: grammar {mask['mask_us_per_step']:.0f} us/step, sampler "
                  f"{mask['sampler_us_per_step']:.0f} us/step ({mask['steps']} steps)")
        args.batch, args.requests = [], 0
    for batch in args.batch:
        decode, replies = decode_cost(llm, batch, args.repeats, args.decode_tokens)
        result["decode"].append(decode)
        print(f"decode  B={batch}: constrained {decode['constrained_ms_per_token']:.1f} ms/token, unconstrained "
              f"{decode['unconstrained_ms_per_token']:.1f} ms/token, ratio {decode['ratio']:.3f} ({decode['tokens']} tokens)")
        for rows in sorted({1, batch}):
            mask = mask_cost(llm, rows, replies)
            result["mask"].append(mask)
            print(f"mask    B={rows}: grammar {mask['mask_us_per_step']:.0f} us/step, sampler "
                  f"{mask['sampler_us_per_step']:.0f} us/step ({mask['steps']} steps)")
    if args.requests:
        result["validity"] = validity(llm, args.requests)
        v = result["validity"]
        print(f"validity: {v['valid']}/{v['requests']} strict json_schema replies parse and validate "
              f"(mean {v['mean_tokens']:.0f} tokens); example {v['example']!r}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
