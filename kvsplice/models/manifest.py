"""The model cache's manifest: what the GGUF converter wrote, so that a later start can prove it intact.

A converted directory holds, besides the model files:

  kvsplice-manifest.json    written by the converter, last and atomically: format, converter
                            version, the source GGUF's identity (path, size, mtime_ns, sha256),
                            and {file name: size, sha256} for every file it wrote.
  .kvsplice-verified.json   a stamp: the stat key (size, mtime_ns, ctime_ns, inode, device) of each
                            file at the moment its sha256 last matched, and of the source GGUF when
                            its sha256 last matched. Deleting it forces a full re-hash.

`check_cache` always compares sizes (a few stat calls). It re-hashes a file only when its stat key
differs from the stamp's: writing into a file (even zeroing a region without changing its size)
moves its mtime and ctime, so the next start hashes it and sees the damage, while an untouched
cache costs no reads. A file whose hash matched is stamped again, so the cost is paid once.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

MANIFEST_FILE = "kvsplice-manifest.json"
STAMP_FILE = ".kvsplice-verified.json"
MANIFEST_FORMAT = 1
BOOKKEEPING_FILES = frozenset({MANIFEST_FILE, STAMP_FILE})


class ModelCacheError(ValueError):
    """A converted model cache is damaged and cannot be rebuilt, because its source GGUF is gone."""


@dataclass(frozen=True)
class SourceIdentity:
    """Which GGUF a cache was converted from: its path then, its size, mtime_ns and sha256."""

    path: str
    size: int
    mtime_ns: int
    sha256: str


@dataclass(frozen=True)
class FileRecord:
    """One file the converter wrote: its size in bytes and its sha256 (hex)."""

    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The converter's record of a cache directory (see the module docstring)."""

    converter_version: str
    source: SourceIdentity
    files: Mapping[str, FileRecord]


@dataclass(frozen=True)
class CacheVerdict:
    """Outcome of `check_cache`.

    `problem` is None when the cache is intact and current; otherwise a phrase that completes
    "the model cache <dir> ..." (e.g. "is damaged: model.safetensors does not match its sha256").
    `usable` is True when every file matches the manifest (the only problems are staleness: an
    older converter or a changed source), so the cache may be loaded if it cannot be rebuilt.
    `manifest` is the parsed manifest, when there is a readable one.
    """

    problem: Optional[str]
    usable: bool
    manifest: Optional[Manifest]


def sha256_of(path: Path, sync: bool = False) -> str:
    """Hex sha256 of a file's content (reads it once, in OpenSSL's chunked loop); `sync` also fsyncs it."""
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
        if sync:
            os.fsync(handle.fileno())
    return digest


def stat_key(path: Path) -> list[int]:
    """(size, mtime_ns, ctime_ns, inode, device): changes whenever the file is written or replaced."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def source_identity(gguf_path: Path) -> SourceIdentity:
    """The identity of a GGUF as a manifest records it (hashes the whole file)."""
    stat = gguf_path.stat()
    return SourceIdentity(str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns, sha256_of(gguf_path))


def write_json_atomically(path: Path, payload: dict) -> None:
    """Write JSON to a temporary sibling, fsync it, then rename it onto `path` (readers never see half)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "w") as handle:
            json.dump(payload, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_manifest(directory: Path, source: SourceIdentity, converter_version: str) -> Manifest:
    """Hash every file in `directory`, stamp them as verified, then write the manifest (last, atomically).

    Side effects: reads and fsyncs every file once (a manifest never describes data that is not on
    disk yet); writes STAMP_FILE, then MANIFEST_FILE.
    """
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in BOOKKEEPING_FILES)
    keys = {name: stat_key(directory / name) for name in names}
    files = {name: FileRecord(keys[name][0], sha256_of(directory / name, sync=True)) for name in names}
    manifest = Manifest(converter_version, source, files)
    stamp = {"files": {name: stamp_entry(keys[name], files[name].sha256) for name in names}}
    write_json_atomically(directory / STAMP_FILE, stamp)
    write_json_atomically(directory / MANIFEST_FILE, {
        "format": MANIFEST_FORMAT,
        "converter_version": converter_version,
        "source": vars(source),
        "files": {name: vars(record) for name, record in files.items()},
    })
    return manifest


def stamp_entry(key: list[int], sha256: str) -> dict:
    """What the stamp remembers of a file whose content matched `sha256` while its stat key was `key`.

    Callers take `key` before hashing: a file written during the hash gets a new key, so it is
    hashed again next time instead of being stamped with content that was never checked.
    """
    return {"stat": key, "sha256": sha256}


def read_manifest(directory: Path) -> Optional[Manifest]:
    """The manifest of `directory`, or None if it has none; ValueError if it cannot be parsed."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text())
        if payload["format"] != MANIFEST_FORMAT:
            raise ValueError(f"format {payload['format']!r}, expected {MANIFEST_FORMAT}")
        files = {str(name): FileRecord(int(r["size"]), str(r["sha256"])) for name, r in payload["files"].items()}
        source = payload["source"]
        identity = SourceIdentity(str(source["path"]), int(source["size"]), int(source["mtime_ns"]),
                                  str(source["sha256"]))
        return Manifest(str(payload["converter_version"]), identity, files)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: {type(error).__name__}: {error}") from error


def read_stamp(directory: Path) -> dict:
    """The verified-stamp of `directory` ({} when absent or unreadable: everything gets re-hashed)."""
    try:
        stamp = json.loads((directory / STAMP_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return stamp if isinstance(stamp, dict) and isinstance(stamp.get("files", {}), dict) else {}


def write_stamp(directory: Path, stamp: dict) -> None:
    """Save the stamp; a read-only cache just stays unstamped (every start re-hashes what changed)."""
    try:
        write_json_atomically(directory / STAMP_FILE, stamp)
    except OSError:
        pass


def size_problem(directory: Path, manifest: Manifest) -> Optional[str]:
    """The first file that is missing or has the wrong size, described; None if all sizes match."""
    for name, record in manifest.files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != record.size:
            return f"{name} is {size} bytes, the manifest says {record.size}"
    return None


def hash_problem(directory: Path, manifest: Manifest, stamp: dict) -> Optional[str]:
    """Re-hash the files whose stat key is not stamped; the first mismatch, described, or None.

    Side effect: files that matched are added to `stamp["files"]` (the caller saves it).
    """
    stamped = stamp.setdefault("files", {})
    for name, record in manifest.files.items():
        path = directory / name
        key = stat_key(path)
        if stamped.get(name) == stamp_entry(key, record.sha256):
            continue
        stamped.pop(name, None)
        if sha256_of(path) != record.sha256:
            return f"{name} does not match its sha256 in the manifest"
        stamped[name] = stamp_entry(key, record.sha256)
    return None


def version_problem(manifest: Manifest, converter_version: str) -> Optional[str]:
    """Whether an older (or newer) converter wrote the cache; None when the versions match."""
    if manifest.converter_version == converter_version:
        return None
    return f"was written by converter version {manifest.converter_version}, this kvsplice has {converter_version}"


def source_problem(manifest: Manifest, source: Optional[Path], stamp: dict) -> Optional[str]:
    """Whether the GGUF at `source` differs from the one the cache was converted from (None: same or unknown).

    Same size and mtime, or a stamped stat key, count as the same file; anything else is re-hashed.
    Side effect: a source whose hash matched is recorded in `stamp["source"]`.
    """
    if source is None:
        return None
    recorded = manifest.source
    key = stat_key(source)
    size, mtime_ns = key[0], key[1]
    if size != recorded.size:
        return f"was converted from a different GGUF ({recorded.size} bytes, {source} has {size})"
    if mtime_ns == recorded.mtime_ns or stamp.get("source") == stamp_entry(key, recorded.sha256):
        return None
    if sha256_of(source) != recorded.sha256:
        return f"was converted from a different GGUF ({source} changed since)"
    stamp["source"] = stamp_entry(key, recorded.sha256)
    return None


def check_cache(directory: Path, converter_version: str, source: Optional[Path]) -> CacheVerdict:
    """Whether `directory` is an intact, current conversion of `source` (None: source unavailable).

    Checks, in order: the manifest exists and parses; every file has its recorded size (stat only);
    every file whose stat key is not stamped hashes to its recorded sha256; the converter version
    matches; `source` (when given) is the GGUF the manifest names. Side effect: updates the stamp.
    """
    if not directory.is_dir():
        return CacheVerdict("does not exist", False, None)
    try:
        manifest = read_manifest(directory)
    except ValueError as error:
        return CacheVerdict(f"has an unreadable manifest ({error})", False, None)
    if manifest is None:
        return CacheVerdict(f"has no {MANIFEST_FILE} (an older kvsplice wrote it)", False, None)
    stamp = read_stamp(directory)
    stamp_before = json.dumps(stamp, sort_keys=True)
    damage = size_problem(directory, manifest) or hash_problem(directory, manifest, stamp)
    staleness = None if damage else version_problem(manifest, converter_version) or source_problem(
        manifest, source, stamp)
    if json.dumps(stamp, sort_keys=True) != stamp_before:
        write_stamp(directory, stamp)
    if damage is not None:
        return CacheVerdict(f"is damaged: {damage}", False, manifest)
    return CacheVerdict(staleness, True, manifest)
