"""Where each chat message starts in the prompt's token ids, verified against those tokens.

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
token ids; O(messages x prompt) tokenization, about 20x slower on 40-message agent chats). Tests compare them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

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

