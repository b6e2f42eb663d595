"""A seeded reply alone, alone again (its prompt now from the prefix cache), and beside N other
decoding requests, against a running `kvsplice serve`: whether the text stays the same, and where it
leaves the lone run's text (docs/COMPATIBILITY.md, "Seeds and reproducibility").

    kvsplice serve --port 8000 &
    python benchmarks/seed_reproducibility.py --url http://127.0.0.1:8000 [--beside 7,8]

Before measuring it sends short requests until /health's `compiled_decode` has settled (the speed
trial of `--compile-decode auto` advances with decode steps), so the runs see the decode path the
server keeps. The others are started first and given --head-start-s to reach their decode steps.
"""

from __future__ import annotations

import argparse
import threading
import time

import httpx

from kvsplice.bench.machine import cpu_line

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SETTLED = ("active", "eager", "failed")


def settle(url: str, timeout_s: float) -> str:
    """Short requests until the compiled decode step has settled; its /health state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = httpx.get(f"{url}/health", timeout=10).json().get("compiled_decode", "off")
        if state in SETTLED or state == "off" or time.monotonic() > deadline:
            return state
        httpx.post(f"{url}/v1/completions", timeout=600,
                   json={"prompt": "Hello there", "max_tokens": 16, "ignore_eos": True})


def seeded(url: str, tokens: int) -> str:
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0.9, "seed": 1234, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=900).json()["choices"][0]["text"]


def other(url: str, i: int, statuses: list[int]) -> None:
    body = {"prompt": f"Tell me fact number {i} about the ocean, in detail.", "max_tokens": 160,
            "temperature": 0.9, "seed": i, "ignore_eos": True}
    statuses.append(httpx.post(f"{url}/v1/completions", json=body, timeout=900).status_code)


def beside(url: str, count: int, tokens: int, head_start_s: float) -> tuple[str, list[int]]:
    """The seeded reply while `count` others decode; (its text, the others' statuses)."""
    statuses: list[int] = []
    threads = [threading.Thread(target=other, args=(url, i, statuses)) for i in range(count)]
    for thread in threads:
        thread.start()
    time.sleep(head_start_s)
    text = seeded(url, tokens)
    for thread in threads:
        thread.join()
    return text, statuses


def first_difference(a: str, b: str) -> int | None:
    """The first character where `a` and `b` differ (None when equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--beside", default="7,8", help="counts of other decoding requests")
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--head-start-s", type=float, default=3.0)
    parser.add_argument("--settle-timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    print(cpu_line())
    print(f"compiled_decode: {settle(args.url, args.settle_timeout_s)}")
    alone = seeded(args.url, args.tokens)
    again = seeded(args.url, args.tokens)
    print(f"alone, then alone again (prompt from the prefix cache): same text {alone == again} "
          f"(first difference at character {first_difference(alone, again)})")
    for count in (int(c) for c in args.beside.split(",")):
        text, statuses = beside(args.url, count, args.tokens, args.head_start_s)
        print(f"beside {count} decoding requests: same text {text == alone} (first difference at character "
              f"{first_difference(alone, text)}); the others' statuses {sorted(set(statuses))}")


if __name__ == "__main__":
    main()
