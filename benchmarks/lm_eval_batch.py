"""lm-evaluation-harness against kvsplice: `local-completions` log-likelihoods at batch size > 1 equal batch size 1.

    python benchmarks/lm_eval_batch.py [--batch-sizes 1,4,8]

Starts `kvsplice serve --served-model-name test-model` on the default model, then drives lm-eval's own
`local-completions` model class (LocalCompletionsAPI, tokenizer_backend=huggingface on the model's local
tokenizer, tokenized_requests as lm-eval's default) with loglikelihood Instances built from a small
local multiple-choice set (no dataset download). lm-eval sends each batch as one /v1/completions
request with a list of token-id prompts, echo, logprobs 1 and max_tokens 1, and sums the echoed
continuation's token logprobs. The script prints, per batch size, the largest absolute difference
from batch size 1 and whether the greedy flags agree; the repeat of batch size 1 at the end is the
baseline (what the same requests differ by with no batching difference at all).
Needs `pip install lm-eval`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVED_MODEL_NAME = "test-model"
START_TIMEOUT_S = 1800  # a loaded 2-core machine can take minutes to load the model

# (context, continuations): a small local multiple-choice set in lm-eval's loglikelihood shape.
QUESTIONS = (
    ("The capital of France is", (" Paris", " Berlin", " Madrid")),
    ("Water freezes at a temperature of zero degrees", (" Celsius", " Fahrenheit", " Kelvin")),
    ("The largest planet in our solar system is", (" Jupiter", " Mars", " Venus")),
    ("Question: What do bees make?\nAnswer:", (" honey", " milk", " silk")),
    ("The opposite of hot is", (" cold", " warm", " loud")),
    ("A week has seven", (" days", " hours", " months")),
    ("Shakespeare wrote the play Romeo and", (" Juliet", " Hamlet", " Macbeth")),
    ("Question: How many legs does a spider have?\nAnswer:", (" eight", " six", " four")),
)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    import httpx

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen([sys.executable, "-m", "kvsplice.cli", "serve", "--served-model-name",
                                SERVED_MODEL_NAME, "--port", str(port)], env=env, cwd=str(ROOT),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"kvsplice serve exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise SystemExit(f"kvsplice serve was not healthy within {START_TIMEOUT_S} s")


def instances():
    from lm_eval.api.instance import Instance

    out = []
    for doc_id, (context, choices) in enumerate(QUESTIONS):
        for choice in choices:
            out.append(Instance(request_type="loglikelihood", doc={"context": context}, arguments=(context, choice),
                                idx=len(out), metadata=("local_choices", doc_id, 1)))
    return out


def loglikelihoods(port: int, batch_size: int) -> list[tuple[float, bool]]:
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from kvsplice.models.default_model import default_model_dir

    lm = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{port}/v1/completions", model=SERVED_MODEL_NAME,
                             tokenizer_backend="huggingface", tokenizer=str(default_model_dir()),
                             batch_size=batch_size, max_retries=1, timeout=600)
    return lm.loglikelihood(instances(), disable_tqdm=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--url", help="a running `kvsplice serve --served-model-name test-model` (http://host:port) "
                                      "to use instead of starting one")
    args = parser.parse_args(argv)
    sizes = [int(part) for part in args.batch_sizes.split(",")]
    import lm_eval
    from kvsplice.bench.machine import cpu_line

    print(cpu_line())
    print(f"load average: {os.getloadavg()[0]:.2f}; lm-eval {lm_eval.__version__}; "
          f"{len(instances())} loglikelihood requests ({len(QUESTIONS)} questions)")
    if args.url:
        port, server = int(args.url.rsplit(":", 1)[1].strip("/")), None
    else:
        port = free_port()
        server = start_server(port)
    try:
        base = loglikelihoods(port, 1)
        print("| batch size | max abs diff vs batch 1 | greedy flags equal |")
        print("| ---: | ---: | --- |")
        for size in [*[s for s in sizes if s != 1], 1]:
            other = loglikelihoods(port, size)
            diff = max(abs(a[0] - b[0]) for a, b in zip(base, other))
            same_greedy = all(a[1] == b[1] for a, b in zip(base, other))
            label = f"{size} (repeat)" if size == 1 else str(size)
            print(f"| {label} | {diff:.2e} | {'yes' if same_greedy else 'no'} |")
        picked = sum(max(range(3), key=lambda c: base[q * 3 + c][0]) == 0 for q in range(len(QUESTIONS)))
        print(f"first choice (the right one) most likely: {picked} of {len(QUESTIONS)}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
