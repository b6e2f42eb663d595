"""Where each chat message's content starts in a prompt's token ids, found from the tokens alone.

Selective recompute computes again the opening of every message that lies inside a relocated span:
the header tokens that are not special (the role and its line break) and the first content
token(s). After a deletion, a question about the removed content attends to the openings of the
messages around it ("Documentation of ..."), and a relocated opening still carries what it saw
of the removed text. Measured on the default model (docs/BENCHMARKS.md, "Selective recompute on
fresh workload cases", 17 edited agent chats): SCR's mean KL goes from 0.00199 to 0.00127 nats
with 8 seam tokens, for 7.8% of the prompt computed instead of 7.2%. The role and line break are
recomputed too because a recomputed first token still attends to its stale header (an earlier
version that recomputed the first content token alone: 0.00172 at 7.4%). The special token is
left alone: recomputing <|im_start|> as well cost more (8.0%) for a higher KL (0.00134), and a
case that strips reasoning went from 0.0005 to 0.0021.

A chat template writes each message as special token(s), a role, a line break, then the content:

    ChatML   <|im_start|> tool \\n  Documentation of ...  <|im_end|> \\n <|im_start|> ...
             ^special     ^^^^^^^^ ^content start                   (a special right after a line
                          recomputed with it                         break starts no content)
    Llama 3  <|start_header_id|> user <|end_header_id|> \\n\\n  What is ...

so a content start is the first token that is not a line break after the first line break that
follows a special token within `MAX_HEADER` tokens, when that token is not special. No template is
rendered and no message list is needed, so raw-prompt requests (`/v1/completions`) get the same
starts as chat requests. A tokenizer without special tokens (llama2.c) finds none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Sequence

import numpy as np

from kvsplice.tokenizer import Tokenizer

MAX_HEADER = 8  # tokens from a message's first special token to the line break ending its header


@dataclass(frozen=True)
class MessageStart:
    """One message's header (its first special token) and first content token, as prompt offsets."""

    header: int
    content: int


class MessageStarts:
    """Finds message content starts for one tokenizer. `special_ids`: the tokenizer's special
    (control) token ids; whether a token ends a line is read from its text once and cached."""

    def __init__(self, tokenizer: Tokenizer):
        backend = tokenizer.backend
        specials = set(getattr(backend, "all_special_ids", ()) or ())
        for token_id, added in (getattr(backend, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False):
                specials.add(int(token_id))
        self.special_ids = frozenset(specials)
        self._special_array = np.array(sorted(specials), dtype=np.int64)
        self._tokenizer = tokenizer
        self._ends_line: dict[int, bool] = {}

    def ends_line(self, token_id: int) -> bool:
        """Whether the token's text ends with a line break (cached per id)."""
        known = self._ends_line.get(token_id)
        if known is None:
            known = self._ends_line[token_id] = self._tokenizer.token_str(token_id).endswith("\n")
        return known

    def messages(self, ids: Sequence[int]) -> list[MessageStart]:
        """Every message in `ids` that opens content, in order: after a special token, the first
        line break within MAX_HEADER tokens ends the header; the first token after it that is not
        a line break starts the content, unless it is special (an empty message)."""
        found: list[MessageStart] = []
        after = -1   # a header's scan ended here: a later special token starts the next scan
        for offset in self._special_offsets(ids):
            if offset <= after:
                continue
            end = next((probe for probe in range(offset + 1, min(len(ids), offset + 1 + MAX_HEADER))
                        if self.ends_line(ids[probe])), None)
            if end is None:
                continue
            first = end + 1
            while first < len(ids) and first - end <= MAX_HEADER and self.ends_line(ids[first]):
                first += 1
            after = first - 1
            if first < len(ids) and ids[first] not in self.special_ids and not self.ends_line(ids[first]):
                found.append(MessageStart(header=offset, content=first))
        return found

    def _special_offsets(self, ids: Sequence[int]) -> list[int]:
        """Offsets of the special tokens in `ids`, increasing: found by numpy, so that the Python
        loop of `messages` runs over about two tokens per message, not over every token."""
        if not self.special_ids or not len(ids):
            return []
        return np.flatnonzero(np.isin(np.asarray(ids, dtype=np.int64), self._special_array)).tolist()

    def content_starts(self, ids: Sequence[int]) -> list[int]:
        """Offsets, increasing, of the first content token of every message in `ids`."""
        return [message.content for message in self.messages(ids)]

    def openings(self, ids: Sequence[int], tokens: int, within: Container[int]) -> list[int]:
        """Every message's header tokens that are not special (the role and its line break) and its
        first `tokens` content tokens (cut at a special token), limited to the offsets in `within`
        (a range or a set: it is only asked `in`), increasing; none when `tokens` is 0."""
        if tokens <= 0:
            return []
        chosen: list[int] = []
        for message in self.messages(ids):
            chosen += [o for o in range(message.header, message.content)
                       if o in within and ids[o] not in self.special_ids]
            for offset in range(message.content, min(len(ids), message.content + tokens)):
                if ids[offset] in self.special_ids:
                    break
                if offset in within:
                    chosen.append(offset)
        return sorted(set(chosen))
