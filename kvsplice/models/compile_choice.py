"""Whether `--compile-decode auto` compiles the decode step, and where inductor keeps what it built.

The choice (`choose_compile_decode`) is a pure function of facts checked at start: the CPU's flags
(/proc/cpuinfo), whether a C++ compiler is on the PATH, the projections' weight format and the
activations' dtype, and whether the model runs on the fast path (attention-only, with the
DecodeArena). auto compiles only where the compiled step was measured faster: bf16 activations on a
CPU with native bf16 (avx512_bf16 or amx_bf16), int4 / int8 projections or a GGUF's blocks (the
packed kernels and int4 planes that inductor can trace), a C++ compiler for inductor's C++ wrapper, an attention-only model on the
fast path (docs/BENCHMARKS_HISTORY.md, "Against llama.cpp's llama-server on the same GGUF"). Anything else
is never assumed: auto stays eager and says why.

Where the facts allow it, auto still does not assume the compiled step is faster on this machine:
once its graphs are built, `SpeedTrial` times the eager and the compiled step against each other
on the live model (the graphs' warm-up inputs, calls alternated, on the thread that runs the
engine's steps), and each graph is switched in only where it is faster than eager by
SWITCH_MARGIN; where it is not, the eager step stays and the log says why, once.

The compile cache (`compile_cache_dir`) is one directory per key under kvsplice's cache
(`~/.cache/kvsplice/inductor/<key>`), the key a hash of what invalidates the graphs: torch's
version, the model's identity (its name and configuration), the graphs' shapes and
formats, the thread counts they are built at, and the CPU (torch's capability and its flags).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MODES = ("auto", "on", "off")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# the flags that change the kernels inductor generates (its vector ISA) or the choice above
KEY_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")
COMPILERS = ("g++", "c++", "clang++")
TRIAL_CALLS = 5        # timed calls of each step on each graph's inputs (after one untimed round)
SWITCH_MARGIN = 0.05   # a compiled graph is switched in only where its median is this much below eager's


@dataclass(frozen=True)
class CompileChoice:
    """Whether to compile the decode step, and why (logged once at start)."""

    enabled: bool
    reason: str


def choose_compile_decode(mode: str, cpu_flags: frozenset[str], compiler: str | None, weight_format: str,
                          dtype: str, fast_path: str | None) -> CompileChoice:
    """The decision for `mode` ("auto" | "on" | "off"). `cpu_flags`: the CPU's flags (/proc/cpuinfo);
    `compiler`: the C++ compiler found, or None; `weight_format`: the projections' format ("dense",
    "int8", "int4", "gguf"); `dtype`: the activations' ("bfloat16", ...); `fast_path`: None where the model runs
    on the fast path with the DecodeArena, else why not. "on" and "off" are taken as they are (on
    where it cannot work raises later, naming what is missing); auto compiles only where every fact
    says it is faster. ValueError for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"compile_decode must be one of {MODES}, got {mode!r}")
    if mode != "auto":
        return CompileChoice(mode == "on", f"--compile-decode {mode}")
    missing = []
    if not cpu_flags & NATIVE_BF16_FLAGS:
        missing.append("the CPU has no native bf16 (avx512_bf16 / amx_bf16)")
    if dtype != "bfloat16":
        missing.append(f"activations are {dtype}, not bfloat16")
    if weight_format not in ("int4", "int8", "gguf"):
        missing.append(f"the projections are {weight_format}, not int4 / int8 / GGUF blocks")
    if fast_path is not None:
        missing.append(fast_path)
    if compiler is None:
        missing.append(f"no C++ compiler ({' / '.join(COMPILERS)}) on the PATH")
    if missing:
        return CompileChoice(False, "auto: eager, because " + "; ".join(missing))
    return CompileChoice(True, f"auto: compiled ({'amx_bf16' if 'amx_bf16' in cpu_flags else 'avx512_bf16'}, "
                               f"{weight_format} projections, {compiler})")


def find_cpp_compiler() -> str | None:
    """The C++ compiler inductor would call: `$CXX` where set, else the first of COMPILERS on the
    PATH; None when there is none."""
    configured = os.environ.get("CXX")
    candidates = (configured,) if configured else COMPILERS
    return next((found for found in (shutil.which(name) for name in candidates) if found), None)


def compile_cache_key(torch_version: str, model: tuple[str, ...], shapes: dict, cpu: tuple[str, ...]) -> str:
    """16 hex digits of a hash of every input; any change gives another key."""
    text = json.dumps([torch_version, list(model), shapes, list(cpu)], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_identity(name: str, hf_config: dict) -> tuple[str, ...]:
    """The model's name and a hash of its configuration (config.json): the graphs depend on the
    architecture and the weights' shapes, not on their values (weights are inputs of the graphs),
    so a copy of the model elsewhere shares them and a changed configuration does not."""
    text = json.dumps(hf_config, sort_keys=True, default=str)
    return name, hashlib.sha256(text.encode()).hexdigest()[:16]


def cpu_identity(capability: str, flags: frozenset[str]) -> tuple[str, ...]:
    """torch's CPU capability and the KEY_FLAGS the CPU has."""
    return (capability, *sorted(flag for flag in KEY_FLAGS if flag in flags))


def compile_cache_dir(root: Path, key: str) -> Path:
    """`root/inductor/<key>` (not created here)."""
    return root / "inductor" / key


@dataclass(frozen=True)
class TrialVerdict:
    """What a SpeedTrial measured: per graph, whether the compiled step serves, and the line that
    says why (logged once)."""

    use_compiled: tuple[bool, ...]
    reason: str


class SpeedTrial:
    """The eager step against the compiled one, one call at a time, on each graph's `inputs`
    (`labels` name them in the verdict). Calls alternate between the two steps, in an order that
    flips every round, so that load from elsewhere on the machine falls on both alike; the first
    round is not timed (first calls). `step` runs the next call (the caller spreads them over
    engine steps, so that no step waits for the whole trial); `verdict` once `done`. A compiled
    call that raises (a graph that refuses its own inputs, for one) leaves that graph eager."""

    def __init__(self, eager: Callable, compiled: Callable, inputs: Sequence[tuple], labels: Sequence[str],
                 calls: int = TRIAL_CALLS, margin: float = SWITCH_MARGIN, clock: Callable[[], float] = time.perf_counter):
        if len(inputs) != len(labels) or not inputs or calls < 1:
            raise ValueError("a speed trial needs one label per input and at least one call")
        self.steps = {"eager": eager, "compiled": compiled}
        self.inputs, self.labels, self.margin, self.clock = tuple(inputs), tuple(labels), margin, clock
        self.times: dict[tuple[int, str], list[float]] = {(graph, name): [] for graph in range(len(inputs))
                                                           for name in self.steps}
        self.failed: dict[int, str] = {}
        order = ("eager", "compiled")
        self._pending = [(round_, graph, name) for round_ in range(calls + 1) for graph in range(len(inputs))
                         for name in (order if round_ % 2 else order[::-1])]

    @property
    def done(self) -> bool:
        return not self._pending

    def step(self) -> None:
        """Run and time the next call (nothing once done)."""
        if not self._pending:
            return
        round_, graph, name = self._pending.pop(0)
        if graph in self.failed:
            return
        started = self.clock()
        try:
            self.steps[name](*self.inputs[graph])
        except Exception as exc:  # noqa: BLE001 -- only a compiled call can fail here; eager is the reference
            if name == "eager":
                raise
            self.failed[graph] = f"{type(exc).__name__}: {exc}"
            return
        if round_:
            self.times[(graph, name)].append(self.clock() - started)

    def verdict(self) -> TrialVerdict:
        """Per graph: compiled where its median call time is below (1 - margin) x eager's."""
        use, parts = [], []
        for graph, label in enumerate(self.labels):
            if graph in self.failed:
                use.append(False)
                parts.append(f"{label}: eager (the compiled call failed: {self.failed[graph]})")
                continue
            eager, compiled = (statistics.median(self.times[(graph, name)]) for name in ("eager", "compiled"))
            faster = compiled < (1 - self.margin) * eager
            use.append(faster)
            parts.append(f"{label}: compiled {compiled * 1e3:.1f} ms against eager {eager * 1e3:.1f} ms "
                         f"({compiled / eager:.2f}x): {'compiled' if faster else 'eager'}")
        head = ("the compiled step serves" if all(use) else
                f"the eager step stays (not {self.margin:.0%} faster)" if not any(use) else
                "the compiled step serves where it is faster")
        return TrialVerdict(tuple(use), f"{head}; measured on the live model: " + "; ".join(parts))
