"""ThreadPolicy: how many intra-op threads (torch.set_num_threads) each step's forward gets.

By default every step runs on every thread (`compute_threads`). `--decode-threads N` puts steps
that carry decode rows (alone, or next to other requests' prefill chunks, whose decode rows'
tokens are streamed right after the step) on N threads instead, and leaves prefill-only steps on
all of them: on a machine where the HTTP side or another process needs a core while tokens
stream, a step whose parallel ops wait at their barriers for a descheduled thread gets slower
than one with a thread fewer.

    step:        prefill chunk(s) only     decode rows only      prefill + decode rows
    threads:     compute_threads           decode_threads        decode_threads
    lm_head:     compute_threads           compute_threads       compute_threads

While a prefill-lane job runs on its own thread (kvsplice.engine.prefill_lane, `lane_threads`),
the engine thread's steps, lm_head included, take at most `compute_threads - lane_threads`, so the
two together never ask for more threads than the process has.

On 2 cores serving the default model, with the engine stepped on the thread that
loaded it (kvsplice.engine.compute_thread), every thread is the faster setting, for one stream and
for 8 (benchmarks/decode_threads.py; docs/BENCHMARKS.md, "Decode threads in the server"). (An
earlier measurement that favoured one thread fewer had the engine stepped on a second thread, where
libgomp no longer lets its workers spin; the event loop's own cost per token is in
docs/BENCHMARKS_HISTORY.md, "Decode threads in the server".)

The fast path's lm_head always gets every thread: one matmul bound by reading its 49,152 x 576
weight (on the default model), which a second thread speeds up, and a single op, so a thread
taken by another process costs it one wait, not one per op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside the block and restored after. Side
    effect: on the calling thread. Compiled graphs are built under it at every count they will run
    at: dynamo guards the count (its GLOBAL_STATE guard), so a graph traced at another count would
    refuse every call."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class ThreadPolicy:
    """Owned by the ModelRunner. `decode_threads` None: every step runs on `compute_threads`.
    `lane_threads`: what a running prefill-lane job takes (kvsplice.engine.prefill_lane); a step
    beside it gets at most `compute_threads - lane_threads`, its lm_head included. Mutable only in
    `current` (the count last set, so unchanged steps cost no call), `step_threads` (what the last
    step's layers ran on) and `head_threads` (what its lm_head gets)."""

    compute_threads: int
    decode_threads: Optional[int] = None
    lane_threads: int = 0
    current: Optional[int] = None
    step_threads: Optional[int] = None
    head_threads: Optional[int] = None

    @classmethod
    def from_config(cls, decode_threads: Optional[int], lane_threads: int = 0) -> "ThreadPolicy":
        """A policy around the calling thread's present intra-op thread count."""
        compute = torch.get_num_threads()
        return cls(compute, None if decode_threads is None else min(decode_threads, compute), lane_threads)

    def threads_for(self, decoding: bool, beside_lane: bool = False) -> int:
        """Threads for a step that carries decode rows (`decoding`) or prefill chunks only, while
        a prefill-lane job runs (`beside_lane`) or not."""
        threads = self.compute_threads
        if decoding and self.decode_threads is not None:
            threads = self.decode_threads
        if beside_lane:
            threads = min(threads, max(1, self.compute_threads - self.lane_threads))
        return threads

    def compiled_step_counts(self) -> tuple[int, ...]:
        """The thread counts of a decode-only step away from a lane job (where a compiled decode
        step runs; beside a lane job the runner keeps the eager step)."""
        return (self.threads_for(decoding=True),)

    def apply(self, decoding: bool, beside_lane: bool = False) -> None:
        """Set torch's intra-op thread count for the next step. Side effect: on the calling
        thread (torch.set_num_threads sets OpenMP's per-thread count), the engine thread."""
        self.step_threads = self.threads_for(decoding, beside_lane)
        self.head_threads = self.threads_for(False, beside_lane)
        self._set(self.step_threads)

    def apply_head(self) -> None:
        """The lm_head's threads (see the module docstring): every thread, or every one the
        lane leaves. Side effect: on the calling thread."""
        self._set(self.head_threads or self.compute_threads)

    def _set(self, wanted: int) -> None:
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
