"""Facts about the machine read at run time: the CPU's flags."""

from __future__ import annotations


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The flags of the first CPU in `cpuinfo`; empty where it cannot be read."""
    try:
        with open(cpuinfo) as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()
