"""ThreadPolicy: how many intra-op threads (torch.set_num_threads) each step's forward gets.

A prefill step is compute-bound and scales with threads. A decode-only step on a small model is
mostly per-op latency and weight reads, and in a server every token it yields is then handled
by the HTTP event loop (detokenize, an SSE chunk, the socket write) while the next step runs. On
a machine with few cores those two compete: when the event loop takes a core from one of the
step's threads, every parallel op of the step waits at its barrier for the descheduled thread
(about a scheduler slice), so the step gets slower than with one thread fewer. Measured on 2
cores (docs/BENCHMARKS.md, "Decode threads in the server"): the streamed inter-token latency
of one request fell from 26-28 ms at 2 threads to 21 ms at 1.

So decode-only steps may run on `decode_threads` and every other step on `compute_threads`:

    step:        prefill chunk(s) ...      decode rows only      prefill + decode rows
    threads:     compute_threads           decode_threads        compute_threads
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
    Mutable only in `current` (the count last set, so unchanged steps cost no call)."""

    compute_threads: int
    decode_threads: Optional[int] = None
    current: Optional[int] = None

    @classmethod
    def from_config(cls, decode_threads: Optional[int]) -> "ThreadPolicy":
        """A policy around the process's present intra-op thread count."""
        compute = torch.get_num_threads()
        return cls(compute, None if decode_threads is None else min(decode_threads, compute))

    def threads_for(self, decode_only: bool) -> int:
        """Threads for a step that is (or is not) made of decode rows only."""
        if decode_only and self.decode_threads is not None:
            return self.decode_threads
        return self.compute_threads

    def apply(self, decode_only: bool) -> None:
        """Set torch's intra-op thread count for the next step. Side effect: process-wide
        (torch.set_num_threads); the engine thread is the only one running forwards."""
        wanted = self.threads_for(decode_only)
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
