"""llama2.c's tokenizer: run.c's BPE (`Llama2cBPE`) and the `tokenizer.bin` files it reads,
found beside a llama2.c checkpoint (`kvsplice.models.llama2c` reads the checkpoint itself).
"""

from __future__ import annotations

import struct
from pathlib import Path

BOS_ID = 1
EOS_ID = 2
# run.c: ids 3..258 are the byte-fallback pieces <0x00>..<0xFF>.
BYTE_FALLBACK_OFFSET = 3


class Llama2cBPE:
    """run.c's tokenizer: pieces with merge scores, greedy best-score merges, byte fallback.

    `encode` follows run.c `encode()`: a dummy " " prefix for non-empty text, one token per UTF-8
    code point (or its bytes as <0xXX> when the code point is not a piece), then repeatedly merge
    the adjacent pair whose concatenation is a piece with the highest score.
    """

    def __init__(self, pieces: list[bytes], scores: list[float]):
        if len(pieces) != len(scores) or len(pieces) <= BYTE_FALLBACK_OFFSET + 255:
            raise ValueError("llama2.c tokenizer needs matching pieces/scores and 256 byte-fallback pieces")
        self.pieces = pieces
        self.scores = scores
        self.piece_to_id = {piece: token_id for token_id, piece in enumerate(pieces)}

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text` exactly as run.c encodes it, optionally with BOS/EOS."""
        ids = [self.piece_to_id[b" "]] if text else []
        for char in text:
            char_bytes = char.encode("utf-8")
            if char_bytes in self.piece_to_id:
                ids.append(self.piece_to_id[char_bytes])
            else:
                ids.extend(byte + BYTE_FALLBACK_OFFSET for byte in char_bytes)
        ids = self._merge(ids)
        return ([BOS_ID] if add_bos else []) + ids + ([EOS_ID] if add_eos else [])

    def _merge(self, ids: list[int]) -> list[int]:
        while True:
            best_score, best_offset, best_id = None, None, None
            for offset in range(len(ids) - 1):
                merged_id = self.piece_to_id.get(self.pieces[ids[offset]] + self.pieces[ids[offset + 1]])
                if merged_id is not None and (best_score is None or self.scores[merged_id] > best_score):
                    best_score, best_offset, best_id = self.scores[merged_id], offset, merged_id
            if best_offset is None:
                return ids
            ids[best_offset : best_offset + 2] = [best_id]

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: the raw byte for <0xXX> pieces, else the piece itself."""
        if BYTE_FALLBACK_OFFSET <= token_id < BYTE_FALLBACK_OFFSET + 256:
            return bytes([token_id - BYTE_FALLBACK_OFFSET])
        return self.pieces[token_id]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; drops the dummy-prefix space of the first piece like sentencepiece does."""
        special = {0, BOS_ID, EOS_ID}
        kept = [token_id for token_id in ids if not (skip_special_tokens and token_id in special)]
        for token_id in kept:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        data = b"".join(self.piece_bytes(token_id) for token_id in kept)
        if kept and kept[0] not in special and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        """One token's text with its leading space kept (what a logprobs listing should show)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return self.piece_bytes(token_id).decode("utf-8", errors="replace")


def read_llama2c_tokenizer(path: str | Path, vocab_size: int) -> Llama2cBPE:
    """Read run.c's `tokenizer.bin`: int32 max_token_length, then per token float32 score, int32 len, bytes."""
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read llama2.c tokenizer {path}: {error}") from error
    cursor = 4
    pieces, scores = [], []
    try:
        for _ in range(vocab_size):
            score, length = struct.unpack_from("<fi", raw, cursor)
            cursor += 8
            if length < 0 or cursor + length > len(raw):
                raise ValueError(f"{path}: corrupt piece length {length}")
            pieces.append(raw[cursor : cursor + length])
            scores.append(score)
            cursor += length
    except struct.error as error:
        raise ValueError(f"{path}: llama2.c tokenizer is truncated ({len(pieces)} of {vocab_size} pieces)") from error
    return Llama2cBPE(pieces, scores)


def find_llama2c_tokenizer(checkpoint_path: str | Path) -> Path | None:
    """The `tokenizer.bin` or `tok*.bin` beside a checkpoint (not the checkpoint itself), or None."""
    checkpoint_path = Path(checkpoint_path)
    folder = checkpoint_path.parent
    candidates = [folder / "tokenizer.bin"] + sorted(folder.glob("tok*.bin"))
    for candidate in candidates:
        if candidate.is_file() and candidate.resolve() != checkpoint_path.resolve():
            return candidate
    return None
