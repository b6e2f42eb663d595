"""SCR on a trained hybrid: fork vs checkpoint vs none state modes against exact recompute.

    python benchmarks/hybrid_fidelity.py [--model models/hybrid-mini] [--checkpoint-every 256] [--out runs/hybrid_fidelity.json]

Runs `kvsplice.bench.fidelity_hybrid` over the built-in edit cases (1.5K-4K-token agent chats) on
the hybrid trained by scripts/train_hybrid.py: per state mode, mean/p90 KL(exact || SCR) over the
last 32 prompt positions, top-1 and greedy agreement, and the prompt tokens relocated and
prefilled (the computed tokens per edited turn); "scr off" is prefix caching alone (exact).
"""

from __future__ import annotations

import argparse
import json

from kvsplice.bench.fidelity_hybrid import fidelity_hybrid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/hybrid-mini")
    parser.add_argument("--checkpoint-every", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = fidelity_hybrid(args.model, checkpoint_every=args.checkpoint_every, gen_tokens=args.gen_tokens,
                             log=lambda _: None)
    print(f"model {args.model}; state checkpoints every {args.checkpoint_every} tokens; K=6 tail=16")
    print(report["table"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": report["results"], "summaries": report["summaries"]}, f, indent=2)


if __name__ == "__main__":
    main()
