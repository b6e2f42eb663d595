"""A C source of kvsplice's (kvsplice/layers/csrc/) built for this machine once and loaded.

    csrc/<name>.c --$CC -O3 -march=native--> <directory>/<name>-<key>.so --ctypes--> CDLL

Why C: where a measured product has no torch kernel that reaches the machine's read bandwidth
(kvsplice.layers.block_int8_head says which and by how much). `-march=native` picks the code
path at build time from the CPU that runs it (each source has a plain C path beside its vector
ones), so nothing about the CPU is assumed. The key is a hash of what changes the library: the
source, the compiler and its version, the flags and the CPU's flags; a library is built once per
key and reused after, by every process (written under a temporary name, then renamed into place).
Where there is no C compiler, or the build or the load fails, `load_native` raises
NativeUnavailable with the reason and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from kvsplice.utils.machine import read_cpu_flags

SOURCES = Path(__file__).resolve().parent / "csrc"
C_COMPILERS = ("cc", "gcc", "clang")
# -ffp-contract=off: the plain C path must not fuse a multiply and an add the vector paths round
# apart (its bits equal theirs). -fopenmp: the library's parallel loops run on the OpenMP runtime
# torch loaded (the same soname, libgomp.so.1, so the loader hands back the loaded one): on torch's
# own threads
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120


class NativeUnavailable(Exception):
    """The library cannot be had here (no compiler, a failed build or load): the reason."""


def find_c_compiler() -> Optional[str]:
    """`$CC` where set, else the first of C_COMPILERS on the PATH; None when there is none."""
    configured = os.environ.get("CC")
    candidates = (configured,) if configured else C_COMPILERS
    return next((found for found in (shutil.which(name) for name in candidates) if found), None)


def default_directory() -> Path:
    """Where libraries go when the caller names no directory: the system's temporary directory."""
    return Path(tempfile.gettempdir()) / f"kvsplice-native-{os.getuid()}"


def load_native(name: str, directory: Optional[Path] = None, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """csrc/`name`.c built (once per key) into `directory` (default: `default_directory()`) with
    FLAGS + `extra_flags` and loaded. Raises NativeUnavailable. Side effects: creates the directory;
    a build runs the compiler for up to BUILD_TIMEOUT_S."""
    compiler = find_c_compiler()
    if compiler is None:
        raise NativeUnavailable(f"no C compiler ($CC, or {' / '.join(C_COMPILERS)} on the PATH)")
    source = SOURCES / f"{name}.c"
    flags = (*FLAGS, *extra_flags)
    library = (directory or default_directory()) / f"{name}-{_key(source, compiler, flags)}.so"
    if not library.exists():
        _build(compiler, source, flags, library)
    try:
        return ctypes.CDLL(str(library))
    except OSError as err:
        raise NativeUnavailable(f"{library} does not load: {err}") from err


def _key(source: Path, compiler: str, flags: tuple[str, ...]) -> str:
    """16 hex digits of what changes the library built from `source`."""
    digest = hashlib.sha256(source.read_bytes())
    for part in (compiler, _compiler_version(compiler), " ".join(flags), platform.machine(),
                 " ".join(sorted(read_cpu_flags()))):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def _compiler_version(compiler: str) -> str:
    """The compiler's `--version` first line; "" where it does not say."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.splitlines()[0] if done.stdout else ""


def _build(compiler: str, source: Path, flags: tuple[str, ...], library: Path) -> None:
    """Compile `source` to `library` (atomically: a temporary file renamed into place)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_name(f"{library.name}.{os.getpid()}.partial")
    command = [compiler, *flags, str(source), "-o", str(partial), "-lm"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NativeUnavailable(f"{' '.join(command)}: {err}") from err
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise NativeUnavailable(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    os.replace(partial, library)
