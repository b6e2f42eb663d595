"""The disk tier's on-disk format: the directory header, entry keys, and one entry file.

Layout of a tier directory (`DiskTierConfig.dir`):

    DIR/tier.json                       the model identity (`TierIdentity`), written atomically
    DIR/tier.lock                       flock'ed by the one process using the directory
    DIR/entries/<ns>/<content>.kvt      one entry; <ns> = namespace_dir(namespace), <content> = key hex
    DIR/entries/<ns>/.<content>.*.tmp   a write in progress (left behind by a kill: removed at start)

One entry file (little-endian, every offset a multiple of 64 so tensors are read in place):

    offset 0   magic b"KVSPTIER" (8) | header_len u32 | payload_len u64 | header (JSON, space-padded)
    then       payload: the tensors' raw bytes, each at a 64-byte aligned offset (zero padding)
    last 8     XXH3-64 of everything before it (magic, lengths, header, payload): a checksum at
               memory speed (a 4K-token entry's 90 MiB in a few ms; crc32 took ten times as long)

The header names the format version, the identity digest, the namespace (in full: the directory
name is only its hash), the content key, kind/exact/session, the start position, and each tensor's
name, dtype, shape and offset. Tensors: "token_ids" (int64, every token from position 0 to the
entry's end, so a load is verified against the caller's tokens, not a hash), "kv" ([layers, 2,
tokens, kv_heads, head_dim] in the pool dtype: K and V of positions start_pos..end-1) and any
recurrent-state checkpoint tensors ("state.<name>").

A prefix entry's content key is a hash chain over its token ids from position 0 (`PrefixHasher`),
the same for every request that reaches the same prefix, so equal prefixes share one entry. A
session entry's key is a hash of the session id: one entry per session, replaced on every put.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Hashable, Sequence

import numpy as np
import torch
import xxhash

TIER_FORMAT_VERSION = 2            # 2: XXH3-64 instead of crc32
MAGIC = b"KVSPTIER"
PREFIX = struct.Struct("<8sIQ")        # magic, header_len, payload_len
CHECKSUM = struct.Struct("<Q")         # XXH3-64 of everything before it
ALIGN = 64
ENTRY_SUFFIX = ".kvt"
KV_TENSOR = "kv"
TOKENS_TENSOR = "token_ids"
STATE_PREFIX = "state."

_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in
           (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)}


class CorruptEntryError(ValueError):
    """An entry file that is torn, truncated, fails its checksum, or does not say what it should."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"the disk tier cannot store dtype {dtype}")
    return name


@dataclass(frozen=True)
class TierIdentity:
    """What makes stored K/V valid for a model: an entry written under one identity is never
    loaded under another. `model` names the weights (a path, a hub id or a sha256 of the
    checkpoint); any change of weights, dtype, weight format or shapes must change the identity."""

    model: str
    dtype: str
    weight_format: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    format_version: int = TIER_FORMAT_VERSION
    extra: tuple[tuple[str, str], ...] = ()     # anything else that changes K/V (e.g. rope scaling)

    @staticmethod
    def of_model(model: str, config, dtype: torch.dtype, weight_format: str) -> "TierIdentity":
        """The identity of a loaded model: `model` names its weights (path or sha256), `config` is
        its `ModelConfig` (the pool's shapes; a hash of the whole config goes into `extra`, so a
        change of RoPE, window or layer layout also changes the identity)."""
        config_hash = hashlib.blake2b(repr(config).encode(), digest_size=16).hexdigest()
        return TierIdentity(model=model, dtype=dtype_name(dtype), weight_format=weight_format,
                            num_layers=config.num_kv_layers, num_kv_heads=config.num_kv_heads,
                            head_dim=config.head_dim, extra=(("model_config", config_hash),))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "TierIdentity":
        """Parse a header; raises ValueError if it is not a TierIdentity."""
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("tier header is not a JSON object")
        fields["extra"] = tuple(tuple(pair) for pair in fields.get("extra", ()))
        return TierIdentity(**fields)

    def digest(self) -> str:
        """Short hash of the identity, stamped into every entry (checked again on load)."""
        return hashlib.blake2b(self.to_json().encode(), digest_size=8).hexdigest()


def namespace_name(namespace: Hashable) -> str:
    """A radix namespace (None, str, int, or tuples of them: e.g. (owner, cache_salt)) as the
    stable string the tier keys on. Distinct namespaces give distinct strings (repr of these types
    is injective and does not change between runs); other types raise TypeError."""
    def check(value) -> None:
        if isinstance(value, tuple):
            for item in value:
                check(item)
        elif value is not None and not isinstance(value, (str, int)):
            raise TypeError(f"namespace part {value!r} must be None, str, int or a tuple of them")
    check(namespace)
    return repr(namespace)


def namespace_dir(namespace: str) -> str:
    """Directory name of a namespace (a hash: names may hold any character). Two namespaces
    that collide would still never share an entry: each entry names its namespace in full."""
    return hashlib.blake2b(namespace.encode(), digest_size=16, person=b"kvsp-ns").hexdigest()


def _token_bytes(token_ids: Sequence[int] | torch.Tensor) -> bytes:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.to(torch.int64).numpy().astype("<i8").tobytes()
    return np.asarray(token_ids, dtype="<i8").tobytes()


class PrefixHasher:
    """Incremental hash chain over token ids from position 0 (blake2b-128, as nano-vllm's block
    hash but over any run length). `copy()` forks it, so one pass over a query can try every
    stored entry end without hashing the prefix again."""

    def __init__(self, _state=None):
        self._state = _state or hashlib.blake2b(digest_size=16, person=b"kvsp-prefix")
        self.length = 0

    def update(self, token_ids: Sequence[int] | torch.Tensor) -> "PrefixHasher":
        self._state.update(_token_bytes(token_ids))
        self.length += len(token_ids)
        return self

    def copy(self) -> "PrefixHasher":
        forked = PrefixHasher(self._state.copy())
        forked.length = self.length
        return forked

    def hexdigest(self) -> str:
        return self._state.hexdigest()


def prefix_digest(token_ids: Sequence[int] | torch.Tensor) -> str:
    return PrefixHasher().update(token_ids).hexdigest()


@dataclass(frozen=True)
class EntryKey:
    """Where an entry lives: its namespace (see `namespace_name`) and a content key (hex)."""

    namespace: str
    content: str

    @staticmethod
    def for_prefix(namespace: str, token_ids: Sequence[int] | torch.Tensor) -> "EntryKey":
        """Key of the exact K/V of a prefix ending after `token_ids` (all tokens from 0)."""
        return EntryKey(namespace, prefix_digest(token_ids))

    @staticmethod
    def for_session(namespace: str, session_id: str) -> "EntryKey":
        """Key of an SCR session's private K/V (one entry per session)."""
        digest = hashlib.blake2b(session_id.encode(), digest_size=16, person=b"kvsp-session")
        return EntryKey(namespace, "s" + digest.hexdigest())


@dataclass(frozen=True)
class TierEntry:
    """K/V of a run of tokens, in every layer, and the checkpoints that go with it.

    `token_ids`: int64, every token from position 0 to the entry's end. `start_pos`: position of
    the first token whose K/V is stored; `kv` is [layers, 2, len(token_ids) - start_pos, kv_heads,
    head_dim] (K then V, keys after RoPE). `states`: recurrent-state checkpoint tensors by name
    (the state after the last token). `exact`: K/V equal to a full recompute; an approximate entry
    (relocated K/V) must name the `session_id` that owns it and is loadable by that session only.
    """

    key: EntryKey
    token_ids: torch.Tensor
    start_pos: int
    kv: torch.Tensor
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    exact: bool = True
    session_id: str | None = None

    @property
    def end_pos(self) -> int:
        return int(self.token_ids.numel())

    @property
    def num_tokens(self) -> int:
        return self.end_pos - self.start_pos

    def validate(self, identity: TierIdentity) -> None:
        """Raise ValueError unless the entry fits `identity` and its own key."""
        if self.token_ids.dtype != torch.int64 or self.token_ids.dim() != 1:
            raise ValueError("token_ids must be a 1-D int64 tensor")
        if not 0 <= self.start_pos < self.end_pos:
            raise ValueError(f"start_pos {self.start_pos} outside [0, {self.end_pos})")
        expected = (identity.num_layers, 2, self.num_tokens, identity.num_kv_heads, identity.head_dim)
        if tuple(self.kv.shape) != expected:
            raise ValueError(f"kv has shape {tuple(self.kv.shape)}, the tier stores {expected}")
        if dtype_name(self.kv.dtype) != identity.dtype:
            raise ValueError(f"kv is {self.kv.dtype}, the tier stores {identity.dtype}")
        if not self.exact and not self.session_id:
            raise ValueError("an approximate entry must belong to a session (session_id)")
        if self.exact and self.key.content != prefix_digest(self.token_ids):
            raise ValueError("an exact entry's key must be EntryKey.for_prefix of its token_ids")


@dataclass(frozen=True)
class EntryHeader:
    """What the tier indexes about an entry without reading its payload."""

    namespace: str
    content: str
    identity: str
    start_pos: int
    end_pos: int
    start_digest: str           # prefix digest of token_ids[:start_pos] (the match index's key)
    exact: bool
    session_id: str | None
    tensors: tuple[tuple[str, str, tuple[int, ...], int], ...]   # name, dtype, shape, offset
    payload_len: int
    header_len: int

    @property
    def key(self) -> EntryKey:
        return EntryKey(self.namespace, self.content)

    @property
    def file_size(self) -> int:
        return PREFIX.size + self.header_len + self.payload_len + CHECKSUM.size

    @property
    def has_states(self) -> bool:
        """Whether the entry holds a recurrent-state checkpoint (a hybrid's state after its end)."""
        return any(name.startswith(STATE_PREFIX) for name, _, _, _ in self.tensors)


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _tensor_list(entry: TierEntry) -> list[tuple[str, torch.Tensor]]:
    tensors = [(TOKENS_TENSOR, entry.token_ids), (KV_TENSOR, entry.kv)]
    tensors += [(STATE_PREFIX + name, tensor) for name, tensor in sorted(entry.states.items())]
    return tensors


def build_header(entry: TierEntry, identity: TierIdentity) -> tuple[bytes, EntryHeader]:
    """The encoded prefix + header of `entry` and its `EntryHeader` (no payload bytes touched)."""
    offset, layout = 0, []
    for name, tensor in _tensor_list(entry):
        layout.append((name, dtype_name(tensor.dtype), tuple(tensor.shape), offset))
        offset = _align(offset + tensor.numel() * tensor.element_size())
    fields = {"format_version": TIER_FORMAT_VERSION, "identity": identity.digest(),
              "namespace": entry.key.namespace, "content": entry.key.content,
              "start_pos": entry.start_pos, "end_pos": entry.end_pos,
              "start_digest": prefix_digest(entry.token_ids[:entry.start_pos]),
              "exact": entry.exact, "session_id": entry.session_id, "tensors": layout}
    text = json.dumps(fields).encode()
    header_len = _align(PREFIX.size + len(text)) - PREFIX.size
    header = EntryHeader(entry.key.namespace, entry.key.content, identity.digest(), entry.start_pos,
                         entry.end_pos, fields["start_digest"], entry.exact, entry.session_id,
                         tuple(layout), offset, header_len)
    return PREFIX.pack(MAGIC, header_len, offset) + text.ljust(header_len), header


def encode_payload(entry: TierEntry) -> list[memoryview]:
    """The payload as zero-copy views of the tensors' bytes, with the alignment padding."""
    chunks, length = [], 0
    for _, tensor in _tensor_list(entry):
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        chunks.append(memoryview(raw))
        length += raw.nbytes
        padding = _align(length) - length
        if padding:
            chunks.append(memoryview(bytes(padding)))
            length += padding
    return chunks


def checksum(chunks: Sequence[bytes | memoryview]) -> bytes:
    """XXH3-64 of the chunks' bytes in order, packed as the file's last CHECKSUM.size bytes."""
    state = xxhash.xxh3_64()
    for chunk in chunks:
        state.update(chunk)
    return CHECKSUM.pack(state.intdigest())


def parse_header(head: bytes, file_size: int | None = None) -> EntryHeader:
    """Decode the prefix + header at the start of an entry file (`head` holds at least that much,
    see `header_bytes_needed`). With `file_size`, also check that the file is exactly as long as
    the header says (a truncated or torn file is caught without reading the payload). Raises
    CorruptEntryError."""
    if len(head) < PREFIX.size:
        raise CorruptEntryError("shorter than an entry prefix")
    magic, header_len, payload_len = PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise CorruptEntryError("not a kvsplice tier entry (bad magic)")
    if len(head) < PREFIX.size + header_len:
        raise CorruptEntryError("header cut short")
    try:
        fields = json.loads(bytes(head[PREFIX.size:PREFIX.size + header_len]))
        if fields["format_version"] != TIER_FORMAT_VERSION:
            raise CorruptEntryError(f"format version {fields['format_version']}")
        layout = tuple((str(name), str(dtype), tuple(int(d) for d in shape), int(offset))
                       for name, dtype, shape, offset in fields["tensors"])
        header = EntryHeader(str(fields["namespace"]), str(fields["content"]), str(fields["identity"]),
                             int(fields["start_pos"]), int(fields["end_pos"]), str(fields["start_digest"]),
                             bool(fields["exact"]), fields["session_id"], layout, payload_len, header_len)
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptEntryError(f"unreadable header: {error}") from None
    if file_size is not None and file_size != header.file_size:
        raise CorruptEntryError(f"file is {file_size} bytes, its header says {header.file_size}")
    return header


def header_bytes_needed(head: bytes) -> int:
    """How many leading bytes of a file `parse_header` needs, from its first PREFIX.size bytes."""
    if len(head) < PREFIX.size:
        return PREFIX.size
    return PREFIX.size + PREFIX.unpack_from(head)[1]


def decode_entry(buffer: memoryview, identity: TierIdentity, key: EntryKey) -> TierEntry:
    """Verify a whole entry file read into `buffer` and return its entry (tensors are views of
    `buffer`, which must be writable). Raises CorruptEntryError on any mismatch: length,
    checksum, identity, key, shapes, or (for exact entries) token ids that do not hash to the key."""
    header = parse_header(buffer, file_size=len(buffer))
    if checksum([buffer[:-CHECKSUM.size]]) != bytes(buffer[-CHECKSUM.size:]):
        raise CorruptEntryError("checksum mismatch")
    if header.identity != identity.digest():
        raise CorruptEntryError("written under another model identity")
    if header.key != key:
        raise CorruptEntryError(f"holds {header.key}, expected {key}")
    base = PREFIX.size + header.header_len
    tensors = {}
    for name, dtype, shape, offset in header.tensors:
        if dtype not in _DTYPES:
            raise CorruptEntryError(f"unknown dtype {dtype}")
        count = int(np.prod(shape, dtype=np.int64))
        if offset + count * torch.empty((), dtype=_DTYPES[dtype]).element_size() > header.payload_len:
            raise CorruptEntryError(f"tensor {name} runs past the payload")
        flat = torch.frombuffer(buffer, dtype=_DTYPES[dtype], count=count, offset=base + offset) \
            if count else torch.empty(0, dtype=_DTYPES[dtype])
        tensors[name] = flat.reshape(shape)
    try:
        entry = TierEntry(key, tensors.pop(TOKENS_TENSOR), header.start_pos, tensors.pop(KV_TENSOR),
                          {name.removeprefix(STATE_PREFIX): t for name, t in tensors.items()},
                          header.exact, header.session_id)
        entry.validate(identity)
    except (KeyError, ValueError) as error:
        raise CorruptEntryError(f"inconsistent entry: {error}") from None
    return entry
