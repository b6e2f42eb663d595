"""Stop regexes (SGLang's `stop_regex`): the output ends right before the first match of any pattern.

The detokenizer calls this beside its stop strings, on the text it has not released yet:

    released text ...........|  pending (held + new)  |
          context (64 chars) ^ pos                     ^ end
    first_match:  the earliest complete match starting at or after `pos` (the context only lets
                  lookbehinds and \\b see what came before); the output is cut at its start
    hold_from:    where a partial match starts (the `regex` module's partial matching: the text's end
                  could still grow into a match); the text from there on is withheld, at most
                  MAX_HOLD characters, exactly as a stop string's possible beginning is withheld

So a stream and a non-streamed reply agree, and a match is never cut out of text already sent, as
long as it is at most MAX_HOLD characters long. Patterns use the `regex` module (a superset of `re`),
compiled once per request. Each search runs under a time limit (SEARCH_TIMEOUT_S) over a bounded
text: a pattern that cannot be tested in time counts as not matching at that step (logged once per
request), so one hostile pattern cannot stall the engine thread that serves everyone.
"""

from __future__ import annotations

import logging
from typing import Optional

import regex

log = logging.getLogger(__name__)

CONTEXT_CHARS = 64  # released text a search sees before `pos` (lookbehinds, \b, ^)
MAX_HOLD = 1024  # the most pending text a partial match may withhold
SEARCH_TIMEOUT_S = 0.05  # a plain search of this window takes microseconds; this bounds a hostile one


def compile_stop_regex(pattern: str) -> "regex.Pattern[str]":
    """The compiled pattern; ValueError naming `stop_regex` when it does not compile or matches ""."""
    try:
        compiled = regex.compile(pattern)
    except regex.error as error:
        raise ValueError(f"stop_regex: {pattern!r} does not compile: {error}") from error
    if compiled.fullmatch("") is not None:
        raise ValueError(f"stop_regex: {pattern!r} matches the empty string (it would stop before the first token)")
    return compiled


class StopPatterns:
    """A request's stop regexes, searched in the detokenizer's pending text (see the module docstring)."""

    def __init__(self, patterns: tuple[str, ...], timeout_s: float = SEARCH_TIMEOUT_S) -> None:
        """ValueError (naming `stop_regex`) for a pattern that does not compile or matches "".
        `timeout_s` bounds each search (wall clock)."""
        self.patterns = tuple(patterns)
        self.timeout_s = timeout_s
        self._compiled = tuple(compile_stop_regex(pattern) for pattern in patterns)
        self._timed_out = False

    def first_match(self, released: str, pending: str) -> Optional[tuple[int, str]]:
        """(offset in `pending`, pattern) of the earliest complete match starting in `pending`, or None.
        On equal offsets the earlier pattern wins."""
        text, pos = self._window(released, pending)
        best: Optional[tuple[int, str]] = None
        for pattern, compiled in zip(self.patterns, self._compiled):
            match = self._first_nonempty(compiled, text, pos)
            if match is not None and (best is None or match.start() - pos < best[0]):
                best = (match.start() - pos, pattern)
        return best

    def _first_nonempty(self, compiled, text: str, pos: int):
        """The earliest match from `pos` that spans at least one character (`\\b` alone never stops)."""
        while pos <= len(text):
            match = self._search(compiled, text, pos, partial=False)
            if match is None or match.end() > match.start():
                return match
            pos = match.start() + 1
        return None

    def hold_from(self, released: str, pending: str) -> int:
        """Offset in `pending` from which the text could still become a match (len(pending): none)."""
        text, pos = self._window(released, pending)
        start = len(text)
        for compiled in self._compiled:
            match = self._search(compiled, text, max(pos, len(text) - MAX_HOLD), partial=True)
            if match is not None and match.partial and match.start() < match.end():
                start = min(start, match.start())
        return start - pos

    @staticmethod
    def _window(released: str, pending: str) -> tuple[str, int]:
        context = released[-CONTEXT_CHARS:]
        return context + pending, len(context)

    def _search(self, compiled, text: str, pos: int, partial: bool):
        try:
            return compiled.search(text, pos, partial=partial, timeout=self.timeout_s)
        except TimeoutError:
            if not self._timed_out:
                self._timed_out = True
                log.warning("stop_regex %r took over %.0f ms on %d characters: not matched at this step",
                            compiled.pattern, self.timeout_s * 1000, len(text) - pos)
            return None
