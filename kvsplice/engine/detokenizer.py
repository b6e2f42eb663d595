"""Incremental detokenization with stop strings, for streaming one request's output.

Two hold-backs stand between a generated token and the text we emit:

    token ids ──> [1. decode window] ──> new text ──> [2. stop-string check] ──> safe text
                   hold while the text       hold the longest tail that could still
                   ends in U+FFFD (a          begin a stop string; cut at the first
                   multi-byte char split      stop string found and stop.
                   across tokens)

1. follows vLLM's `detokenize_incrementally` (and HF `tokenizers.decoders.DecodeStream`): the new
   text of a token is decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset]).
   Decoding a short window of recent tokens, not a single token, keeps the context-dependent parts
   of decoding right (SentencePiece leading-space stripping, byte-fallback tokens that only form a
   character together).
2. follows OpenAI semantics: the output ends right before the stop string, which is not included.
   Stop regexes (SGLang's `stop_regex`, stop_patterns.py) are checked the same way: cut at the
   earliest match, withhold what a partial match could still grow into.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from kvsplice.structured.stop_patterns import StopPatterns

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens decoded before the first output
# token so that its leading space (or merged bytes) come out as in the full decode.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _first_stop(text: str, stop: tuple[str, ...]) -> tuple[int, str] | None:
    """(offset, stop string) of the earliest stop string occurrence in `text`, or None.

    On equal offsets the longer stop string wins (it is the one the text spells out in full).
    """
    best: tuple[int, str] | None = None
    for stop_string in stop:
        offset = text.find(stop_string)
        if offset < 0:
            continue
        if best is None or offset < best[0] or (offset == best[0] and len(stop_string) > len(best[1])):
            best = (offset, stop_string)
    return best


def _stop_prefix_length(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop_string in stop:
        for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
            if text.endswith(stop_string[:length]):
                longest = length
                break
    return longest


class IncrementalDetokenizer:
    """Turns generated token ids, fed one at a time, into text that is safe to stream.

    `decode(ids) -> str` is the tokenizer's decode (with the request's skip_special_tokens already
    bound). `stop` are the request's stop strings. `context_ids`, optional, are the prompt ids the
    output follows; the last few seed the decode window so that the first token's leading space is
    kept (" a" after "Once upon", not "a"). Without them the output decodes as if it started the text.

    Contract: the concatenation of everything `add` and `flush` return equals `text`, and, when no
    stop string is hit, equals decode(context + ids) minus decode(context) for the ids fed (for
    valid UTF-8 output). Once a stop string is found, `stopped` is True, `text` ends right before
    it, and further `add` calls return "" and are ignored.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: tuple[str, ...] = (),
        context_ids: Sequence[int] = (),
        stop_patterns: Optional[StopPatterns] = None,
    ) -> None:
        """Set up an empty stream; `stop` entries must be non-empty strings (ValueError otherwise).
        `stop_patterns`, optional, are stop regexes checked beside the strings (stop_patterns.py)."""
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError("stop: stop strings must be non-empty strings")
        self._decode = decode
        self._stop = tuple(stop)
        self._patterns = stop_patterns
        self._ids: list[int] = [int(token_id) for token_id in context_ids[-_CONTEXT_TOKENS:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._held = ""  # decoded text withheld because it could begin a stop string
        self._chunks: list[str] = []
        self._stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string has been found in the output."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string (or stop regex pattern) that ended the output, or None."""
        return self._stop_reason

    @property
    def text(self) -> str:
        """Everything emitted so far (by `add` and `flush`)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _decode_new_text(self, final: bool) -> str:
        """Text added by the ids after read_offset; "" while it ends in U+FFFD (unless `final`).

        On success the window slides: prefix_offset <- read_offset, read_offset <- len(ids).
        """
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def _first_found(self, pending: str) -> tuple[int, str] | None:
        """The earliest stop string or stop regex match in `pending` (a string wins a tie)."""
        found = _first_stop(pending, self._stop)
        matched = self._patterns.first_match(self.text, pending) if self._patterns else None
        if matched is not None and (found is None or matched[0] < found[0]):
            return matched
        return found

    def _hold_length(self, pending: str) -> int:
        """How much of `pending`'s end could still begin a stop string or a stop regex match."""
        hold = _stop_prefix_length(pending, self._stop)
        if self._patterns:
            hold = max(hold, len(pending) - self._patterns.hold_from(self.text, pending))
        return hold

    def _release(self, new_text: str, final: bool) -> str:
        """Pass `new_text` through the stop checks; return the part that is safe to emit."""
        pending = self._held + new_text
        found = self._first_found(pending)
        if found is not None:
            offset, self._stop_reason = found
            self._held = ""
            safe = pending[:offset]
        else:
            hold = 0 if final else self._hold_length(pending)
            self._held = pending[len(pending) - hold :] if hold else ""
            safe = pending[: len(pending) - hold]
        if safe:
            self._chunks.append(safe)
        return safe

    def add(self, token_id: int) -> str:
        """Feed one generated token id; return the new text that is safe to emit (maybe "").

        Returns "" and ignores the token once `stopped` is True.
        """
        if self.stopped:
            return ""
        self._ids.append(token_id)
        new_text = self._decode_new_text(final=False)
        if not new_text:
            return ""
        return self._release(new_text, final=False)

    def flush(self) -> str:
        """End of output: return all held-back text (a partial stop-string match, and any bytes that
        never formed a complete character, decoded as U+FFFD). Returns "" when already stopped.
        A stop string inside that text still cuts it and sets `stopped`.
        """
        if self.stopped:
            return ""
        new_text = self._decode_new_text(final=True) if self._read_offset < len(self._ids) else ""
        return self._release(new_text, final=True)
