"""Gemma 3 270M (the Q4_K_M GGUF from PyPI) on `kvsplice serve` against llama.cpp's llama-server on
the same file, one server busy at a time, each at its defaults plus what the comparison needs.

    python benchmarks/gemma3_vs_llamacpp.py [--prefill-lengths 2048,8192,32768] [--edit-length 32768]
        [--edit-kinds delete_tool_result,strip_reasoning] [--decode-tokens 128] [--streams 8] [--decode-repeats 3]
        [--llama-server PATH] [--kvsplice-args "..."] [--out runs/gemma3_vs_llamacpp.json]

kvsplice: `kvsplice serve --model <gguf>` (no flags: bf16, `--weight-format auto`, which takes the
GGUF's own blocks on this file). llama-server: `-m <gguf> -np 8 -c 8 x (edit length + 512)
--cache-reuse 16`. Both get the same token ids on /v1/completions (built with kvsplice's tokenizer;
the chats rendered with benchmarks/templates/gemma3_turns.jinja, as the base model has no
template), greedy, `ignore_eos`, streamed:

  cold prefill   time to the one output token of a fresh prompt of random tokens at each length
  decode         tokens/s of one stream, then of `--streams` at once (aggregate), after a 32-token prompt;
                 the median of `--decode-repeats` runs (every run's figure in the JSON)
  edited TTFT    turn 1 of a long agent chat (`kvsplice.bench.edit_cases.long_cases` at `--edit-length`
                 tokens), then its edited turn 2: time to first token of turn 2 (kvsplice with an SCR
                 session; llama-server reusing its slot's cache with --cache-reuse 16), and what each
                 server says it reused (kvsplice: usage.reuse; llama-server: the final chunk's timings)

Each server is measured once it has settled (vs_llamacpp's `settle`: kvsplice's compiled decode step
built and, under auto, measured against the eager one). It prints the CPU, the load average before and after, one table of both servers with ratios (kvsplice
advantage: > 1 is kvsplice better), and writes the figures as JSON (--out). Exits 0 with a message when
llama-server is not found (see benchmarks/vs_llamacpp.py) and 2 without the Gemma packages.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemma3 import TEMPLATE, gguf_path  # noqa: E402
from vs_llamacpp import (Server, Stream, complete, find_llama_server, free_port, in_threads,  # noqa: E402
                         open_clients, settle)

from kvsplice.bench.edit_cases import fill_reply, long_cases  # noqa: E402
from kvsplice.bench.machine import cpu_line  # noqa: E402

REPLY = "I will read the next file now."
ROOM = 96   # tokens of turn 2 kept free for the reply placeholder's text and the output


def stream_completion(base: str, prompt: list[int], max_tokens: int, extra: dict,
                      client: httpx.Client | None = None) -> Stream:
    """vs_llamacpp's streamed greedy /v1/completions, asking for the usage chunk at the end."""
    return complete(base, prompt, max_tokens, {"stream_options": {"include_usage": True}, **extra}, client=client)


def reused(last: dict) -> str:
    """What the server's last chunk says about the cache: kvsplice's usage.reuse, llama-server's timings."""
    reuse = (last.get("usage") or {}).get("reuse")
    if reuse:
        return (f"relocated {reuse.get('relocated_tokens')}, prefix {reuse.get('prefix_tokens')}, "
                f"computed {reuse.get('prefilled_tokens')}")
    timings = last.get("timings")
    if timings:
        return f"cache_n {timings.get('cache_n')}, computed {timings.get('prompt_n')}"
    return "not reported"


class Prompts:
    """Every prompt both servers get (token ids), built once with kvsplice's tokenizer."""

    def __init__(self, gguf: Path, edit_length: int, kinds: tuple[str, ...], seed: int = 0):
        from kvsplice.models.loader import load_checkpoint

        tokenizer = load_checkpoint(str(gguf), dtype=torch.bfloat16).tokenizer
        template = TEMPLATE.read_text()
        self.vocab = tokenizer.vocab_size
        self.random_gen = torch.Generator().manual_seed(seed)

        def render(messages) -> list[int]:
            return tokenizer.apply_chat_template(list(messages), chat_template=template)
        cases = long_cases(edit_length - ROOM, kinds=kinds, count=lambda messages: len(render(messages)))
        self.edits = [(case.name, render(case.turn1), render(fill_reply(case.turn2, REPLY))) for case in cases]

    def random(self, n: int) -> list[int]:
        return [2] + torch.randint(1000, self.vocab - 1000, (n - 1,), generator=self.random_gen).tolist()


def cold_prefill(base: str, prompts: Prompts, lengths: list[int]) -> dict:
    """Seconds to the one output token of a fresh random prompt per length (best of two below 16K)."""
    out = {}
    for n in lengths:
        times = []
        for _ in range(2 if n < 16384 else 1):
            result = stream_completion(base, prompts.random(n), 1, {})
            times.append(result.done - result.sent)
        out[f"prefill_{n}_s"] = min(times)
    return out


def decode_once(base: str, prompts: Prompts, tokens: int, streams: int) -> tuple[float, float]:
    """Tokens/s of one stream, then aggregate over `streams` at once, between first and last chunk."""
    single = stream_completion(base, prompts.random(32), tokens, {})
    many = [prompts.random(32) for _ in range(streams)]
    with open_clients(streams) as clients:
        results = in_threads([lambda p=p, c=c: stream_completion(base, p, tokens, {}, c)
                              for p, c in zip(many, clients)])
    first = min(r.chunks[0] for r in results)
    last = max(r.chunks[-1] for r in results)
    chunks = single.chunks
    return ((len(chunks) - 1) / (chunks[-1] - chunks[0]),
            sum(len(r.chunks) - 1 for r in results) / (last - first))


def decode(base: str, prompts: Prompts, tokens: int, streams: int, repeats: int) -> dict:
    """`decode_once` `repeats` times: the median of each figure, and every run's (`..._runs`). Why:
    the same phase on the same server has spread by a tenth and more between runs on this shared
    2-core machine, more than the gap being measured (docs/BENCHMARKS_HISTORY.md, "Gemma 3 270M
    against llama-server, the 17:31 run (on the page until 7 December 19:50)")."""
    runs = [decode_once(base, prompts, tokens, streams) for _ in range(repeats)]
    ones, manys = [run[0] for run in runs], [run[1] for run in runs]
    return {"decode_1_tok_s": statistics.median(ones), f"decode_{streams}_tok_s": statistics.median(manys),
            "decode_1_tok_s_runs": [round(v, 1) for v in ones],
            f"decode_{streams}_tok_s_runs": [round(v, 1) for v in manys]}


def edited_ttft(base: str, prompts: Prompts, session: bool) -> dict:
    """Turn 1 then its edited turn 2, per edit kind: turn 2's time to first token and what was reused."""
    out = {}
    for name, turn1, turn2 in prompts.edits:
        extra = {"session_id": f"edit-{name}"} if session else {}
        first = stream_completion(base, turn1, 8, extra)
        second = stream_completion(base, turn2, 8, extra)
        out[f"edit_{name}_turn1_ttft_s"] = first.ttft
        out[f"edit_{name}_ttft_s"] = second.ttft
        out[f"edit_{name}_tokens"] = len(turn2)
        out[f"edit_{name}_reused"] = reused(second.last)
    return out


def measure(server: Server, prompts: Prompts, args, session: bool) -> dict:
    settled = settle(server, prompts)   # kvsplice's compiled decode built and switched in (or not) first
    print(f"  {server.name}: start-up settled in {settled['settle_s']:.1f} s (compiled decode: "
          f"{settled['compiled_decode']})", flush=True)
    figures = {}
    for phase in (lambda: cold_prefill(server.url, prompts, args.prefill_lengths),
                  lambda: decode(server.url, prompts, args.decode_tokens, args.streams, args.decode_repeats),
                  lambda: edited_ttft(server.url, prompts, session)):
        figures.update(phase())
        print(f"  {server.name}: {json.dumps(figures)}", flush=True)
    return figures


def table(ours: dict, theirs: dict, args, prompts: Prompts) -> list[str]:
    rows = [(f"cold prefill {n:,} tokens (s)", f"prefill_{n}_s", "lower") for n in args.prefill_lengths]
    rows += [("decode, 1 stream (tok/s)", "decode_1_tok_s", "higher"),
             (f"decode, {args.streams} streams aggregate (tok/s)", f"decode_{args.streams}_tok_s", "higher")]
    rows += [(f"edited turn TTFT, {name} ({ours.get(f'edit_{name}_tokens', 0):,} tokens) (s)", f"edit_{name}_ttft_s",
              "lower") for name, _, _ in prompts.edits]
    lines = ["| measure | kvsplice | llama-server | kvsplice advantage |", "|---|---|---|---|"]
    for label, key, better in rows:
        if key in ours and key in theirs:
            ratio = theirs[key] / ours[key] if better == "lower" else ours[key] / theirs[key]
            lines.append(f"| {label} | {ours[key]:.3f} | {theirs[key]:.3f} | {ratio:.2f}x |")
    for name, _, _ in prompts.edits:
        lines.append(f"  {name}: kvsplice {ours.get(f'edit_{name}_reused')}; "
                     f"llama-server {theirs.get(f'edit_{name}_reused')}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-lengths", default="2048,8192,32768")
    parser.add_argument("--edit-length", type=int, default=32768)
    parser.add_argument("--edit-kinds", default="delete_tool_result,strip_reasoning")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--decode-repeats", type=int, default=3, help="decode runs per server; the median is reported")
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--kvsplice-args", default="", help="extra `kvsplice serve` flags, one string")
    parser.add_argument("--only", choices=("kvsplice", "llama"), default=None)
    parser.add_argument("--out", default="runs/gemma3_vs_llamacpp.json")
    args = parser.parse_args()
    args.prefill_lengths = [int(n) - 64 for n in args.prefill_lengths.split(",")]   # room for the output
    binary = find_llama_server(args.llama_server)
    if binary is None and args.only != "kvsplice":
        print("llama-server not found (--llama-server, $LLAMA_SERVER, PATH, or ../shared/tools/build-llama-server.sh)")
        return 0
    gguf = gguf_path()
    prompts = Prompts(gguf, args.edit_length, tuple(args.edit_kinds.split(",")))
    print(cpu_line(), f"torch threads {torch.get_num_threads()}; load average before: {os.getloadavg()}", flush=True)
    runs = Path(args.out).parent
    runs.mkdir(parents=True, exist_ok=True)
    figures = {}
    if args.only != "llama":
        argv = [sys.executable, "-m", "kvsplice.cli", "serve", "--model", str(gguf), "--port", str(port := free_port()),
                *shlex.split(args.kvsplice_args)]
        print("kvsplice:", " ".join(argv[2:]), flush=True)
        with Server("kvsplice", argv, port, runs / "gemma3_kvsplice.log") as server:
            figures["kvsplice"] = measure(server, prompts, args, session=True)
    if args.only != "kvsplice":
        slot_ctx = args.edit_length + 512
        argv = [binary, "-m", str(gguf), "--port", str(port := free_port()), "-np", str(args.streams),
                "-c", str(args.streams * slot_ctx), "--cache-reuse", "16"]
        print("llama-server:", " ".join(argv), flush=True)
        with Server("llama", argv, port, runs / "gemma3_llama.log") as server:
            figures["llama"] = measure(server, prompts, args, session=False)
    print(f"load average after: {os.getloadavg()}")
    Path(args.out).write_text(json.dumps(figures, indent=1))
    if len(figures) == 2:
        print("\n".join(table(figures["kvsplice"], figures["llama"], args, prompts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
