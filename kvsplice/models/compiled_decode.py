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

Beside a prefill-lane job the runner keeps the eager step (`allow_compiled=False`): measured, it
was the faster one there (same section).

Graphs and compile time. Only the sizes that change between steps are symbolic (marked dynamic on
the scratch tensors the graphs are traced with): the row count, the context width (the mask's last
dimension), the pool's slot count and the arena's rows and capacity. Weights and model sizes stay
static, so the kernels are specialised to them. dynamo specialises a dimension of size 1, so one row
and 2..max_rows rows are two graphs, and the arena must hold at least two rows
(`DecodeArena(min_rows=2)`). Both graphs are compiled when this object is built, at the thread count decode steps run at
(`ThreadPolicy.compiled_step_counts`: dynamo guards torch's thread count, so graphs built at
another count, for example under `--decode-threads 1`, would refuse every step), on scratch tensors
(nothing of the engine's pool or arena is touched), so no request waits for a compile: minutes
the first time, much less once inductor's on-disk cache holds them (start-up times: the
docs/BENCHMARKS_HISTORY.md section above). Afterwards every call runs under `set_stance("fail_on_recompile")`: a step that no compiled graph covers raises before anything
runs, and runs eagerly instead (`fallbacks` counts them), so serving never stalls on a compile.

Numerics: the fused kernels keep fp32 intermediates that the eager bf16 ops round (for example
silu(gate) before the product), so results differ from the eager fast path by bf16 rounding, not
bit for bit. The tests bound the difference; on the default model it is the size of the engine's
own bf16 noise between batch compositions (docs/BENCHMARKS.md). Prefill never uses this step.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from kvsplice.layers.attention import length_mask
from kvsplice.layers.compiled_call import INDUCTOR_OPTIONS, GraphRefused, call_compiled
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


class CompiledDecode:
    """`decode_fn` (FastDecoder.arena_decode_hidden) compiled for 1 and for 2..`max_rows` rows.

    Construction compiles both graphs (blocking; see the module docstring) at each of
    `thread_counts` (the intra-op counts the steps will run at; default: the present one). `covers` says whether
    a step can use them; `__call__` takes decode_fn's arguments and returns its result, compiled
    where a graph covers the call, eager otherwise.
    """

    def __init__(self, decode_fn: DecodeFn, max_rows: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, thread_counts: tuple[int, ...] = ()):
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.eager = decode_fn
        self.max_rows = max_rows
        self.compiled_steps = 0   # calls a compiled graph ran
        self.fallbacks = 0        # calls no graph covered, run eagerly
        self._compiled = torch.compile(decode_fn, fullgraph=True,
                                       options={**INDUCTOR_OPTIONS, "guard_filter_fn": _skip_decoder_guards})
        for count in thread_counts or (torch.get_num_threads(),):   # the count is guarded: one set of graphs each
            with intra_op_threads(count):
                self._warm_up(num_layers, num_kv_heads, head_dim, dtype)

    def covers(self, count: int, width: int, arena_rows: int, capacity: int) -> bool:
        """True when a step of `count` arena rows with longest context `width`, in an arena of
        `arena_rows` rows of `capacity` positions, has a graph. The graphs were traced with
        2 <= width < capacity and at least two arena rows; the other cases (a size of 1, a context
        that exactly fills the capacity, about one step in 256) would each need a graph of their own."""
        return 1 <= count <= self.max_rows and 2 <= width < capacity and arena_rows >= 2

    def __call__(self, *args) -> torch.Tensor:
        try:
            hidden = call_compiled(self._compiled, *args)
        except GraphRefused as refused:   # nothing written yet
            if not self.fallbacks:
                _log.warning("compiled decode: a step no graph covers runs eagerly (counted in fallbacks): %s", refused)
            self.fallbacks += 1
            return self.eager(*args)
        self.compiled_steps += 1
        return hidden

    def _warm_up(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Compile both graphs on scratch tensors, with the dimensions that vary between steps
        marked dynamic. Their sizes are distinct and above 1 (dynamo specialises size 1 and
        merges symbols whose sizes are equal when it traces). The scratch pool and arena are
        normal tensors, as the KVPool's and DecodeArena's are, and the step's own tensors are made
        in inference mode, as the engine's steps make them (the guards check which kind each is)."""
        slots, arena_rows, capacity = 61, self.max_rows + 3, 37
        # laid out as KVPool and DecodeArena lay theirs out: K and V each one tensor of all layers
        pool_k, pool_v = (torch.zeros(num_layers, slots, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
        arena_k, arena_v = (torch.zeros(num_layers, arena_rows, num_kv_heads, capacity, head_dim, dtype=dtype)
                            for _ in range(2))
        for tensor in (pool_k, pool_v):
            torch._dynamo.mark_dynamic(tensor, 1)
        for tensor in (arena_k, arena_v):
            torch._dynamo.mark_dynamic(tensor, 1)
            torch._dynamo.mark_dynamic(tensor, 3)
        for count in ((1,) if self.max_rows == 1 else (1, 2)):
            with torch.inference_mode():
                lengths = torch.tensor([7 + row for row in range(count)])
                step = (torch.zeros(count, dtype=torch.int64), lengths - 1, torch.arange(count) + 5,
                        length_mask(lengths, 6 + count))   # the longest context, as the engine's masks
            torch._dynamo.mark_dynamic(step[3], 3)
            if count > 1:
                for tensor in step:
                    torch._dynamo.mark_dynamic(tensor, 0)
            with torch.inference_mode():
                self._compiled(*step, pool_k, pool_v, arena_k, arena_v)
