"""Prefill and decode speed of a hybrid (qwen3_5_text) model: kvsplice vs transformers, same weights.

    python benchmarks/hybrid_speed.py [--model-dir DIR] [--prompt 512] [--decode 32] [--hidden 512] [--layers 8]

Without --model-dir a random qwen3_5_text model of the given size is built (speed does not depend
on the weights). kvsplice runs through its Decoder with a KV pool and a StatePool (one request,
chunked delta rule for the prefill, the recurrent step for decode); transformers runs
`Qwen3_5ForCausalLM` with its own cache (its torch fallbacks for the delta rule and the conv).
Prints one JSON line per engine: prefill tokens/s and decode tokens/s (median of --repeat runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.state_pool import StatePool
from kvsplice.layers.forward_batch import ForwardBatch, LinearSeq, Segment, SeqSlice
from kvsplice.models.config import ModelConfig
from kvsplice.models.decoder import Decoder


def build_hf(args):
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    if args.model_dir:
        return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    heads = max(2, args.hidden // 64)
    config = Qwen3_5TextConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=2,
                               head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                               linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
                               max_position_embeddings=8192)
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).float().eval()


def kvsplice_run(model: Decoder, cfg: ModelConfig, ids: list[int], decode: int) -> tuple[float, float]:
    pool = KVPool(len(ids) + decode + 1, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim)
    states = StatePool(1, cfg.num_linear_layers, cfg.linear_attn)

    def step(tokens: list[int], start: int) -> torch.Tensor:
        n = len(tokens)
        positions = torch.arange(start, start + n)
        seq = SeqSlice(0, n, torch.arange(start + n), torch.arange(start + n))
        batch = ForwardBatch(torch.tensor(tokens), positions, positions.clone(), (seq,), torch.tensor([n - 1]),
                             (LinearSeq(0, (Segment(0, n),)),))
        return model(batch, pool, states)

    started = time.perf_counter()
    token = int(step(ids, 0).argmax())
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    for offset in range(len(ids), len(ids) + decode):
        token = int(step([token], offset).argmax())
    return prefill_s, time.perf_counter() - started


@torch.inference_mode()
def hf_run(hf, ids: list[int], decode: int) -> tuple[float, float]:
    started = time.perf_counter()
    out = hf(torch.tensor([ids]), use_cache=True)
    prefill_s = time.perf_counter() - started
    cache, token = getattr(out, 'cache', None) or out.past_key_values, out.logits[0, -1].argmax()
    started = time.perf_counter()
    for _ in range(decode):
        out = hf(token.view(1, 1), cache=cache, use_cache=True)
        cache, token = getattr(out, 'cache', None) or out.past_key_values, out.logits[0, -1].argmax()
    return prefill_s, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    hf = build_hf(args)
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    ours = Decoder.from_config(cfg)
    ours.load_hf_state_dict(hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    for name, fn in (("kvsplice", lambda: kvsplice_run(ours, cfg, ids, args.decode)),
                     ("transformers", lambda: hf_run(hf, ids, args.decode))):
        fn()  # warm-up
        runs = [fn() for _ in range(args.repeat)]
        prefill = statistics.median(r[0] for r in runs)
        decode = statistics.median(r[1] for r in runs)
        print(json.dumps({"engine": name, "prompt": args.prompt, "decode": args.decode,
                          "threads": torch.get_num_threads(),
                          "prefill_tok_s": round(args.prompt / prefill, 1),
                          "decode_tok_s": round(args.decode / decode, 1)}))


if __name__ == "__main__":
    main()
