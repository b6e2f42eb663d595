"""Shared test fixtures (keep small), and the suite's hypothesis profiles.

Property tests run the same examples on every run by default (profile "ci": derandomized, no
example database, no per-example deadline), so a failure in CI reproduces anywhere and a busy
machine cannot fail a test by being slow. `HYPOTHESIS_PROFILE=dev` explores new random examples
on each run and keeps the failing ones in `.hypothesis/` for the next run.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# no deadline and no too_slow health check: on a shared 2-core machine one example can take
# seconds; pytest-timeout guards against hangs instead
BUSY_MACHINE = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, **BUSY_MACHINE)
settings.register_profile("dev", print_blob=True, **BUSY_MACHINE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_report_header(config):
    """Name the hypothesis profile in the session header (hypothesis itself does so only with -v)."""
    if config.option.verbose < 1:
        name, changed = settings.get_current_profile_name(), settings.default.show_changed()
        return f"hypothesis profile {name!r} -> {changed} (choose with HYPOTHESIS_PROFILE=ci|dev)"
    return None


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
