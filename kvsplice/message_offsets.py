"""Where each chat message starts in a prompt's token ids: two answers for two uses.

From the messages (`message_offsets`): where render(m0 .. m(k-1)) ends in the prompt, verified
against the prompt's own tokens. A hybrid model saves its linear layers' state there
(`kvsplice.cache.checkpoint_policy`). Needs the message list and the chat template.

From the tokens alone (`MessageStarts`): each message's header and first content token, found by
the template's shape (a special token, a role, a line break). SCR's selective recompute
(`kvsplice.reuse.recompute`, through the ReuseManager) recomputes these openings inside relocated
spans. Needs neither the messages nor a template, so raw-prompt requests (`/v1/completions`) get
them too.

## From the messages

A hybrid model saves its linear layers' state at these offsets (`kvsplice.cache.checkpoint_policy`), so a
later prompt that edits message k resumes from message k's start. The chat template decides how messages
become text, and templates may merge, reorder or re-render content (a default system prompt, reasoning
dropped from earlier turns, consecutive messages joined), so an offset is kept only where it is verified:
the rendering of the first k messages is a prefix of the full rendering, and it ends on a token boundary of
the prompt's own tokens.

    messages          [m0][m1][m2]            rendered alone: render(m0), render(m0 m1), render(m0 m1 m2)
    prompt text       <m0 text><m1 text><m2 text><reply opening>
    prompt tokens     t0 t1 .. | .. | .. |  ..                  offsets: where render(m0 .. m(k-1)) ends
                              k=1  k=2 k=3 (the reply starts)

Offset 0 (the first message) is not reported: the state there is the zero state. Correctness never depends
on the offsets (a checkpoint is the exact state of the prompt's own prefix, whatever the offset); they only
decide where states are saved.

Two paths give the same answer: `message_offsets` (one tokenization of the prompt with character offsets,
O(messages) template renders) and `message_offsets_reference` (tokenizes every prefix rendering and compares
token ids; O(messages x prompt) tokenization, much slower on long agent chats). Tests compare them.

## From the tokens alone

Selective recompute computes again the opening of every message that lies inside a relocated span:
the header tokens that are not special (the role and its line break) and the first content
token(s). After a deletion, a question about the removed content attends to the openings of the
messages around it ("Documentation of ..."), and a relocated opening still carries what it saw
of the removed text; recomputing the openings lowers SCR's mean KL on edited agent chats for a
little more of the prompt computed (docs/BENCHMARKS.md, "Selective recompute on fresh workload
cases"). The role and line break are recomputed too because a recomputed first token still
attends to its stale header. The special token is left alone: recomputing <|im_start|> as well
cost more for a higher KL (both variants: docs/BENCHMARKS_HISTORY.md, "Selective recompute on
fresh workload cases").

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
from typing import Any, Callable, Container, Optional, Sequence

import numpy as np

from kvsplice.tokenizer import Tokenizer

# render(messages, add_generation_prompt) -> the chat's text; ValueError when the template rejects them
Render = Callable[[Sequence[dict[str, Any]], bool], str]


def _model_render(tokenizer: Tokenizer, tools: Optional[list[dict[str, Any]]]) -> Render:
    """The model's own chat template over template-ready dicts."""
    return lambda messages, add_generation_prompt: tokenizer.render_chat(
        list(messages), tools, add_generation_prompt=add_generation_prompt)


def _prefix_texts(render: Render, messages: Sequence[dict[str, Any]]) -> list[Optional[str]]:
    """render(messages[:k]) without the generation prompt for k = 1..len(messages), None where the
    template rejects the prefix (e.g. one that needs a user message)."""
    texts: list[Optional[str]] = []
    for k in range(1, len(messages) + 1):
        try:
            texts.append(render(messages[:k], False))
        except ValueError:
            texts.append(None)
    return texts


def _token_starts(tokenizer: Tokenizer, text: str, prompt_ids: Sequence[int]) -> Optional[dict[int, int]]:
    """{character offset: token offset} of every token boundary of `text`'s tokenization (a token that
    starts there with every earlier token ending at or before it), or None when the tokenizer gives no
    character offsets or its tokens are not `prompt_ids`."""
    backend = tokenizer.backend
    if not getattr(backend, "is_fast", False):
        return None
    encoding = backend(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(encoding["input_ids"]) != list(prompt_ids):
        return None
    starts, reach = {}, 0
    for token_offset, (start, end) in enumerate(encoding["offset_mapping"]):
        if start >= reach and start not in starts:
            starts[start] = token_offset
        reach = max(reach, end)
    return starts


def message_offsets(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], prompt_ids: Sequence[int],
                    tools: Optional[list[dict[str, Any]]] = None, render: Optional[Render] = None) -> list[int]:
    """Increasing offsets into `prompt_ids` (the chat rendered with the generation prompt) where messages
    1..n-1 start and where the reply starts, each verified (see the module docstring); unverifiable ones
    are left out. Falls back to `message_offsets_reference` for tokenizers without character offsets.
    `messages` are template-ready dicts (`kvsplice.server.chat.message_dicts`); `render` renders them
    (default: the model's template with `tools`; the server passes its ChatRenderer's, which may use
    another template and normalised messages)."""
    render = render or _model_render(tokenizer, tools)
    full_text = render(messages, True)
    starts = _token_starts(tokenizer, full_text, prompt_ids)
    if starts is None:
        return message_offsets_reference(tokenizer, messages, prompt_ids, tools, render)
    found = set()
    for text in _prefix_texts(render, messages):
        if text is not None and full_text.startswith(text) and len(text) in starts:
            found.add(starts[len(text)])
    return sorted(o for o in found if 0 < o < len(prompt_ids))


def message_offsets_reference(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                              prompt_ids: Sequence[int], tools: Optional[list[dict[str, Any]]] = None,
                              render: Optional[Render] = None) -> list[int]:
    """The same offsets by brute force: tokenize each prefix rendering and keep its length where its
    token ids are a prefix of `prompt_ids`."""
    prompt_ids = list(prompt_ids)
    found = set()
    for text in _prefix_texts(render or _model_render(tokenizer, tools), messages):
        if text is None:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        if prompt_ids[: len(ids)] == ids:
            found.add(len(ids))
    return sorted(o for o in found if 0 < o < len(prompt_ids))


# ----- from the tokens alone --------------------------------------------------------------
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
