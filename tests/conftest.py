"""Shared test fixtures (keep small)."""

import os

import pytest
import torch


@pytest.fixture
def torch_seed() -> int:
    """Seed torch's global RNG with 0 for a deterministic test; returns the seed."""
    torch.manual_seed(0)
    return 0


@pytest.fixture(scope="session", autouse=True)
def torch_threads():
    """Run the suite's torch on `KVSPLICE_TEST_THREADS` intra-op threads (default 1); restored after.

    On a shared machine torch's thread pool waits at every op for a sibling thread that is not
    scheduled: with the load at 9 on 2 cores one default-model fidelity case took 170-190 s on 2
    threads and 28-30 s on 1. One thread keeps the suite's time proportional to its work.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("KVSPLICE_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(threads)
