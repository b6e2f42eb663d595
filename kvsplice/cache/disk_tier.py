"""DiskTier: K/V the pool evicts, kept on disk within a byte budget, loaded back instead of prefilled.

What it holds: `TierEntry`s (a run of tokens' K/V in every layer, optional recurrent-state
checkpoints), keyed by `EntryKey(namespace, content)`; the format is `kvsplice.cache.tier_format`.

Guarantees:

- never a wrong token: a load returns an entry only if its checksum, model identity, namespace,
  key and token ids all check out; anything else is a miss (the caller recomputes), and a bad file
  is removed and counted. An approximate (relocated) entry is returned only to its own session.
- tenancy: the namespace is part of the key and of the path, and every entry names its namespace in
  full; a lookup in one namespace never returns another's entry. `namespace_share` caps what one
  namespace holds, so a tenant's flood evicts its own entries first.
- budget: the bytes of stored files plus the bytes of writes in flight never exceed
  `budget_bytes` (a put reserves its file's size, evicting least-recently-used entries first; the
  single writer deletes a put's victims before writing it, so the disk never holds more).
- restarts and SIGKILL: files are written atomically (`tier_fs`); at start the index is rebuilt from
  the directory when its header names the same model identity (leftover temporaries removed,
  torn or corrupt files dropped and counted), and old entries are discarded, counted and logged,
  never loaded, when it does not.
- one tier per directory: a second one (another server on the same DIR) fails at start, since
  each would count only its own files against the budget; the lock dies with its process.
- off the step loop: `put` returns at once (the bounded writer queue drops and counts when full),
  `prefetch` starts a read on the reader thread and `get` waits for it; I/O errors (ENOSPC, EIO)
  are counted and logged, never raised into the caller. Only misuse raises (a malformed entry).

Clock: LRU order is the order of puts and hits in this process; across a restart it is the files'
modification times (a hit touches its file).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

import torch

from kvsplice.cache.kv_pool import KVPool
from kvsplice.cache.tier_format import (ENTRY_SUFFIX, CorruptEntryError, EntryHeader, EntryKey,
                                        PrefixHasher, TierEntry, TierIdentity, build_header, checksum,
                                        decode_entry, encode_payload, header_bytes_needed, namespace_dir,
                                        parse_header)
from kvsplice.cache.tier_fs import LocalFileSystem, TierFileSystem, is_temp_name

logger = logging.getLogger(__name__)

HEADER_FILE = "tier.json"
LOCK_FILE = "tier.lock"
ENTRIES_DIR = "entries"
HEAD_READ_BYTES = 4096


class DiskTierError(RuntimeError):
    """The tier cannot start (its directory cannot be created or written)."""


@dataclass(frozen=True)
class DiskTierConfig:
    """How the disk tier runs (`kvsplice serve --kv-disk-dir DIR --kv-disk-gb N`).

    dir: the tier's own directory (created if missing; entries of another model are discarded).
    budget_bytes: the most its files (and writes in flight) take.
    namespace_share: the most one namespace may hold, as a share of the budget (1.0 = no cap).
    write_queue_size: puts waiting for the writer; a put beyond it is dropped.
    max_queued_bytes: bytes of puts waiting for the writer (they are held in memory until written).
    max_prefetches: reads started by `prefetch` and not yet collected by `get`.
    fs: the file system (a test passes one that fails).
    """

    dir: Path
    budget_bytes: int
    namespace_share: float = 1.0
    write_queue_size: int = 16
    max_queued_bytes: int = 1 << 30
    max_prefetches: int = 8
    fs: TierFileSystem = field(default_factory=LocalFileSystem, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "dir", Path(self.dir))
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {self.budget_bytes}")
        if not 0.0 < self.namespace_share <= 1.0:
            raise ValueError(f"namespace_share must be in (0, 1], got {self.namespace_share}")
        for name in ("write_queue_size", "max_queued_bytes", "max_prefetches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @staticmethod
    def from_gb(dir: str | Path, gb: float, **options) -> "DiskTierConfig":
        """The CLI's form: a budget in GB (10**9 bytes)."""
        return DiskTierConfig(Path(dir), int(gb * 1e9), **options)

    @property
    def namespace_cap_bytes(self) -> int:
        return int(self.budget_bytes * self.namespace_share)


@dataclass(frozen=True)
class TierStats:
    """Counters for /metrics (totals since start, plus the current size)."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    load_seconds: float = 0.0           # summed over `loads` (mean latency = load_seconds / loads)
    writes: int = 0
    write_errors: int = 0
    read_errors: int = 0
    dropped_queue_full: int = 0
    dropped_over_budget: int = 0
    evictions: int = 0
    corrupt_dropped: int = 0
    temp_files_removed: int = 0
    ignored_at_start: int = 0           # entries of another model identity, discarded unloaded
    bytes_used: int = 0                 # stored files + writes in flight (what the budget bounds)
    entries: int = 0

    def as_metrics(self, prefix: str = "kvsplice_kv_disk_") -> dict[str, float]:
        return {prefix + f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class TierMatch:
    """Result of `DiskTier.match_prefix`: stored entries that cover a query from a position on.

    `keys[i]` holds K/V from `starts[i]` to `ends[i]`; the chain is gapless (`starts[0]` <= the
    query's start, `starts[i+1] <= ends[i]`, ends increasing), so entry i serves positions
    `max(starts[i], previous end)..ends[i]` and the whole covers up to `length` (the query's start
    when `keys` is empty). Loading them (`get`) can still miss (a file may have gone bad): the
    caller then recomputes from the first miss on."""

    keys: tuple[EntryKey, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    length: int


@dataclass
class _WriteJob:
    entry: TierEntry
    head: bytes
    header: EntryHeader
    victims: list[Path]
    generation: tuple[int, int]


class _Stop:
    """Tells the writer thread to end (queued after every job already waiting)."""


class DiskTier:
    """The tier over one directory. Thread-safe: any thread may call any method."""

    def __init__(self, config: DiskTierConfig, identity: TierIdentity):
        """Open (or create) `config.dir` for `identity`; rebuild the index from its files.
        Raises DiskTierError if the directory cannot be created or written."""
        self.config = config
        self.identity = identity
        self.fs = config.fs
        self._lock = threading.Lock()
        self._counts = {f.name: 0 for f in fields(TierStats) if f.name not in ("bytes_used", "entries")}
        self._counts["load_seconds"] = 0.0
        self._lru: OrderedDict[EntryKey, EntryHeader] = OrderedDict()
        self._by_namespace: dict[str, OrderedDict[EntryKey, EntryHeader]] = {}
        self._by_start: dict[tuple[str, int, str], set[EntryKey]] = {}
        self._starts: dict[str, dict[int, int]] = {}    # namespace -> start position -> exact entries
        self._namespace_bytes: dict[str, int] = {}
        self._stored_bytes = 0
        self._inflight: dict[EntryKey, int] = {}
        self._generations: dict[str, int] = {}
        self._epoch = 0
        self._closed = False
        self._pending: dict[EntryKey, Future] = {}
        self._open_dir()
        self._queue: queue.Queue = queue.Queue(maxsize=config.write_queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-reader")

    # ------------------------------------------------------------------ public API

    def put(self, entry: TierEntry) -> bool:
        """Queue `entry` for writing; True if queued (or already stored), False if dropped.

        Returns at once. The tier takes the entry's tensors as they are: the caller must not write
        into them afterwards (a gather from the pool makes a fresh tensor). Dropped, and counted,
        when the writer queue is full, when the entry cannot fit its namespace's share or the
        budget even after evicting every stored entry it may evict, or when the same key is being
        written already. An exact entry whose key is stored already (same tokens up to the same
        end) replaces it only if it starts earlier (covers more) or brings a state checkpoint the
        stored one lacks. Raises ValueError only for a malformed entry (see `TierEntry.validate`)."""
        entry.validate(self.identity)
        head, header = build_header(entry, self.identity)
        key, size = entry.key, header.file_size
        with self._lock:
            if self._closed or key in self._inflight:
                return False
            stored = self._lru.get(key)
            if (stored is not None and entry.exact and stored.start_pos <= entry.start_pos
                    and (stored.has_states or not entry.states)):
                self._touch(key)                    # the stored K/V cover these: nothing to write
                return True
            reserved = sum(self._inflight.values())
            if self._queue.full() or reserved + size > self.config.max_queued_bytes:
                self._counts["dropped_queue_full"] += 1
                return False
            victims = self._choose_victims(key, size)
            if victims is None:
                self._counts["dropped_over_budget"] += 1
                return False
            for victim in victims:
                self._unindex(victim)
            self._counts["evictions"] += sum(victim != key for victim in victims)
            self._inflight[key] = size
            self._namespace_bytes[key.namespace] = self._namespace_bytes.get(key.namespace, 0) + size
            job = _WriteJob(entry, head, header, [self._path(victim) for victim in victims],
                            self._generation(key.namespace))
            self._queue.put_nowait(job)             # cannot block: only this lock's holders add
        return True

    def contains(self, key: EntryKey) -> bool:
        """Whether `key` is stored (no I/O; a load can still miss if its file has gone bad)."""
        with self._lock:
            return key in self._lru

    def has_states(self, key: EntryKey) -> bool:
        """Whether `key` is stored with a state checkpoint (no I/O)."""
        with self._lock:
            header = self._lru.get(key)
            return header is not None and header.has_states

    def match_prefix(self, namespace: str, token_ids: Sequence[int] | torch.Tensor,
                     start_pos: int = 0) -> TierMatch:
        """The chain of stored exact entries of `namespace` that covers `token_ids` from
        `start_pos` on, furthest (e.g. `start_pos` = what the radix tree matched).

        An entry covers a position when it starts at or before it, ends after it, and its tokens
        equal the query's up to its end (checked by the hash chain here; `get` checks the stored
        token ids again). One pass of hashing over the query, plus each candidate's own run.
        No I/O, no LRU change; call `prefetch` / `get` on the keys."""
        token_ids = [int(t) for t in (token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids)]
        with self._lock:
            starts = sorted(s for s in self._starts.get(namespace, ()) if s < len(token_ids))
        hasher, hashed, covered = PrefixHasher(), 0, start_pos
        keys, chain_starts, ends = [], [], []
        while True:
            best = None
            while starts and starts[0] <= covered:
                start = starts.pop(0)
                hasher.update(token_ids[hashed:start])
                hashed = start
                best = self._longest_at(namespace, token_ids, start, hasher, best)
            if best is None or best.end_pos <= covered:
                break
            keys.append(best.key)
            chain_starts.append(best.start_pos)
            ends.append(best.end_pos)
            covered = best.end_pos
        return TierMatch(tuple(keys), tuple(chain_starts), tuple(ends), covered)

    def _longest_at(self, namespace: str, token_ids: list[int], start: int, hasher: PrefixHasher,
                    best: EntryHeader | None) -> EntryHeader | None:
        """The longest entry starting at `start` (`hasher` is at `start`) that matches the query,
        if it ends after `best`."""
        with self._lock:
            candidates = [self._lru[key] for key in self._by_start.get((namespace, start, hasher.hexdigest()), ())
                          if key in self._lru]
        for header in sorted(candidates, key=lambda h: -h.end_pos):
            if header.end_pos > len(token_ids) or (best is not None and header.end_pos <= best.end_pos):
                continue
            if hasher.copy().update(token_ids[start:header.end_pos]).hexdigest() == header.content:
                return header
        return best

    def prefetch(self, key: EntryKey) -> bool:
        """Start reading `key` on the reader thread (collect it with `get`); False when it is not
        stored, already being read, or `max_prefetches` reads are waiting to be collected."""
        with self._lock:
            if (self._closed or key not in self._lru or key in self._pending
                    or len(self._pending) >= self.config.max_prefetches):
                return False
            self._pending[key] = self._reader.submit(self._load, key)
        return True

    def discard_prefetch(self, key: EntryKey) -> None:
        """Forget a `prefetch` of `key` that no `get` will collect (its read is cancelled or dropped)."""
        with self._lock:
            future = self._pending.pop(key, None)
        if future is not None:
            future.cancel()

    def get(self, key: EntryKey, token_ids: Sequence[int] | torch.Tensor | None = None,
            session_id: str | None = None) -> TierEntry | None:
        """The entry stored under `key`, verified, or None (a miss).

        Waits for a `prefetch` of it if one is running, else reads on the calling thread. With
        `token_ids`, the entry's token ids must equal `token_ids[:entry.end_pos]`. An approximate
        entry is returned only when `session_id` is its session. Never raises for I/O or a bad
        file: those are misses (the file is dropped and counted)."""
        with self._lock:
            future = self._pending.pop(key, None)
            header = self._lru.get(key)
        allowed = header is not None and (header.session_id is None or header.session_id == session_id)
        if future is not None:
            entry = future.result()
        else:
            entry = self._load(key) if allowed else None
        if entry is None or not allowed or not _tokens_match(entry, token_ids):
            self._count("misses")
            return None
        with self._lock:
            self._counts["hits"] += 1
            if key in self._lru:
                self._touch(key)
        return entry

    def flush(self, namespace: str | None = None) -> int:
        """Remove every entry of `namespace` (all namespaces when None), stored or being written;
        return how many stored entries went. The files are unlinked while the tier's lock is held
        (a rare, administrative call: puts wait for it)."""
        with self._lock:
            if namespace is None:
                self._epoch += 1
                keys = list(self._lru)
            else:
                self._generations[namespace] = self._generations.get(namespace, 0) + 1
                keys = list(self._by_namespace.get(namespace, ()))
            for key in keys:
                self._unindex(key)
                self._pending.pop(key, None)
            for key in keys:
                # under the lock, so no later put of the same key can be writing it yet; a write
                # from before this flush removes its own file when it ends (its generation is old)
                if key not in self._inflight:
                    self._remove(self._path(key))
        return len(keys)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**self._counts, bytes_used=self._stored_bytes + sum(self._inflight.values()),
                             entries=len(self._lru))

    def namespace_bytes(self, namespace: str) -> int:
        """Bytes `namespace` holds: its stored files and its writes in flight."""
        with self._lock:
            return self._namespace_bytes.get(namespace, 0)

    def namespaces(self) -> list[str]:
        """Namespaces holding stored entries or writes in flight."""
        with self._lock:
            return list(self._namespace_bytes)

    def lru_keys(self) -> list[EntryKey]:
        """Stored keys, least recently used first."""
        with self._lock:
            return list(self._lru)

    def wait_writes(self) -> None:
        """Block until every queued put has been written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Finish queued writes, stop the threads. The tier takes no puts or prefetches after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_Stop())
        self._writer.join()
        self._reader.shutdown(wait=True)
        self._dir_lock.release()

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ start-up

    def _open_dir(self) -> None:
        root, header_path = self.config.dir / ENTRIES_DIR, self.config.dir / HEADER_FILE
        try:
            self.fs.make_dirs(root)
        except OSError as error:
            raise DiskTierError(f"cannot use {self.config.dir} as the KV disk tier: {error}") from error
        try:
            # one tier per directory: two would each count only their own writes against the budget
            self._dir_lock = self.fs.lock_exclusive(self.config.dir / LOCK_FILE)
        except BlockingIOError:
            raise DiskTierError(f"the KV disk tier {self.config.dir} is in use by another server") from None
        except OSError as error:
            raise DiskTierError(f"cannot lock the KV disk tier {self.config.dir}: {error}") from error
        try:
            self._open_entries(root, header_path)
        except BaseException:
            self._dir_lock.release()
            raise

    def _open_entries(self, root: Path, header_path: Path) -> None:
        if self._stored_identity(header_path) == self.identity:
            self._rebuild_index(root)
        else:
            self._discard_entries(root)
        try:
            # also the start-up proof that the directory is writable
            self.fs.write_atomic(header_path, [self.identity.to_json().encode()])
        except OSError as error:
            raise DiskTierError(f"cannot write to the KV disk tier {self.config.dir}: {error}") from error

    def _stored_identity(self, header_path: Path) -> TierIdentity | None:
        try:
            return TierIdentity.from_json(bytes(self.fs.read_file(header_path)).decode())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as error:
            logger.warning("KV disk tier %s: unreadable header (%s)", self.config.dir, error)
            return None

    def _discard_entries(self, root: Path) -> None:
        """Another model's (or an unreadable header's) entries: removed unread, counted, logged.
        Removed before the new header is written, so a crash in between cannot adopt them."""
        count = 0
        for name in self._list(root):
            for file_name in self._list(root / name):
                count += file_name.endswith(ENTRY_SUFFIX)
                self._remove(root / name / file_name)
        self._counts["ignored_at_start"] = count
        if count:
            logger.warning("KV disk tier %s: %d entries of another model identity ignored and removed",
                           self.config.dir, count)

    def _rebuild_index(self, root: Path) -> None:
        found = []
        for name in self._list(root):
            for file_name in self._list(root / name):
                path = root / name / file_name
                if is_temp_name(file_name):
                    self._remove(path)              # a write a kill interrupted
                    self._counts["temp_files_removed"] += 1
                elif file_name.endswith(ENTRY_SUFFIX):
                    found += self._indexable(path, name, file_name)
        for _, header in sorted(found, key=lambda item: item[0]):
            self._index(header)
        self._evict_over_budget()
        stats = self.stats()
        logger.info("KV disk tier %s: %d entries (%d bytes) rebuilt, %d corrupt dropped, %d temporaries "
                    "removed", self.config.dir, stats.entries, stats.bytes_used, stats.corrupt_dropped,
                    stats.temp_files_removed)

    def _indexable(self, path: Path, dir_name: str, file_name: str) -> list[tuple[float, EntryHeader]]:
        """[(mtime, header)] of a file that may be indexed, or [] (dropped and counted)."""
        try:
            size, mtime = self.fs.file_info(path)
            head = self.fs.read_head(path, HEAD_READ_BYTES)
            if header_bytes_needed(head) > len(head):
                head = self.fs.read_head(path, header_bytes_needed(head))
            header = parse_header(head, file_size=size)
            if (header.identity != self.identity.digest() or namespace_dir(header.namespace) != dir_name
                    or header.content + ENTRY_SUFFIX != file_name):
                raise CorruptEntryError("entry does not match its place")
            return [(mtime, header)]
        except (OSError, CorruptEntryError) as error:
            logger.warning("KV disk tier: dropping %s (%s)", path, error)
            self._remove(path)
            self._counts["corrupt_dropped"] += 1
            return []

    def _evict_over_budget(self) -> None:
        """At start only: the budget may have shrunk since the files were written."""
        cap = self.config.namespace_cap_bytes
        for namespace, entries in list(self._by_namespace.items()):
            while self._namespace_bytes.get(namespace, 0) > cap and entries:
                self._evict_now(next(iter(entries)))
        while self._stored_bytes > self.config.budget_bytes and self._lru:
            self._evict_now(next(iter(self._lru)))

    def _evict_now(self, key: EntryKey) -> None:
        self._unindex(key)
        self._remove(self._path(key))
        self._counts["evictions"] += 1

    # ------------------------------------------------------------------ index (callers hold the lock)

    def _path(self, key: EntryKey) -> Path:
        return self.config.dir / ENTRIES_DIR / namespace_dir(key.namespace) / (key.content + ENTRY_SUFFIX)

    def _generation(self, namespace: str) -> tuple[int, int]:
        return self._epoch, self._generations.get(namespace, 0)

    def _index(self, header: EntryHeader) -> None:
        key = header.key
        if key in self._lru:
            self._unindex(key)
        self._lru[key] = header
        self._by_namespace.setdefault(key.namespace, OrderedDict())[key] = header
        if header.exact:
            self._by_start.setdefault((key.namespace, header.start_pos, header.start_digest), set()).add(key)
            starts = self._starts.setdefault(key.namespace, {})
            starts[header.start_pos] = starts.get(header.start_pos, 0) + 1
        self._namespace_bytes[key.namespace] = self._namespace_bytes.get(key.namespace, 0) + header.file_size
        self._stored_bytes += header.file_size

    def _unindex(self, key: EntryKey) -> EntryHeader:
        header = self._lru.pop(key)
        namespace_entries = self._by_namespace[key.namespace]
        del namespace_entries[key]
        if not namespace_entries:
            del self._by_namespace[key.namespace]
        start = (key.namespace, header.start_pos, header.start_digest)
        if header.exact:
            self._by_start[start].discard(key)
            if not self._by_start[start]:
                del self._by_start[start]
            starts = self._starts[key.namespace]
            starts[header.start_pos] -= 1
            if not starts[header.start_pos]:
                del starts[header.start_pos]
                if not starts:
                    del self._starts[key.namespace]
        self._release_bytes(key.namespace, header.file_size)
        self._stored_bytes -= header.file_size
        return header

    def _release_bytes(self, namespace: str, size: int) -> None:
        remaining = self._namespace_bytes[namespace] - size
        if remaining:
            self._namespace_bytes[namespace] = remaining
        else:
            del self._namespace_bytes[namespace]

    def _touch(self, key: EntryKey) -> None:
        self._lru.move_to_end(key)
        self._by_namespace[key.namespace].move_to_end(key)

    def _choose_victims(self, key: EntryKey, size: int) -> list[EntryKey] | None:
        """Least recently used entries to evict so that `size` more bytes fit: first the
        namespace's own (its share), then anyone's (the budget); None if it cannot fit (the rest
        of the space is held by writes in flight, or the entry is larger than its share)."""
        namespace = key.namespace
        chosen: list[EntryKey] = [key] if key in self._lru else []     # replaced (a session, a longer run)
        freed = sum(self._lru[victim].file_size for victim in chosen)
        namespace_used = self._namespace_bytes.get(namespace, 0) - freed
        total_used = self._stored_bytes + sum(self._inflight.values()) - freed
        for victim, header in self._by_namespace.get(namespace, {}).items():
            if namespace_used + size <= self.config.namespace_cap_bytes:
                break
            if victim not in chosen:
                chosen.append(victim)
                namespace_used -= header.file_size
                total_used -= header.file_size
        if namespace_used + size > self.config.namespace_cap_bytes:
            return None
        for victim, header in self._lru.items():
            if total_used + size <= self.config.budget_bytes:
                break
            if victim not in chosen:
                chosen.append(victim)
                total_used -= header.file_size
        if total_used + size > self.config.budget_bytes:
            return None
        return chosen

    # ------------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if isinstance(job, _Stop):
                    return
                self._write(job)
            except Exception:                       # the writer must outlive any one entry
                logger.exception("KV disk tier: unexpected error writing an entry")
            finally:
                self._queue.task_done()

    def _write(self, job: _WriteJob) -> None:
        key, path = job.entry.key, self._path(job.entry.key)
        for victim in job.victims:                  # first: the budget counts on it
            self._remove(victim)
        try:
            chunks = [job.head, *encode_payload(job.entry)]
            chunks.append(checksum(chunks))
            self.fs.make_dirs(path.parent)
            self.fs.write_atomic(path, chunks)
        except Exception as error:
            with self._lock:
                self._end_inflight(key)
                self._counts["write_errors"] += 1
            logger.warning("KV disk tier: could not write %s (%s); entry dropped", path, error)
            return
        with self._lock:
            self._end_inflight(key)
            current = self._generation(key.namespace) == job.generation
            if current:
                self._index(job.header)
                self._counts["writes"] += 1
        if not current:                             # flushed while it was being written
            self._remove(path)

    def _end_inflight(self, key: EntryKey) -> None:
        self._release_bytes(key.namespace, self._inflight.pop(key))

    # ------------------------------------------------------------------ reads

    def _load(self, key: EntryKey) -> TierEntry | None:
        """Read and verify `key`'s file (on the reader or the calling thread); None on any failure,
        dropping the file when it is bad."""
        path = self._path(key)
        started = time.perf_counter()
        try:
            entry = decode_entry(self.fs.read_file(path), self.identity, key)
        except FileNotFoundError:
            with self._lock:                        # gone with an eviction or flush: a plain miss
                stale = key in self._lru and key not in self._inflight
            if stale:
                self._drop(key, path, "file missing")
            return None
        except CorruptEntryError as error:
            self._drop(key, path, str(error))
            return None
        except OSError as error:
            self._count("read_errors")
            logger.warning("KV disk tier: could not read %s (%s)", path, error)
            return None
        with self._lock:
            self._counts["loads"] += 1
            self._counts["load_seconds"] += time.perf_counter() - started
        try:
            self.fs.touch(path)                     # the LRU clock across restarts
        except OSError:
            pass
        return entry

    def _drop(self, key: EntryKey, path: Path, reason: str) -> None:
        logger.warning("KV disk tier: dropping %s (%s)", path, reason)
        with self._lock:
            self._counts["corrupt_dropped"] += 1
            if key in self._lru:
                self._unindex(key)
            if key not in self._inflight:           # a rewrite under way owns the path now
                self._remove(path)

    # ------------------------------------------------------------------ small helpers

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _list(self, path: Path) -> list[str]:
        try:
            return self.fs.list_dir(path)
        except OSError:
            return []

    def _remove(self, path: Path) -> None:
        try:
            self.fs.remove(path)
        except OSError as error:
            logger.warning("KV disk tier: could not remove %s (%s)", path, error)


def kv_from_pool(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    """The K/V of `slots` (in token order) as one fresh tensor [layers, 2, tokens, kv_heads,
    head_dim] on the CPU: what a `TierEntry` holds (safe to hand to `put`: the pool may reuse
    the slots at once)."""
    return torch.stack((pool.k.index_select(1, slots), pool.v.index_select(1, slots)), dim=1).cpu()


def kv_into_pool(pool: KVPool, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Copy a loaded entry's K/V (or a slice of its tokens) into `slots` of the pool."""
    run = _ascending_run(slots)
    if run is not None:                 # fresh slots mostly are: a plain copy, twice the speed of a scatter
        pool.k[:, run].copy_(kv[:, 0])
        pool.v[:, run].copy_(kv[:, 1])
        return
    pool.k[:, slots] = kv[:, 0].to(pool.k.device)
    pool.v[:, slots] = kv[:, 1].to(pool.v.device)


def _ascending_run(slots: torch.Tensor) -> slice | None:
    """`slots` as a slice when they are consecutive ascending slot numbers, else None."""
    if not slots.numel():
        return None
    first, last = int(slots[0]), int(slots[-1])
    if last - first + 1 != slots.numel() or not bool(torch.all(slots[1:] - slots[:-1] == 1)):
        return None
    return slice(first, last + 1)


def _tokens_match(entry: TierEntry, token_ids: Sequence[int] | torch.Tensor | None) -> bool:
    if token_ids is None:
        return True
    expected = torch.as_tensor(token_ids, dtype=torch.int64)[:entry.end_pos]
    return expected.numel() == entry.end_pos and bool(torch.equal(expected, entry.token_ids))


