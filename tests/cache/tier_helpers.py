"""Small identities, entries and a failing file system for the disk tier's tests."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import torch

from kvsplice.cache.disk_tier import DiskTier, DiskTierConfig
from kvsplice.cache.tier_format import EntryKey, TierEntry, TierIdentity, build_header, dtype_name
from kvsplice.cache.tier_fs import LocalFileSystem

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4


def identity(dtype: str = "float32", model: str = "tiny") -> TierIdentity:
    return TierIdentity(model=model, dtype=dtype, weight_format="dense", num_layers=LAYERS,
                        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def prefix_entry(namespace: str, token_ids: list[int], start_pos: int = 0,
                 dtype: torch.dtype = torch.float32, seed: int = 0,
                 states: dict[str, torch.Tensor] | None = None) -> TierEntry:
    """An exact entry holding random K/V for positions start_pos..len(token_ids)."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYERS, 2, len(token_ids) - start_pos, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    return TierEntry(EntryKey.for_prefix(namespace, token_ids), torch.tensor(token_ids, dtype=torch.int64),
                     start_pos, kv, states or {})


def session_entry(namespace: str, session_id: str, token_ids: list[int], seed: int = 0) -> TierEntry:
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYERS, 2, len(token_ids), KV_HEADS, HEAD_DIM, generator=generator)
    return TierEntry(EntryKey.for_session(namespace, session_id), torch.tensor(token_ids, dtype=torch.int64),
                     0, kv, exact=False, session_id=session_id)


def open_tier(directory: Path, budget_bytes: int = 10**8, ident: TierIdentity | None = None,
              **options) -> DiskTier:
    return DiskTier(DiskTierConfig(directory, budget_bytes, **options), ident or identity())


def entry_size(entry: TierEntry) -> int:
    """Bytes of the entry's file (what the budget counts)."""
    return build_header(entry, identity(dtype_name(entry.kv.dtype)))[1].file_size


class FailingFileSystem(LocalFileSystem):
    """A local file system whose writes fail with `error_number` while `failing` is set (a full
    disk: ENOSPC, a broken one: EIO), and whose reads of whole files fail while `failing_reads`."""

    def __init__(self, error_number: int = errno.ENOSPC):
        self.error_number = error_number
        self.failing = False
        self.failing_reads = False
        self.writes_attempted = 0

    def read_file(self, path):
        if self.failing_reads and path.suffix == ".kvt":
            raise OSError(errno.EIO, "simulated: EIO", str(path))
        return super().read_file(path)

    def write_atomic(self, path, chunks) -> None:
        self.writes_attempted += 1
        if self.failing:
            raise OSError(self.error_number, f"simulated: {errno.errorcode[self.error_number]}", str(path))
        super().write_atomic(path, chunks)


class BlockingFileSystem(LocalFileSystem):
    """A local file system whose writes wait until `release` is set (a slow disk)."""

    def __init__(self):
        self.release = threading.Event()

    def write_atomic(self, path, chunks) -> None:
        if path.suffix == ".kvt":
            self.release.wait(timeout=30)
        super().write_atomic(path, chunks)


class GatedReadFileSystem(LocalFileSystem):
    """A local file system whose reads of entry files wait until `release` is set (a slow disk):
    `entered` is set once a read is waiting, so a test knows the reader thread is inside one."""

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Event()

    def read_file(self, path):
        if path.suffix == ".kvt":
            self.entered.set()
            self.release.wait(timeout=60)
        return super().read_file(path)


def prompt_ids(n: int, seed: int, vocab: int = 300) -> list[int]:
    """`n` random token ids in [5, vocab), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=generator).tolist()
