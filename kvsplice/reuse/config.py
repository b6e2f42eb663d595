"""Settings of Suffix Cache Reuse (SCR): one frozen dataclass and one typed table of env variables.

The defaults follow the SCR overlay's `config.DEFAULTS` (see shared/reference/scr-reference-notes.md
§1); each `ENV_TABLE` entry names the overlay's `KVREUSE_*` variable it replaces, so a deployment
tuned for the overlay keeps its meaning here. `min_span` is the minimum *relocated* length: a
surviving span needs at least `min_span + tail` equal tokens (80 with the defaults), as in the
overlay's `len - kext >= MIN_TAIL` rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, NamedTuple

from kvsplice.cache.checkpoint_policy import DEFAULT_POLICY, CheckpointPolicy

StateMode = Literal["fork", "checkpoint", "none"]
STATE_MODES: tuple[str, ...] = ("fork", "checkpoint", "none")


@dataclass(frozen=True)
class ReuseConfig:
    """All SCR settings. Construction validates every field and raises ValueError on bad values;
    every field has a lower and an upper bound (`_INT_RANGE`, fractions in [0, 1])."""

    enabled: bool = True
    max_spans: int = 6  # K: spans relocated per request (per span_scale_tokens of prompt), the longest first
    # K may grow with the prompt: a prompt of n tokens relocates at most K * ceil(n / span_scale_tokens)
    # spans (0, the default: K whatever the length). On Gemma 3's 16K-token edited chats, K per 2,048
    # tokens computes 4.3% of the prompts against 19.4% with K fixed, at a mean KL of 0.011 against
    # 0.009 (a chat with every reasoning block stripped: 0.041 against 0.033; docs/BENCHMARKS_HISTORY.md)
    span_scale_tokens: int = 0
    tail: int = 16  # last tokens of each span recomputed instead of relocated (>= 1)
    min_span: int = 64  # minimum relocated length of a span
    max_sessions: int = 16  # tracked conversations (LRU by count)
    session_max_tokens: int = 1_000_000  # cap on all sessions' private tokens (LRU by memory)
    # session matching by content (kvsplice.reuse.session_match): evidence, overlap, coverage
    match_min_tokens: int = 64  # prompt tokens in distinctive content the session must hold
    match_min_ratio: float = 0.5  # overlap: share of the prompt the diff keeps from the session
    match_min_coverage: float = 0.3  # share of the session's sequence the prompt keeps
    match_ambig_margin: float = 0.15  # a rival keeping almost as much (this share of the prompt): no match
    match_max_postings: int = 8  # a chunk held by more sessions is common content: ignored
    match_max_candidates: int = 4  # sessions verified by a token diff per request
    # a control experiment, wrong on purpose: relocate keys without the RoPE delta rotation. Set
    # only in code (tests, the fidelity harness): no request field, flag or environment variable
    no_rerotate: bool = False
    fastdiff_min: int = 2048  # chunk-level diff when both sequences are at least this long
    cdc_target: int = 64  # mean chunk size of the content-defined chunking (a power of 2)
    # hybrid (linear-attention) models: the state a linear layer resumes from after a relocated
    # span (fork: the previous sequence's final state; checkpoint: the previous turn's saved state
    # nearest before the span's old end; none: keep the running state)
    state_mode: StateMode = "checkpoint"
    # hybrid models: where state checkpoints are saved during prefill ("messages", "every:N" or
    # both joined by "+"; see kvsplice.cache.checkpoint_policy) and how many the radix tree keeps
    checkpoint_policy: str = DEFAULT_POLICY
    checkpoint_max_states: int = 64
    # selective recompute (kvsplice.reuse.recompute): tokens computed again in every layer after
    # relocation: the first `seam_tokens` of every relocated span (a span that directly follows
    # removed, i.e. deleted or replaced, old text gets a seam of `removed_seam_tokens` instead, when
    # that is longer), and the role, line break and first `message_start_tokens` content tokens of
    # every message inside a relocated span from the first edit on (kvsplice.message_offsets.MessageStarts)
    seam_tokens: int = 8
    removed_seam_tokens: int = 0
    message_start_tokens: int = 1

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            check_field(spec.name, getattr(self, spec.name))

    @property
    def match_chunk_tokens(self) -> int:
        """Mean content-chunk size of the session index: a quarter of match_min_tokens rounded down
        to a power of 2, at least 4. Content shared by many sessions is found chunk by chunk, so a
        shared stretch leaves at most about one chunk at each end undetected: well under the
        evidence a match needs."""
        return max(4, 1 << (max(1, self.match_min_tokens // 4).bit_length() - 1))

    @property
    def match_min_run(self) -> int:
        """Shortest equal run that counts when a match is verified: a quarter of match_min_tokens
        (shorter equal runs are what any two texts share by chance)."""
        return max(1, self.match_min_tokens // 4)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], base: ReuseConfig | None = None) -> ReuseConfig:
        """Return `base` (default: the defaults) with every `ENV_TABLE` variable present in `environ`
        applied. A value that does not parse or is out of range raises ValueError naming the variable."""
        overrides: dict[str, Any] = {}
        retired = sorted(name for name in RETIRED_ENV if name in environ)
        if retired:
            raise ValueError(f"{retired[0]}: {RETIRED_ENV[retired[0]]}")
        for entry in ENV_TABLE:
            if entry.name not in environ:
                continue
            raw = environ[entry.name]
            try:
                value = entry.parser(raw)
                check_field(entry.field, value)
            except ValueError as exc:
                raise ValueError(f"{entry.name}={raw!r}: {exc}") from None
            overrides[entry.field] = value
        return (base or cls()).replace(**overrides)

    def span_limit(self, prompt_len: int) -> int:
        """The most spans a prompt of `prompt_len` tokens relocates: max_spans per started
        span_scale_tokens of prompt (max_spans itself when span_scale_tokens is 0 or the prompt is
        at most that long), capped at the bound of max_spans."""
        if self.span_scale_tokens == 0:
            return self.max_spans
        scale = max(1, -(-prompt_len // self.span_scale_tokens))
        return min(self.max_spans * scale, _INT_RANGE["max_spans"][1])

    def checkpoints(self) -> CheckpointPolicy:
        """The state checkpoint policy (`checkpoint_policy` parsed, with its memory cap)."""
        return CheckpointPolicy.parse(self.checkpoint_policy, self.checkpoint_max_states)

    def replace(self, **overrides: Any) -> ReuseConfig:
        """A copy with `overrides` applied and validated; unknown names or bad values raise ValueError."""
        unknown = sorted(set(overrides) - set(FIELD_TYPES))
        if unknown:
            raise ValueError(f"unknown SCR setting(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides)

    def describe(self) -> str:
        """One line `scr key=value ...` with every setting, for the server's start-up banner."""
        parts = []
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            parts.append(f"{spec.name}={int(value) if isinstance(value, bool) else value}")
        return "scr " + " ".join(parts)


FIELD_TYPES: dict[str, type] = {
    "enabled": bool,
    "max_spans": int,
    "span_scale_tokens": int,
    "tail": int,
    "min_span": int,
    "max_sessions": int,
    "session_max_tokens": int,
    "match_min_tokens": int,
    "match_min_ratio": float,
    "match_min_coverage": float,
    "match_ambig_margin": float,
    "match_max_postings": int,
    "match_max_candidates": int,
    "no_rerotate": bool,
    "fastdiff_min": int,
    "cdc_target": int,
    "state_mode": str,
    "checkpoint_policy": str,
    "checkpoint_max_states": int,
    "seam_tokens": int,
    "removed_seam_tokens": int,
    "message_start_tokens": int,
}

# Every setting's range, inclusive. Lower bounds: tail >= 1 keeps the prompt's last token computed.
# Upper bounds keep every value inside what the code can represent and what makes sense:
# token counts (spans, windows, thresholds, spacing) at most MAX_TOKENS, longer than any model's
# context; cdc_target at most 2**16 (a chunk mean beyond that finds no chunk inside real prompts,
# and the rolling hash's bit mask must fit 64 bits); at most 1,024 relocated spans per request;
# at most 2**20 tracked sessions and 2**32 private session tokens (beyond any pool's memory);
# at most 2**20 state checkpoints (one is megabytes on a real hybrid); fractions and margins in
# [0, 1] (they compare token overlaps, which lie in [0, 1]). Selective recompute: at most 4,096
# seam tokens per span (the error sits in the first few dozen tokens after a seam) and at most 64
# recomputed tokens at each message's start (one holds the error measured there).
MAX_TOKENS = 1 << 22
_INT_RANGE = {
    "max_spans": (0, 1024),
    "span_scale_tokens": (0, MAX_TOKENS),
    "tail": (1, MAX_TOKENS),
    "min_span": (1, MAX_TOKENS),
    "max_sessions": (1, 1 << 20),
    "session_max_tokens": (0, 1 << 32),
    "match_min_tokens": (1, MAX_TOKENS),
    "match_max_postings": (1, 1 << 20),  # holders of one chunk: at most max_sessions' own bound
    "match_max_candidates": (1, 64),  # token diffs per request: each costs up to one prompt's diff
    "fastdiff_min": (0, MAX_TOKENS),
    "cdc_target": (4, 1 << 16),
    "checkpoint_max_states": (0, 1 << 20),
    "seam_tokens": (0, 4096),
    "removed_seam_tokens": (0, 4096),
    "message_start_tokens": (0, 64),
}
_FLOAT_RANGE = (0.0, 1.0)


class SettingError(ValueError):
    """A bad SCR setting; `param` names it as the request spells it (e.g. "scr.cdc_target")."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_field(name: str, value: Any, label: str | None = None) -> None:
    """Raise SettingError (a ValueError) unless `value` has the type of setting `name` and lies in its
    range (see _INT_RANGE; fractions in [0, 1]). Booleans are not accepted as numbers, and numbers are
    not accepted as booleans. `label`: how the message names the setting (default: `name`)."""
    label = label or name
    kind = FIELD_TYPES.get(name)
    if kind is None:
        raise SettingError(f"unknown SCR setting: {label}", label)
    if name == "checkpoint_policy":
        if not isinstance(value, str):
            raise SettingError(f"{label} must be a string, got {value!r}", label)
        try:
            CheckpointPolicy.parse(value)
        except ValueError as exc:
            raise SettingError(f"{label}: {exc}", label) from None
        return
    if kind is str:
        if value not in STATE_MODES:
            raise SettingError(f"{label} must be one of {', '.join(STATE_MODES)}, got {value!r}", label)
        return
    if kind is bool:
        if not isinstance(value, bool):
            raise SettingError(f"{label} must be a boolean, got {value!r}", label)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise SettingError(f"{label} must be {'a number' if kind is float else 'an integer'}, got {value!r}", label)
    lower, upper = _FLOAT_RANGE if kind is float else _INT_RANGE[name]
    if not lower <= value <= upper:  # NaN fails too
        raise SettingError(f"{label} must lie in [{lower}, {upper}], got {value!r}", label)
    if name == "cdc_target" and value & (value - 1):
        raise SettingError(f"{label} must be a power of 2 (it is used as a bit mask), got {value!r}", label)


def parse_str(raw: str) -> str:
    """An environment string, stripped and lower-cased (checked by the field's own rule)."""
    return raw.strip().lower()


def parse_bool(raw: str) -> bool:
    """Parse an environment boolean: 1/0, true/false, yes/no, on/off (any case)."""
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")


def parse_int(raw: str) -> int:
    """Parse a base-10 integer (underscores allowed, e.g. 1_000_000)."""
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"expected an integer, got {raw!r}") from None


def parse_float(raw: str) -> float:
    """Parse a decimal number."""
    try:
        return float(raw.strip())
    except ValueError:
        raise ValueError(f"expected a number, got {raw!r}") from None


class EnvVar(NamedTuple):
    """One environment variable: its name, the ReuseConfig field it sets, the parser from text,
    the command-line flag the CLI should offer for it, and a help text."""

    name: str
    field: str
    parser: Callable[[str], Any]
    flag: str
    help: str


ENV_TABLE: tuple[EnvVar, ...] = (
    EnvVar("KVREUSE_ENABLED", "enabled", parse_bool, "--scr-enabled", "turn Suffix Cache Reuse on or off"),
    EnvVar("KVREUSE_MAX_BLOCKS", "max_spans", parse_int, "--scr-max-spans",
           "K: surviving spans relocated per request, the longest first (per KVREUSE_SPAN_SCALE_TOKENS of prompt "
           "where set)"),
    EnvVar("KVREUSE_SPAN_SCALE_TOKENS", "span_scale_tokens", parse_int, "--scr-span-scale-tokens",
           "K applies per this many prompt tokens: a prompt of n tokens relocates at most "
           "K * ceil(n / this) spans (0: K whatever the prompt's length)"),
    EnvVar("KVREUSE_V6_MIN_EXTEND", "tail", parse_int, "--scr-tail",
           "last tokens of each relocated span that are recomputed (>= 1)"),
    EnvVar("KVREUSE_V6_MIN_TAIL", "min_span", parse_int, "--scr-min-span",
           "minimum relocated length of a span (a span needs min_span + tail equal tokens)"),
    EnvVar("KVREUSE_MAX_SESSIONS", "max_sessions", parse_int, "--scr-max-sessions",
           "tracked conversations, evicted least recently used first"),
    EnvVar("KVREUSE_SESSION_MAX_TOKENS", "session_max_tokens", parse_int, "--scr-session-max-tokens",
           "cap on the private (relocatable) tokens held by all sessions together"),
    EnvVar("KVREUSE_MATCH_MIN_TOKENS", "match_min_tokens", parse_int, "--scr-match-min-tokens",
           "session matching: prompt tokens of distinctive (not common) content the session must hold"),
    EnvVar("KVREUSE_MATCH_MIN_RATIO", "match_min_ratio", parse_float, "--scr-match-min-ratio",
           "session matching: minimum share of the prompt the diff keeps from the session"),
    EnvVar("KVREUSE_MATCH_MIN_COVERAGE", "match_min_coverage", parse_float, "--scr-match-min-coverage",
           "session matching: minimum share of the session's sequence the prompt keeps"),
    EnvVar("KVREUSE_MATCH_AMBIG_MARGIN", "match_ambig_margin", parse_float, "--scr-match-ambig-margin",
           "session matching: no match if another session keeps almost as much (fewer than "
           "match_min_tokens tokens less and at most this share of the prompt less)"),
    EnvVar("KVREUSE_MATCH_MAX_POSTINGS", "match_max_postings", parse_int, "--scr-match-max-postings",
           "session matching: content held by more sessions than this is common and ignored"),
    EnvVar("KVREUSE_MATCH_MAX_CANDIDATES", "match_max_candidates", parse_int, "--scr-match-max-candidates",
           "session matching: sessions verified by a token diff per request"),
    EnvVar("KVREUSE_FASTDIFF_MIN", "fastdiff_min", parse_int, "--scr-fastdiff-min",
           "use the chunk-level diff when both sequences have at least this many tokens"),
    EnvVar("KVREUSE_CDC_TARGET", "cdc_target", parse_int, "--scr-cdc-target",
           "mean chunk size of the content-defined chunking (a power of 2)"),
    EnvVar("KVREUSE_SSM_MODE", "state_mode", parse_str, "--scr-state-mode",
           "hybrid models: linear-layer state after a relocated span (fork, checkpoint, none)"),
    EnvVar("KVREUSE_SSM_CHECKPOINT_POLICY", "checkpoint_policy", parse_str, "--scr-checkpoint-policy",
           "hybrid models: where linear-layer state checkpoints are saved: messages (message starts), "
           "every:N (every N prompt tokens) or both, e.g. messages+every:256 (request ends always)"),
    EnvVar("KVREUSE_SSM_CHECKPOINT_MAX_STATES", "checkpoint_max_states", parse_int, "--scr-checkpoint-max-states",
           "hybrid models: most state checkpoints the prefix cache keeps (state slots; least useful dropped first)"),
    # selective recompute: no overlay counterpart
    EnvVar("KVREUSE_SEAM_TOKENS", "seam_tokens", parse_int, "--scr-seam-tokens",
           "tokens recomputed at the start of every relocated span, right after its seam (attention-only models)"),
    EnvVar("KVREUSE_REMOVED_SEAM_TOKENS", "removed_seam_tokens", parse_int, "--scr-removed-seam-tokens",
           "seam of a relocated span that follows removed (deleted or replaced) old text, when longer "
           "than --scr-seam-tokens (attention-only models)"),
    EnvVar("KVREUSE_MESSAGE_START_TOKENS", "message_start_tokens", parse_int, "--scr-message-start-tokens",
           "content tokens recomputed, with the role and line break, at the start of every message "
           "inside an edited relocated span (0: none; attention-only models)"),
)

# Variables of the SCR overlay that no longer apply: setting one is an error, never silently ignored.
RETIRED_ENV: dict[str, str] = {
    name: "no longer used: sessions are matched by content anywhere in the prompt, not by a common "
          "prefix (see KVREUSE_MATCH_MIN_TOKENS, KVREUSE_MATCH_MIN_RATIO, KVREUSE_MATCH_MIN_COVERAGE); unset it"
    for name in ("KVREUSE_MATCH_WINDOW", "KVREUSE_MATCH_MIN_PREFIX_FRAC", "KVREUSE_MATCH_MIN_OVERLAP")
}

# Control experiments, wrong on purpose: set only in code (tests, the fidelity harness), never by an
# environment variable, a flag or a request.
CONTROL_FIELDS = frozenset({"no_rerotate"})

# Settings a single request may override; the rest belong to the whole server (session store).
REQUEST_FIELDS = frozenset({"enabled", "max_spans", "span_scale_tokens", "tail", "min_span", "fastdiff_min", "cdc_target",
                            "state_mode", "seam_tokens", "removed_seam_tokens", "message_start_tokens"})

SALT_OFF = "kvreuse:off"


def parse_request_override(scr: str | dict | None, cache_salt: str | None, base: ReuseConfig) -> ReuseConfig:
    """The settings for one request.

    `scr="off"` or `cache_salt == "kvreuse:off"` (the overlay's salt form) turns SCR off; `scr="on"`
    keeps `base`; a dict of per-request settings (names in REQUEST_FIELDS, e.g. {"max_spans": 2,
    "tail": 8}) overrides `base`. Unknown or server-wide keys, bad types and
    out-of-range values (see _INT_RANGE for the bounds) raise SettingError, a ValueError naming the
    field (the server answers 400). The salt stays the request's cache namespace; that is the
    caller's business.
    """
    config = base
    if isinstance(scr, str):
        if scr not in ("on", "off"):
            raise SettingError(f"scr must be 'on', 'off' or an object of settings, got {scr!r}", "scr")
        if scr == "off":
            config = config.replace(enabled=False)
    elif isinstance(scr, dict):
        bad = sorted(str(key) for key in scr if key not in REQUEST_FIELDS)
        if bad:
            raise SettingError(
                f"scr: unknown or server-wide setting(s) {', '.join(bad)}; "
                f"allowed per request: {', '.join(sorted(REQUEST_FIELDS))}", f"scr.{bad[0]}"
            )
        for key, value in scr.items():
            check_field(key, value, label=f"scr.{key}")
        config = config.replace(**scr)
    elif scr is not None:
        raise SettingError(f"scr must be a string, an object or null, got {type(scr).__name__}", "scr")
    if cache_salt == SALT_OFF:
        config = config.replace(enabled=False)
    return config
