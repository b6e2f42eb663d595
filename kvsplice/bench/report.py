"""Where the prompt tokens of a run went: prefix-cached, relocated (SCR) or prefilled; TTFT; prefill FLOPs.

Inputs (`load_run` tells them apart):
- a replay run (`kvsplice bench` JSONL: a header line then request records with the server's `usage`);
- a kvsplice server log (`kvsplice.start {JSON}` then one `kvsplice.request {JSON}` line per finished
  request; all other lines are ignored).

Compute types per request (the identity the report checks on every row):

    prompt_tokens = prefix (radix cache) + relocated (SCR, re-rotated K/V) + prefilled (forwarded)
    prefilled     = changed + span_tails + unchosen_spans + uncached_unchanged + recomputed   (kvsplice only)

A server without kvsplice's `reuse` field (vLLM, SGLang, OpenAI) is counted as prefix = cached_tokens,
relocated = 0, prefilled = the rest, and its breakdown is reported as unknown.

Edited turns: in a replay, turns whose edit kind is not "first"/"append". A server log has no edit kinds,
so the proxy is `session == "matched"` and (`relocated_spans > 0` or `prefix_tokens` < the previous prompt
length of the same `session_id`): the request continued a known conversation but could not reuse all of
it as a prefix. This follows the reference analysis (`edited` if radix < n_old - 64), without the margin.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, Optional

import numpy as np
from matplotlib.figure import Figure

from kvsplice.bench.trace import UNEDITED_KINDS

BREAKDOWN_FIELDS = ("changed", "span_tails", "unchosen_spans", "uncached_unchanged", "recomputed")
# fields a run written before they existed may lack (read as 0)
OPTIONAL_BREAKDOWN_FIELDS = ("recomputed",)
FLOPS_RELATIVE_TOLERANCE = 1e-3
REPLAY_EDITED_RULE = "edit kind not in ('first', 'append')"
LOG_EDITED_RULE = "session == 'matched' and (relocated_spans > 0 or prefix < previous prompt of the session)"


class RunError(ValueError):
    """A run file cannot be read as a replay run or a server log; the message says where and why."""


class Breakdown(NamedTuple):
    """Why prefilled tokens were prefilled (kvsplice's reuse counters)."""

    changed: int
    span_tails: int
    unchosen_spans: int
    uncached_unchanged: int
    recomputed: int = 0


@dataclass(frozen=True)
class Row:
    """One served request, normalised from either input format. `line_number` is its line in the file."""

    line_number: int
    conversation: str
    turn: int
    edit: Optional[str]
    edited: bool
    prompt: int
    completion: int
    prefix: int
    relocated: int
    prefilled: int
    breakdown: Optional[Breakdown]
    prefill_flops: Optional[float]
    saved_flops: Optional[float]
    ttft_s: Optional[float]
    session: Optional[str] = None   # kvsplice's usage.reuse.session: "new", "matched", "off"
    fallback: Optional[str] = None  # kvsplice's usage.reuse.fallback: why SCR did not relocate
    disk: int = 0                   # usage.reuse.disk_tokens: of prefix, loaded from the disk tier
    window_relocated: int = 0       # usage.reuse.window_relocated: of relocated, moved in sliding layers too

    @property
    def where(self) -> str:
        """A human pointer to this row for self-check messages."""
        return f"line {self.line_number} ({self.conversation} turn {self.turn})"


@dataclass(frozen=True)
class Run:
    """A loaded run: its label (file stem), input format, settings (header or start line), rows and failures."""

    label: str
    source: Literal["replay", "server_log"]
    settings: dict[str, Any]
    rows: tuple[Row, ...]
    failed: tuple[str, ...]
    n_without_usage: int
    expected_requests: Optional[int]


def _number(obj: dict[str, Any], key: str, where: str, *, optional: bool = False) -> Optional[float]:
    value = obj.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RunError(f"{where}: '{key}' must be a number, got {value!r}")
    return value


def _count(obj: dict[str, Any], key: str, where: str) -> int:
    value = _number(obj, key, where)
    if not float(value).is_integer():
        raise RunError(f"{where}: '{key}' must be an integer, got {value!r}")
    return int(value)


def _reuse_fields(reuse: dict[str, Any], where: str) -> dict[str, Any]:
    """prefix/relocated/prefilled, breakdown and FLOPs from kvsplice's reuse counters."""
    breakdown = None
    if all(reuse.get(name) is not None for name in BREAKDOWN_FIELDS if name not in OPTIONAL_BREAKDOWN_FIELDS):
        reuse = {name: 0 for name in OPTIONAL_BREAKDOWN_FIELDS} | reuse
        breakdown = Breakdown(*(_count(reuse, name, where) for name in BREAKDOWN_FIELDS))
    return {
        "prefix": _count(reuse, "prefix_tokens", where),
        "relocated": _count(reuse, "relocated_tokens", where),
        "prefilled": _count(reuse, "prefilled_tokens", where),
        "breakdown": breakdown,
        "prefill_flops": _number(reuse, "prefill_flops", where, optional=True),
        "saved_flops": _number(reuse, "saved_flops", where, optional=True),
        "session": _label(reuse, "session", where),
        "fallback": _label(reuse, "fallback", where),
        "disk": _count(reuse, "disk_tokens", where) if reuse.get("disk_tokens") is not None else 0,
        "window_relocated": (_count(reuse, "window_relocated", where)
                             if reuse.get("window_relocated") is not None else 0),
    }


def _label(obj: dict[str, Any], key: str, where: str) -> Optional[str]:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise RunError(f"{where}: '{key}' must be a string or null, got {value!r}")
    return value


def _replay_row(record: dict[str, Any], line_number: int) -> Row:
    where = f"line {line_number}"
    usage = record["usage"]
    if not isinstance(usage, dict):
        raise RunError(f"{where}: 'usage' must be an object")
    prompt = _count(usage, "prompt_tokens", where)
    reuse = usage.get("reuse")
    if isinstance(reuse, dict):
        fields = _reuse_fields(reuse, where)
    else:
        details = usage.get("prompt_tokens_details") or {}
        cached = _count(details, "cached_tokens", where) if details.get("cached_tokens") is not None else 0
        fields = {"prefix": cached, "relocated": 0, "prefilled": prompt - cached, "breakdown": None,
                  "prefill_flops": None, "saved_flops": None}
    edit = record.get("edit")
    turn = record["turn"]
    if isinstance(turn, bool) or not isinstance(turn, int) or not isinstance(edit, str):
        raise RunError(f"{where}: 'turn' must be an integer and 'edit' a string")
    return Row(line_number=line_number, conversation=str(record["conversation_id"]), turn=turn,
               edit=edit, edited=edit not in UNEDITED_KINDS, prompt=prompt,
               completion=_count(usage, "completion_tokens", where) if "completion_tokens" in usage else 0,
               ttft_s=_number(record, "ttft_s", where, optional=True), **fields)


def _parse_json(text: str, line_number: int) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as error:
        raise RunError(f"line {line_number}: bad JSON: {error.msg}") from None
    if not isinstance(obj, dict):
        raise RunError(f"line {line_number}: expected a JSON object")
    return obj


def _load_replay(lines: list[str], label: str) -> Run:
    header = _parse_json(lines[0], 1)
    rows: list[Row] = []
    failed: list[str] = []
    n_without_usage = 0
    for line_number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        record = _parse_json(line, line_number)
        if record.get("type") != "request" or "conversation_id" not in record or "turn" not in record:
            raise RunError(f"line {line_number}: not a request record (needs type, conversation_id, turn)")
        if record.get("error"):
            failed.append(f"line {line_number} ({record['conversation_id']} turn {record['turn']}): {record['error']}")
        elif record.get("usage") is None:
            n_without_usage += 1
        else:
            rows.append(_replay_row(record, line_number))
    expected = header.get("n_requests")
    return Run(label=label, source="replay", settings=header, rows=tuple(rows), failed=tuple(failed),
               n_without_usage=n_without_usage, expected_requests=expected if isinstance(expected, int) else None)


def _log_row(entry: dict[str, Any], line_number: int, turn: int, previous_prompt: Optional[int]) -> Row:
    where = f"line {line_number}"
    fields = _reuse_fields(entry, where)
    spans = entry.get("relocated_spans") or 0
    matched = entry.get("session") == "matched"
    edited = matched and (spans > 0 or (previous_prompt is not None and fields["prefix"] < previous_prompt))
    conversation = entry.get("session_id") or f"rid:{entry.get('rid')}"
    return Row(line_number=line_number, conversation=str(conversation), turn=turn, edit=None, edited=edited,
               prompt=_count(entry, "prompt_tokens", where), completion=_count(entry, "completion_tokens", where),
               ttft_s=_number(entry, "ttft_s", where, optional=True), **fields)


def _load_server_log(lines: list[str], label: str) -> Run:
    settings: dict[str, Any] = {}
    rows: list[Row] = []
    failed: list[str] = []
    previous_prompt: dict[str, int] = {}
    turns: dict[str, int] = {}
    for line_number, line in enumerate(lines, start=1):
        if line.startswith("kvsplice.start ") and not settings:
            settings = _parse_json(line[len("kvsplice.start "):], line_number)
        if not line.startswith("kvsplice.request "):
            continue
        entry = _parse_json(line[len("kvsplice.request "):], line_number)
        if entry.get("finish_reason") == "error" or entry.get("error"):
            failed.append(f"line {line_number}: rid {entry.get('rid')}: {entry.get('error') or 'error'}")
            continue
        session_id = entry.get("session_id")
        turn = turns.get(session_id, 0) if session_id else 0
        row = _log_row(entry, line_number, turn, previous_prompt.get(session_id) if session_id else None)
        if session_id:
            turns[session_id] = turn + 1
            previous_prompt[session_id] = row.prompt
        rows.append(row)
    return Run(label=label, source="server_log", settings=settings, rows=tuple(rows), failed=tuple(failed),
               n_without_usage=0, expected_requests=None)


def load_run(path: str | Path) -> Run:
    """Load a replay JSONL or a kvsplice server log from `path`, telling them apart by content.

    A replay starts with a `{"type": "header"}` line; a server log has `kvsplice.start ` /
    `kvsplice.request ` lines. Raises RunError (a ValueError) naming the line for malformed content or a
    file that is neither, OSError if the file cannot be read.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    first = next((line for line in lines if line.strip()), "")
    if first.lstrip().startswith("{") and '"header"' in first:
        header = _parse_json(first, lines.index(first) + 1)
        if header.get("type") == "header":
            return _load_replay(lines[lines.index(first):], path.stem)
    if any(line.startswith(("kvsplice.request ", "kvsplice.start ")) for line in lines):
        return _load_server_log(lines, path.stem)
    raise RunError(f"{path}: neither a replay run (header line) nor a kvsplice server log (kvsplice.request lines)")


@dataclass(frozen=True)
class TokenTotals:
    """Prompt tokens of a set of requests, by compute type."""

    requests: int = 0
    prompt: int = 0
    prefix: int = 0
    relocated: int = 0
    prefilled: int = 0
    disk: int = 0               # of prefix: loaded from the disk tier
    window_relocated: int = 0   # of relocated: moved in sliding-window layers too

    def share(self, part: str) -> float:
        """getattr(self, part) / prompt (0.0 when there are no prompt tokens)."""
        return getattr(self, part) / self.prompt if self.prompt else 0.0


def _totals(rows: list[Row] | tuple[Row, ...]) -> TokenTotals:
    return TokenTotals(requests=len(rows), prompt=sum(r.prompt for r in rows), prefix=sum(r.prefix for r in rows),
                       relocated=sum(r.relocated for r in rows), prefilled=sum(r.prefilled for r in rows),
                       disk=sum(r.disk for r in rows), window_relocated=sum(r.window_relocated for r in rows))


class Percentiles(NamedTuple):
    """p50/p90/p99 (linear interpolation) of n values."""

    n: int
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class Report:
    """Everything the report shows for one run (and, in `other`, the run it is compared with).

    `problems` lists every failed self-check, of this run and of `other` (prefixed with its label);
    empty means all identities held.
    """

    label: str
    source: str
    settings: dict[str, Any]
    edited_rule: str
    n_requests: int
    n_failed: int
    n_without_usage: int
    failed: tuple[str, ...]
    n_conversations: int
    all_turns: TokenTotals
    edited_turns: TokenTotals
    by_edit: dict[str, TokenTotals]
    breakdown: Optional[Breakdown]
    breakdown_rows: int
    prefill_flops_per_conversation: Optional[dict[str, float]]
    saved_flops: Optional[float]
    ttft: Optional[Percentiles]
    ttft_values: tuple[float, ...]
    sessions: dict[str, "SessionCounts"] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    other: Optional["Report"] = None


@dataclass(frozen=True)
class SessionCounts:
    """How a set of requests found their SCR session (usage.reuse.session: "matched", "new", "off";
    None for servers without it) and why those that relocated nothing did not (usage.reuse.fallback,
    by reason; requests that relocated nothing with no reason count under "none")."""

    requests: int
    session: dict[str, int]
    fallback: dict[str, int]

    @property
    def matched_share(self) -> float:
        """Share of the requests whose session was matched (0.0 for none)."""
        return self.session.get("matched", 0) / self.requests if self.requests else 0.0


def _session_counts(rows: list[Row] | tuple[Row, ...]) -> SessionCounts:
    kinds: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for row in rows:
        kind = row.session or "unknown"
        kinds[kind] = kinds.get(kind, 0) + 1
        if row.relocated == 0:
            reason = row.fallback or "none"
            reasons[reason] = reasons.get(reason, 0) + 1
    return SessionCounts(len(rows), dict(sorted(kinds.items())), dict(sorted(reasons.items())))


def _row_problems(row: Row) -> list[str]:
    problems = []
    counts = {"prompt": row.prompt, "completion": row.completion, "prefix": row.prefix,
              "relocated": row.relocated, "prefilled": row.prefilled}
    if row.breakdown is not None:
        counts.update(row.breakdown._asdict())
    for name, value in list(counts.items()) + [("prefill_flops", row.prefill_flops), ("saved_flops", row.saved_flops)]:
        if value is not None and value < 0:
            problems.append(f"{row.where}: {name} is negative ({value})")
    if row.prompt != row.prefix + row.relocated + row.prefilled:
        problems.append(f"{row.where}: prompt {row.prompt} != prefix {row.prefix} + relocated {row.relocated}"
                        f" + prefilled {row.prefilled}")
    if row.breakdown is not None and sum(row.breakdown) != row.prefilled:
        problems.append(f"{row.where}: breakdown {tuple(row.breakdown)} sums to {sum(row.breakdown)},"
                        f" prefilled is {row.prefilled}")
    return problems


def _group(rows: tuple[Row, ...]) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.conversation, []).append(row)
    return groups


def _two_way_problems(rows: tuple[Row, ...], groups: dict[str, list[Row]]) -> list[str]:
    """Totals summed over rows must equal totals summed over per-conversation sums."""
    problems = []
    by_rows = _totals(rows)
    conversation_totals = [_totals(group) for group in groups.values()]
    for name in ("requests", "prompt", "prefix", "relocated", "prefilled"):
        two = sum(getattr(totals, name) for totals in conversation_totals)
        if getattr(by_rows, name) != two:
            problems.append(f"total {name}: {getattr(by_rows, name)} over rows != {two} over conversations")
    flops_rows = math.fsum(r.prefill_flops or 0.0 for r in rows)
    flops_groups = math.fsum(math.fsum(r.prefill_flops or 0.0 for r in g) for g in groups.values())
    if not math.isclose(flops_rows, flops_groups, rel_tol=FLOPS_RELATIVE_TOLERANCE):
        problems.append(f"total prefill_flops: {flops_rows:.6g} over rows != {flops_groups:.6g} over conversations")
    return problems


def _run_problems(run: Run, groups: dict[str, list[Row]]) -> list[str]:
    problems = [problem for row in run.rows for problem in _row_problems(row)]
    problems += _two_way_problems(run.rows, groups)
    recorded = len(run.rows) + len(run.failed) + run.n_without_usage
    if run.expected_requests is not None and recorded != run.expected_requests:
        problems.append(f"run incomplete: {recorded} of {run.expected_requests} requests recorded")
    if not run.rows:
        problems.append("no request with usage to report on")
    return problems


def _percentiles(values: list[float]) -> Optional[Percentiles]:
    if not values:
        return None
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99])
    return Percentiles(len(values), float(p50), float(p90), float(p99))


def _breakdown_total(rows: tuple[Row, ...]) -> tuple[Optional[Breakdown], int]:
    known = [row.breakdown for row in rows if row.breakdown is not None]
    if not known:
        return None, 0
    return Breakdown(*(sum(values) for values in zip(*known))), len(known)


def build_report(run: Run, vs: Optional[Run] = None) -> Report:
    """Summarise `run` (and `vs`, as `Report.other`): token shares for all and edited turns, per edit kind,
    the prefilled breakdown, how requests found their SCR session and why those that relocated nothing
    did not (`sessions`, for all and edited turns), prefill FLOPs per conversation, TTFT percentiles, and
    the self-checks.

    Rows of failed requests and requests without usage are left out of every total and counted apart.
    Prefill FLOPs per conversation is None unless every row carries `prefill_flops`.
    """
    groups = _group(run.rows)
    kinds = sorted({row.edit for row in run.rows if row.edit is not None})
    breakdown, breakdown_rows = _breakdown_total(run.rows)
    has_flops = bool(run.rows) and all(row.prefill_flops is not None for row in run.rows)
    other = build_report(vs) if vs is not None else None
    problems = _run_problems(run, groups)
    if other is not None:
        problems += [f"OTHER ({other.label}): {problem}" for problem in other.problems]
    saved = [row.saved_flops for row in run.rows if row.saved_flops is not None]
    return Report(
        label=run.label, source=run.source, settings=run.settings,
        edited_rule=REPLAY_EDITED_RULE if run.source == "replay" else LOG_EDITED_RULE,
        n_requests=len(run.rows) + len(run.failed) + run.n_without_usage, n_failed=len(run.failed),
        n_without_usage=run.n_without_usage, failed=run.failed, n_conversations=len(groups),
        all_turns=_totals(run.rows), edited_turns=_totals([row for row in run.rows if row.edited]),
        by_edit={kind: _totals([row for row in run.rows if row.edit == kind]) for kind in kinds},
        breakdown=breakdown, breakdown_rows=breakdown_rows,
        prefill_flops_per_conversation=(
            {name: math.fsum(row.prefill_flops for row in group) for name, group in groups.items()}
            if has_flops else None),
        saved_flops=math.fsum(saved) if saved else None,
        ttft=_percentiles([row.ttft_s for row in run.rows if row.ttft_s is not None]),
        ttft_values=tuple(sorted(row.ttft_s for row in run.rows if row.ttft_s is not None)),
        sessions={"all": _session_counts(run.rows), "edited": _session_counts([r for r in run.rows if r.edited])},
        problems=problems, other=other,
    )


def _reports(report: Report) -> list[Report]:
    return [report] if report.other is None else [report, report.other]


def _token_cell(totals: TokenTotals, part: str) -> str:
    return f"{getattr(totals, part)} ({100 * totals.share(part):.1f}%)"


def _token_table(reports: list[Report]) -> list[str]:
    lines = ["| turns | run | requests | prompt tokens | prefix | relocated | prefilled |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for scope in ("all", "edited"):
        for report in reports:
            totals = report.all_turns if scope == "all" else report.edited_turns
            lines.append(f"| {scope} | {report.label} | {totals.requests} | {totals.prompt} | "
                         + " | ".join(_token_cell(totals, part) for part in ("prefix", "relocated", "prefilled"))
                         + " |")
    return lines


def _tier_window_table(reports: list[Report]) -> list[str]:
    """Where the reused K/V came from beyond the pool: prefix tokens loaded from the disk tier, and
    relocated tokens moved in the sliding-window layers too (the full layers move them all)."""
    lines = ["| turns | run | prefix | from the disk tier | relocated | moved in sliding layers too |",
             "|---|---|---:|---:|---:|---:|"]
    for scope in ("all", "edited"):
        for report in reports:
            totals = report.all_turns if scope == "all" else report.edited_turns
            disk = f"{totals.disk} ({100 * totals.disk / totals.prefix if totals.prefix else 0:.1f}%)"
            window = (f"{totals.window_relocated} "
                      f"({100 * totals.window_relocated / totals.relocated if totals.relocated else 0:.1f}%)")
            lines.append(f"| {scope} | {report.label} | {totals.prefix} | {disk} | {totals.relocated} | {window} |")
    return lines


def _breakdown_table(reports: list[Report]) -> list[str]:
    lines = ["| run | rows | prefilled | " + " | ".join(BREAKDOWN_FIELDS) + " |",
             "|---|---:|---:|" + "---:|" * len(BREAKDOWN_FIELDS)]
    for report in reports:
        if report.breakdown is None:
            lines.append(f"| {report.label} | 0 | {report.all_turns.prefilled} | "
                         + " | ".join("unknown" for _ in BREAKDOWN_FIELDS) + " |")
            continue
        prefilled = sum(report.breakdown)
        cells = [f"{value} ({100 * value / prefilled if prefilled else 0:.1f}%)" for value in report.breakdown]
        lines.append(f"| {report.label} | {report.breakdown_rows} | {prefilled} | " + " | ".join(cells) + " |")
    return lines


def _edit_table(report: Report) -> list[str]:
    # The last column splits the run's relocated share of ALL prompt tokens by edit kind (to read as
    # "of the X% reused beyond prefix hits, Y points come from reasoning stripping").
    lines = [f"| edit kind ({report.label}) | requests | prompt tokens | prefix | relocated | prefilled"
             " | relocated, % of all prompt tokens |", "|---|---:|---:|---:|---:|---:|---:|"]
    for kind, totals in report.by_edit.items():
        points = 100 * totals.relocated / report.all_turns.prompt if report.all_turns.prompt else 0.0
        lines.append(f"| {kind} | {totals.requests} | {totals.prompt} | "
                     + " | ".join(_token_cell(totals, part) for part in ("prefix", "relocated", "prefilled"))
                     + f" | {points:.2f} |")
    return lines


def _sessions_table(reports: list[Report]) -> list[str]:
    lines = ["| turns | run | requests | session matched | new | off | relocated nothing, by fallback reason |",
             "|---|---|---:|---:|---:|---:|---|"]
    for scope in ("all", "edited"):
        for report in reports:
            counts = report.sessions.get(scope)
            if counts is None:
                continue
            reasons = ", ".join(f"{reason} {count}" for reason, count in counts.fallback.items()) or "-"
            lines.append(f"| {scope} | {report.label} | {counts.requests} | {counts.session.get('matched', 0)} "
                         f"({100 * counts.matched_share:.1f}%) | {counts.session.get('new', 0)} | "
                         f"{counts.session.get('off', 0)} | {reasons} |")
    return lines


def _flops_ttft_table(reports: list[Report]) -> list[str]:
    lines = ["| run | conversations | prefill FLOPs / conversation (mean) | prefill FLOPs total | saved FLOPs total"
             " | TTFT n | p50 s | p90 s | p99 s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for report in reports:
        per_conversation = report.prefill_flops_per_conversation
        flops = ("unknown | unknown" if per_conversation is None else
                 f"{np.mean(list(per_conversation.values())):.4g} | {math.fsum(per_conversation.values()):.4g}")
        saved = "unknown" if report.saved_flops is None else f"{report.saved_flops:.4g}"
        ttft = ("0 | - | - | -" if report.ttft is None else
                f"{report.ttft.n} | {report.ttft.p50:.4f} | {report.ttft.p90:.4f} | {report.ttft.p99:.4f}")
        lines.append(f"| {report.label} | {report.n_conversations} | {flops} | {saved} | {ttft} |")
    if len(reports) == 2 and all(r.prefill_flops_per_conversation for r in reports):
        run_flops, other_flops = (math.fsum(r.prefill_flops_per_conversation.values()) for r in reports)
        if other_flops > 0:
            lines += ["", f"{reports[0].label} needs {100 * run_flops / other_flops:.1f}% of {reports[1].label}'s"
                          " prefill FLOPs (totals; comparable when both runs replayed the same trace)."]
    return lines


def format_report(report: Report) -> str:
    """The report as markdown: run summary, token shares (all/edited, RUN vs OTHER), prefilled breakdown,
    SCR sessions and fallback reasons, per edit kind, FLOPs and TTFT, failures and self-checks."""
    reports = _reports(report)
    lines = [f"# kvsplice report: {' vs '.join(r.label for r in reports)}", ""]
    for r in reports:
        settings = {key: r.settings.get(key) for key in ("model", "url", "concurrency", "scr", "reuse")
                    if r.settings.get(key) is not None}
        lines.append(f"- **{r.label}** ({r.source}): {r.n_requests} requests, {r.n_failed} failed, "
                     f"{r.n_without_usage} without usage, {r.n_conversations} conversations; "
                     f"edited turns: {r.edited_rule}; settings: {json.dumps(settings)}")
    lines += ["", "## Prompt tokens by compute type", ""] + _token_table(reports)
    if any(r.all_turns.disk or r.all_turns.window_relocated for r in reports):
        lines += ["", "## Disk tier and sliding-window layers", ""] + _tier_window_table(reports)
    lines += ["", "## Prefilled tokens breakdown", ""] + _breakdown_table(reports)
    lines += ["", "## SCR sessions and fallback reasons", ""] + _sessions_table(reports)
    for r in reports:
        if r.by_edit:
            lines += ["", f"## By edit kind: {r.label}", ""] + _edit_table(r)
    lines += ["", "## Prefill FLOPs and TTFT", ""] + _flops_ttft_table(reports)
    failures = [f for r in reports for f in r.failed]
    if failures:
        lines += ["", "## Failed requests", ""] + [f"- {failure}" for failure in failures[:50]]
    lines += ["", "## Self-checks", ""]
    lines += [f"- FAIL: {problem}" for problem in report.problems] or ["- OK: every identity held"]
    return "\n".join(lines) + "\n"


def _plot_token_shares(reports: list[Report], path: Path) -> None:
    figure = Figure(figsize=(7, 4))
    axes = figure.add_subplot()
    bars = [(scope, r, r.all_turns if scope == "all" else r.edited_turns)
            for scope in ("all", "edited") for r in reports]
    names = [f"{scope}\n{r.label}" for scope, r, _ in bars]
    bottoms = np.zeros(len(bars))
    for part, color in (("prefix", "#4c72b0"), ("relocated", "#55a868"), ("prefilled", "#c44e52")):
        shares = np.array([100 * totals.share(part) for _, _, totals in bars])
        axes.bar(names, shares, bottom=bottoms, label=part, color=color)
        bottoms += shares
    axes.set_ylabel("% of prompt tokens")
    axes.set_title("Prompt tokens by compute type")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path)


def _plot_ttft_cdf(reports: list[Report], path: Path) -> None:
    figure = Figure(figsize=(6, 4))
    axes = figure.add_subplot()
    for r in reports:
        if r.ttft_values:
            values = np.asarray(r.ttft_values)
            axes.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=r.label)
    axes.set_xlabel("TTFT (s)")
    axes.set_ylabel("fraction of requests")
    axes.set_title("Time to first token")
    if any(r.ttft_values for r in reports):
        axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def _plot_breakdown(reports: list[Report], path: Path) -> None:
    figure = Figure(figsize=(6, 4))
    axes = figure.add_subplot()
    labels = [r.label for r in reports]
    bottoms = np.zeros(len(reports))
    for offset, part in enumerate(BREAKDOWN_FIELDS):
        values = np.array([r.breakdown[offset] if r.breakdown is not None else 0 for r in reports], dtype=float)
        axes.bar(labels, values, bottom=bottoms, label=part)
        bottoms += values
    axes.set_ylabel("prefilled tokens")
    axes.set_title("Why tokens were prefilled")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def write_report(report: Report, out_dir: str | Path) -> list[Path]:
    """Write report.md, summary.json, token_shares.png, ttft_cdf.png and (when any run has a breakdown)
    prefilled_breakdown.png into `out_dir` (created if needed); return the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = _reports(report)
    written = [out_dir / "report.md", out_dir / "summary.json", out_dir / "token_shares.png", out_dir / "ttft_cdf.png"]
    written[0].write_text(format_report(report), encoding="utf-8")
    written[1].write_text(json.dumps([_summary(r) for r in reports], indent=2), encoding="utf-8")
    _plot_token_shares(reports, written[2])
    _plot_ttft_cdf(reports, written[3])
    if any(r.breakdown is not None for r in reports):
        written.append(out_dir / "prefilled_breakdown.png")
        _plot_breakdown(reports, written[-1])
    return written


def _summary(report: Report) -> dict[str, Any]:
    return {
        "label": report.label, "source": report.source, "requests": report.n_requests, "failed": report.n_failed,
        "conversations": report.n_conversations, "all_turns": asdict(report.all_turns),
        "edited_turns": asdict(report.edited_turns),
        "by_edit": {kind: asdict(totals) for kind, totals in report.by_edit.items()},
        "breakdown": None if report.breakdown is None else report.breakdown._asdict(),
        "prefill_flops_per_conversation": report.prefill_flops_per_conversation,
        "saved_flops": report.saved_flops, "ttft": None if report.ttft is None else report.ttft._asdict(),
        "sessions": {scope: asdict(counts) for scope, counts in report.sessions.items()},
        "problems": [p for p in report.problems if not p.startswith("OTHER (")],
    }
