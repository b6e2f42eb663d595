"""System messages after the start of a chat ("late" ones: Claude Code sends a system-role message between
user turns), shown the way the chat template can express them.

    [system] user  assistant  SYSTEM  user ...
                                 │
        the template renders it, its text in the prompt ──> kept: a system turn where it stands
        the template rejects it, or drops it silently    ──> folded: its text, then a blank line, then
                                                             the next user message's text (the previous
                                                             user message's, followed by it, when no user
                                                             message comes after)

Many templates take a system message only first (Gemma's and Llama 2's raise on a later one; others drop
it), so a late one is either rendered where it stands or moved into the neighbouring user turn: its text
always reaches the model. ChatRenderer (chat.py) tries the first and falls back to the second. Pure
functions on the template-ready dicts; the input lists are not changed.
"""

from __future__ import annotations

from typing import Any, Optional

Origin = Optional[tuple[int, str]]


def late_system_indices(dicts: list[dict[str, Any]]) -> list[int]:
    """Indices of the system messages after the first message."""
    return [i for i, d in enumerate(dicts) if i > 0 and d["role"] == "system"]


def shows_late_systems(dicts: list[dict[str, Any]], text: str) -> bool:
    """Whether the rendered `text` holds the content of every late system message of `dicts`."""
    return all(dicts[i]["content"].strip() in text for i in late_system_indices(dicts))


def fold_late_systems(dicts: list[dict[str, Any]], origins: list[Origin]) -> tuple[list[dict[str, Any]], list[Origin]]:
    """`dicts` with each late system message folded into a neighbouring user message (see the module
    docstring), and their origins (the user message's kept). A late system message with no user message
    on either side stays where it is."""
    out, out_origins = list(dicts), list(origins)
    for index in reversed(late_system_indices(dicts)):
        text = out[index]["content"].strip()
        following = next((i for i in range(index + 1, len(out)) if out[i]["role"] == "user"), None)
        preceding = next((i for i in range(index - 1, -1, -1) if out[i]["role"] == "user"), None)
        if following is not None:
            out[following] = {**out[following], "content": _joined(text, out[following]["content"])}
        elif preceding is not None:
            out[preceding] = {**out[preceding], "content": _joined(out[preceding]["content"], text)}
        else:
            continue
        del out[index], out_origins[index]
    return out, out_origins


def _joined(first: str, second: str) -> str:
    return f"{first}\n\n{second}" if first and second else first or second
