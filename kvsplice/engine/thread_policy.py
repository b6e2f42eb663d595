"""ThreadPolicy: how many intra-op threads (torch.set_num_threads) each step's forward gets.

A prefill step is compute-bound and scales with threads. A decode-only step on a small model is
mostly per-op latency and weight reads, and in a server every token it yields is then handled
by the HTTP event loop (detokenize, an SSE chunk, the socket write) while the next step runs. On
a machine with few cores those two compete: when the event loop takes a core from one of the
step's threads, every parallel op of the step waits at its barrier for the descheduled thread
(about a scheduler slice), so the step gets slower than with one thread fewer. Measured on 2
cores (docs/BENCHMARKS.md, "Decode threads in the server"): the streamed inter-token latency
of one request fell from 26-28 ms at 2 threads to 21 ms at 1.

So steps that carry decode rows may run on `decode_threads`, and prefill-only steps (nobody is
waiting for a token) on `compute_threads`. A step that mixes decode rows with other requests'
prefill chunks counts as a decoding step: its decode rows' tokens are streamed right after it, so
it competes with the event loop the same way. Measured on 2 cores with one request decoding while
four others prefill 2K-token prompts (the same server, alternately): mixed steps on 2 threads gave
that stream 77 / 104 ms p50 / p99 between tokens and the four prefills a median TTFT of 24.5 s;
on 1 thread 72 / 91 ms and 22.2 s (the loaded-ITL phase of benchmarks/vs_llamacpp.py, run once
per setting by a side script; the full benchmark moved from 101 to 92 ms p99 with this change).

    step:        prefill chunk(s) only     decode rows only      prefill + decode rows
    threads:     compute_threads           decode_threads        decode_threads
    lm_head:     compute_threads           compute_threads       compute_threads

The fast path's lm_head always gets every thread: one matmul bound by reading its 49,152 x 576
weight (on the default model), which a second thread speeds up, and a single op, so a thread
taken by the event loop costs it one wait, not one per op. Measured in the server on 2 cores
(alternating, twice): 17.0-17.3 ms between streamed tokens instead of 20.0-20.2 ms, 8 streams 186-188
instead of 163-170 tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def auto_decode_threads(compute_threads: int) -> int:
    """The server's default: one thread fewer than the other steps get, at least one (the
    event loop's core)."""
    return max(1, compute_threads - 1)


@dataclass
class ThreadPolicy:
    """Owned by the ModelRunner. `decode_threads` None: every step runs on `compute_threads`.
    Mutable only in `current` (the count last set, so unchanged steps cost no call) and
    `step_threads` (what the last step's layers ran on)."""

    compute_threads: int
    decode_threads: Optional[int] = None
    current: Optional[int] = None
    step_threads: Optional[int] = None

    @classmethod
    def from_config(cls, decode_threads: Optional[int]) -> "ThreadPolicy":
        """A policy around the process's present intra-op thread count."""
        compute = torch.get_num_threads()
        return cls(compute, None if decode_threads is None else min(decode_threads, compute))

    def threads_for(self, decoding: bool) -> int:
        """Threads for a step that carries decode rows (`decoding`) or prefill chunks only."""
        if decoding and self.decode_threads is not None:
            return self.decode_threads
        return self.compute_threads

    def apply(self, decoding: bool) -> None:
        """Set torch's intra-op thread count for the next step. Side effect: process-wide
        (torch.set_num_threads); the engine thread is the only one running forwards."""
        self.step_threads = self.threads_for(decoding)
        self._set(self.step_threads)

    def apply_head(self) -> None:
        """Every thread for the lm_head (see the module docstring). Side effect: process-wide."""
        self._set(self.compute_threads)

    def _set(self, wanted: int) -> None:
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
