"""The file-system operations the disk tier uses, as a small protocol with one real implementation.

The tier takes its file system from `DiskTierConfig.fs`, so tests can pass one that fails the
way a full or broken disk does (ENOSPC, EIO) without patching anything.

`LocalFileSystem.write_atomic` is the crash-safety rule of the tier: write a temporary name in the
same directory, fsync it, rename it over the final name, fsync the directory. After a crash (even
SIGKILL or power loss on a file system that honours fsync) the final name holds either nothing,
the old file, or the whole new file; a leftover temporary (".<name>.<random>.tmp") is removed at
the next start. A torn final file can still come from a file system that does not order these
steps; the entry's length and checksum catch it on load.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path
from typing import Iterable, Protocol

import numpy as np

TEMP_SUFFIX = ".tmp"


class TierFileSystem(Protocol):
    """What the tier needs from a file system. Every method may raise OSError."""

    def make_dirs(self, path: Path) -> None: ...
    def write_atomic(self, path: Path, chunks: Iterable[bytes | memoryview]) -> None: ...
    def read_file(self, path: Path) -> memoryview: ...
    def read_head(self, path: Path, num_bytes: int) -> bytes: ...
    def file_info(self, path: Path) -> tuple[int, float]: ...
    def list_dir(self, path: Path) -> list[str]: ...
    def remove(self, path: Path) -> None: ...
    def remove_dir(self, path: Path) -> None: ...
    def touch(self, path: Path) -> None: ...
    def lock_exclusive(self, path: Path) -> "DirLock": ...


class DirLock(Protocol):
    def release(self) -> None: ...


def temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


class LocalFileSystem:
    """The operating system's file system (POSIX semantics: rename replaces atomically)."""

    def make_dirs(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def write_atomic(self, path: Path, chunks: Iterable[bytes | memoryview]) -> None:
        temp = temp_name(path)
        try:
            with open(temp, "wb") as file:
                for chunk in chunks:
                    file.write(chunk)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        self._fsync_dir(path.parent)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        # the rename is only durable once the directory entry is on disk
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_file(self, path: Path) -> memoryview:
        """The whole file, in a fresh writable buffer (not zero-filled first: it is read over)."""
        with open(path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            view, filled = memoryview(np.empty(size, dtype=np.uint8)), 0
            while filled < size:
                count = file.readinto(view[filled:])
                if not count:
                    return view[:filled]        # shrank under us: the length check rejects it
                filled += count
        return view

    def read_head(self, path: Path, num_bytes: int) -> bytes:
        with open(path, "rb") as file:
            return file.read(num_bytes)

    def file_info(self, path: Path) -> tuple[int, float]:
        """(size in bytes, modification time)."""
        info = path.stat()
        return info.st_size, info.st_mtime

    def list_dir(self, path: Path) -> list[str]:
        return sorted(os.listdir(path))

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def remove_dir(self, path: Path) -> None:
        path.rmdir()

    def touch(self, path: Path) -> None:
        os.utime(path)

    def lock_exclusive(self, path: Path) -> "FileLock":
        """An exclusive lock on `path` (created if missing) for as long as this process holds it
        (the kernel drops it when the process dies, even by SIGKILL). Raises BlockingIOError when
        another holder has it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        return FileLock(fd)


class FileLock:
    """A held `flock`; `release` drops it."""

    def __init__(self, fd: int):
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)              # closing the descriptor drops the flock
            self._fd = None
