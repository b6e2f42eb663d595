"""The machine line every benchmark prints with its figures: CPU model, cores and the SIMD flags
that decide which kernels run (the CPU can change between runs, so each figure names it)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# AVX2 / AVX-512 for fp32 and int kernels, VNNI and AMX-INT8 for int8, AVX512-BF16 / AMX for bf16
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")


def cpu_line(cpuinfo: str = "/proc/cpuinfo") -> str:
    """"<model>, <n> CPU cores, flags: <the KERNEL_FLAGS it has>"; the platform's processor name and
    "flags: unknown" where `cpuinfo` cannot be read."""
    model, flags = platform.processor() or platform.machine(), None
    try:
        lines = Path(cpuinfo).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
            model = value.strip()
        elif key.strip() == "flags" and flags is None:
            flags = set(value.split())
    shown = [flag for flag in KERNEL_FLAGS if flag in (flags or ())]
    return f"{model}, {os.cpu_count()} CPU cores, flags: {' '.join(shown) if flags is not None else 'unknown'}"
