"""CompiledDecode: a FastDecoder decode step as one compiled call (`kvsplice serve --compile-decode`).

Why: a one-row decode step of the default model (30 layers) is about 3,700 eager aten calls. The
4-bit matmuls and SDPA are a fixed cost; the rest (norms, RoPE, residual adds, the gated MLP's
pointwise ops, the K/V writes and the views between them) is dispatch overhead. torch.compile
(inductor) fuses the pointwise ops into C++ loops and, with its C++ wrapper (`cpp_wrapper`), calls
every kernel from C++ rather than from Python. Measured faster than the eager step, in the engine
alone and served, for one stream and for 8 (docs/BENCHMARKS_HISTORY.md, "Against llama.cpp's
llama-server on the same GGUF").

What is compiled: `FastDecoder.arena_decode_hidden`, the forward of a batch that is DecodeArena rows
only, from plain tensors, up to the final norm (the lm_head and sampling stay eager). Batches with
prefill or non-arena rows, more rows than the packed kernels take (`max_rows`), a context of one
token, or a longest context that exactly fills the arena's capacity (about one step in 256) run
eagerly as before.

A model with sliding and full layers (Gemma 3) is compiled as well: its sliding layers write the
windowed pool's window slots and read the arena's rings, whose width W is fixed, so their mask is
always W wide and no graph specialises on a context shorter or longer than the window. Its GGUF
projections run on their int4 planes in the graph (a part without planes, Q6_K, multiplies its
plain bf16 copy: the prepacked one is opaque to tracing).

Beside a prefill-lane job the runner keeps the eager step (`allow_compiled=False`): measured, it
was the faster one there (same section).

Graphs and compile time. Only the sizes that change between steps are symbolic (marked dynamic on
the scratch tensors the graphs are traced with): the row count, the context width (the mask's last
dimension), the pool's slot count and the arena's rows and capacity. Weights and model sizes stay
static, so the kernels are specialised to them. dynamo specialises a dimension of size 1, so one row
and 2..max_rows rows are two graphs, and the arena must hold at least two rows
(`DecodeArena(min_rows=2)`). Both graphs are compiled by a builder (`InductorBuilder`) at the thread count decode steps run at
(`ThreadPolicy.compiled_step_counts`: dynamo guards torch's thread count, so graphs built at
another count, for example under `--decode-threads 1`, would refuse every step), on scratch tensors
(nothing of the engine's pool or arena is touched): minutes the first time, much less once
inductor's on-disk cache holds them (start-up times: docs/BENCHMARKS_HISTORY.md, "Figures formerly
quoted in code").

Background build. The build runs on a thread of its own that ends when it is done, started by
`start` (the server starts it once the engine is built and warmed up, so that the build does not
slow the start-up down); until then `covers` is False and every step runs eagerly. The compute thread
takes the built graphs itself, in `covers`, before a step decides its path, so a step runs wholly
eager or wholly compiled (the swap is between steps, never inside one), and nothing the build
touches is shared with a step but the model's weights, which both only read. The build thread sets
its own intra-op thread count; its OpenMP team ends with it (libgomp frees a thread's pool when the
thread exits), so the process does not keep more OpenMP threads than cores once it is done (see
kvsplice.engine.compute_thread). While it runs it takes CPU time and the GIL from the steps, which are
slower for that time, never refused. `wait` blocks until the build is done (the offline API and
`kvsplice pull --compile` wait; the server does not). A build that fails leaves the eager step:
the failure is logged once (`wait` raises it).

Switching in. Under `--compile-decode on` the built graphs are taken as they are. Under auto the
builder also hands back the inputs it compiled on (`BuiltDecode.trial_inputs`), and the compute
thread first times the eager step against the compiled one on them (`compile_choice.SpeedTrial`,
one call before each decode step, so that no step waits for the whole trial); each graph (one row;
2..max_rows rows) is switched in only where it measured faster by a margin, and the verdict is
logged once (`state` "measuring" meanwhile, then "active", or "eager" where neither graph won).

Afterwards every call runs under `set_stance("fail_on_recompile")`: a step that no compiled graph covers raises before anything
runs, and runs eagerly instead (`fallbacks` counts them), so serving never stalls on a compile.

Numerics: the fused kernels keep fp32 intermediates that the eager bf16 ops round (for example
silu(gate) before the product), so results differ from the eager fast path by bf16 rounding, not
bit for bit. The tests bound the difference; on the default model it is the size of the engine's
own bf16 noise between batch compositions (docs/BENCHMARKS.md). Prefill never uses this step.
"""


from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch

from kvsplice.layers.attention import length_mask
from kvsplice.layers.compiled_call import INDUCTOR_OPTIONS, GraphRefused, call_compiled
from kvsplice.models.compile_choice import SpeedTrial, TrialVerdict
from kvsplice.utils.thread_policy import intra_op_threads

_log = logging.getLogger(__name__)
DecodeFn = Callable[..., torch.Tensor]   # FastDecoder.arena_decode_hidden's signature


def _skip_decoder_guards(entries) -> list[bool]:
    """torch.compile's `guard_filter_fn`: keep every guard but those on the decoder's own
    attributes (named "self..."): its weights, their formats and the layers' structure, which
    nothing changes once the FastDecoder is built. Of the about 1,570 guards a graph had (when it
    took per-layer K/V views), 303 tensor matches and most of the constant, type and attribute checks are such; evaluating them before
    every call was a measurable share of a one-row step (docs/BENCHMARKS_HISTORY.md, "Against
    llama.cpp's llama-server on the same GGUF"). Guards on the step's inputs
    (sizes, strides, dtypes, which of them share storage) and on globals stay: they are what
    refuses a step no graph covers."""
    return [not entry.name.startswith("self.") for entry in entries]


@dataclass(frozen=True)
class GraphSpec:
    """What a builder compiles: the decode step for 1 and 2..`max_rows` rows of a model of
    `num_layers` layers over the pool and arena (and `ring_layers` more over a windowed pool's
    window slots and arena rings of `ring_width` columns), `num_kv_heads` K/V heads of `head_dim`
    in `dtype`, at each of `thread_counts`."""

    max_rows: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    thread_counts: tuple[int, ...]
    ring_layers: int = 0
    ring_width: Optional[int] = None


@dataclass(frozen=True)
class BuiltDecode:
    """A builder's result: the compiled step (decode_fn's signature);
    `trial_inputs`: where the switch is to be measured first (auto), decode_fn's arguments for each
    graph, one row first (what the graphs were compiled on), else empty."""

    step: DecodeFn
    trial_inputs: tuple[tuple[torch.Tensor, ...], ...] = ()


class DecodeBuilder(Protocol):
    """Builds the graphs of `spec` for `decode_fn` (blocking; called on the build thread)."""

    def build(self, decode_fn: DecodeFn, spec: GraphSpec) -> BuiltDecode: ...


class InductorBuilder:
    """torch.compile (inductor, C++ wrapper) of the step, compiled by running it on scratch
    tensors. `cache_dir`: inductor's on-disk cache for them (TORCHINDUCTOR_CACHE_DIR,
    set for the process unless it names a directory of the user's own); None: inductor's default.
    `measure`: hand the scratch inputs back, so that the switch is measured first (auto)."""

    def __init__(self, cache_dir: Optional[Path] = None, measure: bool = False):
        self.cache_dir = cache_dir
        self.measure = measure

    def build(self, decode_fn: DecodeFn, spec: GraphSpec) -> BuiltDecode:
        self._use_cache_dir()
        compiled = torch.compile(decode_fn, fullgraph=True,
                                 options={**INDUCTOR_OPTIONS, "guard_filter_fn": _skip_decoder_guards})
        inputs = ()
        for count in spec.thread_counts or (torch.get_num_threads(),):   # the count is guarded: one set each
            with intra_op_threads(count):
                inputs = _warm_up(compiled, spec)
        return BuiltDecode(compiled, inputs if self.measure else ())

    def _use_cache_dir(self) -> None:
        from torch._inductor import config
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        from torch._inductor.utils import clear_caches

        config.fx_graph_cache = True
        if self.cache_dir is None:
            return
        present = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if present is not None and os.path.abspath(present) != default_cache_dir():
            _log.info("compiled decode: inductor's cache is the user's TORCHINDUCTOR_CACHE_DIR=%s", present)
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)
        clear_caches()   # directories inductor derived from an earlier value


def _warm_up(compiled: DecodeFn, spec: GraphSpec) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Compile both graphs on scratch tensors, with the dimensions that vary between steps
    marked dynamic, and return each graph's inputs (one row first). Their sizes are distinct and above 1 (dynamo specialises size 1 and
    merges symbols whose sizes are equal when it traces). The scratch pool and arena are
    normal tensors, as the KVPool's and DecodeArena's are, and the step's own tensors are made
    in inference mode, as the engine's steps make them (the guards check which kind each is)."""
    slots, arena_rows, capacity = 61, spec.max_rows + 3, 37
    # laid out as KVPool and DecodeArena lay theirs out: K and V each one tensor of all layers
    heads, dim = spec.num_kv_heads, spec.head_dim
    pool_k, pool_v = _scratch(spec.dtype, (spec.num_layers, slots, heads, dim), dynamic=(1,))
    arena_k, arena_v = _scratch(spec.dtype, (spec.num_layers, arena_rows, heads, capacity, dim), dynamic=(1, 3))
    rings = ()
    if spec.ring_layers:   # a windowed pool's window slots, the arena's rings (their width W static)
        rings = (*_scratch(spec.dtype, (spec.ring_layers, 53, heads, dim), dynamic=(1,)),
                 *_scratch(spec.dtype, (spec.ring_layers, arena_rows, heads, spec.ring_width, dim), dynamic=(1,)))
    inputs = []
    for count in ((1,) if spec.max_rows == 1 else (1, 2)):
        step = _scratch_step(count, spec.ring_width if rings else None)
        with torch.inference_mode():
            compiled(*step[:4], pool_k, pool_v, arena_k, arena_v, *step[4:], *rings)
        inputs.append((*step[:4], pool_k, pool_v, arena_k, arena_v, *step[4:], *rings))
    return tuple(inputs)


def _scratch(dtype: torch.dtype, sizes: tuple[int, ...], dynamic: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero K and V scratch tensors of `sizes`, their `dynamic` dimensions marked as such."""
    pair = tuple(torch.zeros(sizes, dtype=dtype) for _ in range(2))
    for tensor in pair:
        for dim in dynamic:
            torch._dynamo.mark_dynamic(tensor, dim)
    return pair


def _scratch_step(count: int, ring_width: Optional[int]) -> tuple[torch.Tensor, ...]:
    """A step's own tensors for `count` rows: ids, positions, out slots, the length mask (the
    longest context as wide as the engine's masks), and with a `ring_width` the window slots and
    the ring mask (as wide as the rings: static)."""
    with torch.inference_mode():
        lengths = torch.tensor([7 + row for row in range(count)])
        step = (torch.zeros(count, dtype=torch.int64), lengths - 1, torch.arange(count) + 5,
                length_mask(lengths, 6 + count))
        if ring_width is not None:
            step += (torch.arange(count) + 9, length_mask(lengths.clamp(max=ring_width), ring_width))
    torch._dynamo.mark_dynamic(step[3], 3)
    if count > 1:
        for tensor in step:
            torch._dynamo.mark_dynamic(tensor, 0)
    return step


# The interpreter's thread switch interval while the graphs build (below Python's default).
# Tracing is Python that holds the GIL, and every eager step's torch call gives the GIL up and waits
# for it back: at the default a step of a few hundred calls waited seconds
# (docs/BENCHMARKS_HISTORY.md, "Decode steps while the compiled graphs build").
BUILD_SWITCH_INTERVAL_S = 1e-4


class CompiledDecode:
    """`decode_fn` (FastDecoder.arena_decode_hidden) compiled by `builder` for 1 and for
    2..`spec.max_rows` rows, built on a thread of its own once `start` (or `wait`) is called (see
    the module docstring). `covers` says whether a step can use the graphs (False until they are built);
    `__call__` takes decode_fn's arguments and returns its result, compiled where a graph covers
    the call, eager otherwise. `state`: "building", "measuring" (auto's speed trial), "active" (a graph serves), "eager"
    (the trial kept the eager step for every graph) or "failed" (`error` then says why).
    `verdict`: the trial's, once it is done (None without one)."""

    def __init__(self, decode_fn: DecodeFn, spec: GraphSpec, builder: Optional[DecodeBuilder] = None):
        if spec.max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {spec.max_rows}")
        self.eager = decode_fn
        self.max_rows = spec.max_rows
        self.compiled_steps = 0   # calls a compiled graph ran
        self.fallbacks = 0        # calls no graph covered, run eagerly
        self.error: Optional[BaseException] = None
        self.build_s: Optional[float] = None
        self.verdict: Optional[TrialVerdict] = None
        self._built: Optional[BuiltDecode] = None   # taken by the compute thread (`_take`)
        self._use = (True, True)                    # the one-row graph, the 2..max_rows graph
        self._trial: Optional[SpeedTrial] = None
        self._thread_counts = spec.thread_counts
        self._started = time.perf_counter()
        self.future: concurrent.futures.Future[BuiltDecode] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._build, args=(builder or InductorBuilder(), spec),
                                        name="kvsplice-compile", daemon=True)
        self._start_lock = threading.Lock()

    def start(self) -> None:
        """Start the build thread (once; later calls do nothing)."""
        with self._start_lock:
            if self._thread.ident is None:
                self._started = time.perf_counter()
                self._thread.start()

    @property
    def state(self) -> str:
        if self._built is not None:
            return "active" if any(self._use) else "eager"
        if self._trial is not None:
            return "measuring"
        return "failed" if self.future.done() and self.future.exception() is not None else "building"

    def wait(self, timeout: Optional[float] = None) -> None:
        """Start the build if it is not yet, block until it is done and take its graphs (after the
        whole speed trial, where there is one: call it on the thread that steps the engine);
        raises what the build raised."""
        self.start()
        self.future.result(timeout)
        while not self._take():
            pass

    def covers(self, count: int, width: int, arena_rows: int, capacity: int) -> bool:
        """True when the graphs are built and a step of `count` arena rows with longest context
        `width`, in an arena of `arena_rows` rows of `capacity` positions, has one. The graphs
        were traced with 2 <= width < capacity and at least two arena rows; the other cases (a size
        of 1, a context that exactly fills the capacity, about one step in 256) would each need a
        graph of their own. Called by the compute thread before a step: that is where the built
        graphs are taken."""
        if self._built is None and not self._take():
            return False
        return (1 <= count <= self.max_rows and 2 <= width < capacity and arena_rows >= 2
                and self._use[0 if count == 1 else 1])

    def __call__(self, *args) -> torch.Tensor:
        if self._built is None:
            return self.eager(*args)
        try:
            hidden = call_compiled(self._built.step, *args)
        except GraphRefused as refused:   # nothing written yet
            if not self.fallbacks:
                _log.warning("compiled decode: a step no graph covers runs eagerly (counted in fallbacks): %s", refused)
            self.fallbacks += 1
            return self.eager(*args)
        self.compiled_steps += 1
        return hidden

    def _take(self) -> bool:
        """Install the built graphs once they are there (on the calling thread, between steps),
        where there is a speed trial once it is done: each call runs one more of its calls."""
        if self._built is not None:
            return True
        if not self.future.done() or self.future.exception() is not None:
            return False
        built = self.future.result()
        if built.trial_inputs and not self._measured(built):
            return False
        self._built = built
        _log.info("compiled decode: %s, %.1f s after the build started", self.state, time.perf_counter() - self._started)
        return True

    def _measured(self, built: BuiltDecode) -> bool:
        """Run the next call of the speed trial on `built.trial_inputs`; True once it is done
        (`_use` and `verdict` then hold its verdict, logged once)."""
        if self._trial is None:
            labels = ("1 row", f"2-{self.max_rows} rows")[:len(built.trial_inputs)]
            self._trial = SpeedTrial(self.eager, lambda *args: call_compiled(built.step, *args),
                                     built.trial_inputs, labels)
        counts = self._thread_counts
        threads = torch.get_num_threads() if not counts or torch.get_num_threads() in counts else counts[0]
        try:
            with torch.inference_mode(), intra_op_threads(threads):   # as the graphs were built
                self._trial.step()
        except Exception as exc:  # noqa: BLE001 -- a trial that cannot run leaves the eager step serving
            self.verdict = TrialVerdict((False,) * len(built.trial_inputs),
                                        f"the eager step stays: the speed trial failed: {type(exc).__name__}: {exc}")
        else:
            if not self._trial.done:
                return False
            self.verdict = self._trial.verdict()
        use = self.verdict.use_compiled
        self._use = (use[0], use[-1])   # one graph only where max_rows is 1: no step has more rows
        _log.info("compiled decode: %s", self.verdict.reason)
        return True

    def _build_yielding(self, builder: DecodeBuilder, spec: GraphSpec) -> BuiltDecode:
        """`builder.build` with the interpreter's switch interval at BUILD_SWITCH_INTERVAL_S, so that
        the engine thread gets the GIL back soon after each torch call. Side effect: the interval is
        process-wide; it is set back to what it was before this returns or raises."""
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(BUILD_SWITCH_INTERVAL_S)
        try:
            return builder.build(self.eager, spec)
        finally:
            sys.setswitchinterval(switch_interval)

    def _build(self, builder: DecodeBuilder, spec: GraphSpec) -> None:
        """The build thread: build, log the time it took (or why it failed), hand the result over.
        It keeps the default CPU priority: at a lower one it was descheduled while holding the GIL
        that every step needs (measured on 2 cores busy with other work: a 64-token reply during the
        build took 44 s at nice 19, 12 s at the default priority)."""
        try:
            built = self._build_yielding(builder, spec)
        except BaseException as exc:  # noqa: BLE001 -- the eager step serves; said once here
            self.error = exc
            _log.warning("compiled decode: the build failed, decode steps stay eager: %s: %s",
                         type(exc).__name__, exc)
            self.future.set_exception(exc)
            return
        self.build_s = time.perf_counter() - self._started
        _log.info("compiled decode: graphs built in %.1f s; the next decode step switches to them", self.build_s)
        self.future.set_result(built)
