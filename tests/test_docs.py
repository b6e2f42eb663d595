"""The user docs cannot go stale silently: every `kvsplice serve` flag, SCR variable, request field kvsplice
adds, `usage.reuse` field, route and metric is checked against the code that defines it, links resolve,
and no development notes slip in."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvsplice.cli import build_parser
from kvsplice.reuse.accounting import ReuseStats
from kvsplice.reuse.config import ENV_TABLE, REQUEST_FIELDS
from kvsplice.server.metrics import EngineSnapshot, ServerMetrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SERVING = DOCS / "SERVING.md"
METRICS = DOCS / "METRICS.md"
USER_DOCS = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((DOCS / "benchmarks").glob("*.md"))]
# phrases of notes written for the people building kvsplice, not for its users
DEVELOPMENT_NOTES = re.compile(
    r"\bthe lead\b|\blead's\b|\bhelpers?\b|\bsubagents?\b|\bissues?\b|\bbacklog\b|\bTODO\b|\bFIXME\b|"
    r"\bseed's\b|\bengineers?\b|\bthis session\b", re.IGNORECASE)
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"\{[^}]*\}")


def serve_parser():
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command")
    return subcommands.choices["serve"]


def documented(text: str, literal: str) -> bool:
    """`literal` appears in backticks, as the first thing inside them (`--flag VALUE`, `name`)."""
    return re.search(rf"`{re.escape(literal)}(?![\w-])", text) is not None


def test_readme_opens_with_the_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```")[1]
    assert readme.index("```") < readme.index("\n## ")
    assert "pip install -e ." in first_block and "kvsplice serve" in first_block
    assert 'pip install -e ".[test]"' in first_block and "python -m pytest" in first_block


def test_every_serve_flag_is_in_serving_md():
    text = SERVING.read_text()
    flags = [opt for action in serve_parser()._actions for opt in action.option_strings
             if opt not in ("-h", "--help")]
    assert len(flags) > 20
    missing = [flag for flag in flags if not documented(text, flag)]
    assert not missing, f"document these kvsplice serve flags in docs/SERVING.md: {missing}"


def test_every_scr_variable_and_per_request_key_is_in_serving_md():
    text = SERVING.read_text()
    assert not [e.name for e in ENV_TABLE if not documented(text, e.name)]
    assert not [key for key in sorted(REQUEST_FIELDS) if not documented(text, key)]
    for field in ("cache_salt", "session_id", "scr", "X-SMG-Routing-Key", "kvreuse:off"):
        assert documented(text, field), field


def test_the_scr_variable_table_matches_env_table():
    """The table of SCR variables lists every ENV_TABLE entry once, with its setting, default and flag."""
    from kvsplice.reuse.config import ReuseConfig

    text = SERVING.read_text().split("### SCR settings by environment variable", 1)[1].split("\n#", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in text.splitlines()
            if line.startswith("| `KVREUSE_")]
    documented_rows = {row[0].strip("`"): (row[1].strip("`"), row[2], row[3].split("`")[1]) for row in rows}
    expected = {}
    for entry in ENV_TABLE:
        value = getattr(ReuseConfig(), entry.field)
        expected[entry.name] = (entry.field, str(int(value)) if isinstance(value, bool) else str(value), entry.flag)
    assert len(rows) == len(documented_rows) and documented_rows == expected


def test_every_usage_reuse_field_is_in_serving_md():
    text = SERVING.read_text()
    fields = [f.name for f in dataclasses.fields(ReuseStats)]
    assert not [name for name in fields if not documented(text, name)]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from kvsplice.config import EngineConfig
    from kvsplice.engine.llm import build_engine
    from kvsplice.server.api import create_app
    from tests.tiny_model import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("docs_model"))
    return create_app(build_engine(EngineConfig(model=str(model_dir), num_slots=256)))


def test_every_route_is_in_serving_md(app):
    text = PLACEHOLDER.sub("{}", SERVING.read_text())
    routes = [f"{method} {PLACEHOLDER.sub('{}', route.path)}" for route in app.routes
              for method in sorted(getattr(route, "methods", None) or ()) if method != "HEAD"]
    assert len(routes) > 15
    missing = [route for route in routes if f"`{route}`" not in text]
    assert not missing, f"document these routes in docs/SERVING.md: {missing}"


def exported_series() -> set[str]:
    """Every series name the server exports (counters with their _total)."""
    from prometheus_client.parser import text_string_to_metric_families

    snapshot = EngineSnapshot(counters={}, num_running=0, num_waiting=0, slots_total=1, slots_in_use=0,
                              slots_free=1, slots_cached=0)
    text = ServerMetrics("m").render(snapshot).decode()
    return {f.name + "_total" if f.type == "counter" else f.name for f in text_string_to_metric_families(text)}


def test_metrics_md_lists_every_series_and_only_real_ones():
    text = METRICS.read_text()
    series = exported_series()
    assert not [name for name in sorted(series) if not documented(text, name)]
    named = set(re.findall(r"`(kvsplice_[a-z0-9_]+)", text)) | set(re.findall(r"/(kvsplice_[a-z0-9_]+)/g", text))
    assert named and not named - series, f"METRICS.md names series that do not exist: {named - series}"


def test_no_development_notes_in_user_docs():
    found = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}"
             for path in USER_DOCS for text in [path.read_text()] for match in DEVELOPMENT_NOTES.finditer(text)]
    assert not found, f"notes for the project's developers, not its users: {found}"


def test_relative_links_resolve():
    broken = []
    for path in USER_DOCS:
        # benchmark notes are pasted into docs/BENCHMARKS.md: their links are relative to docs/
        base = DOCS if path.parent.name == "benchmarks" else path.parent
        for target in MARKDOWN_LINK.findall(path.read_text()):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            if not (base / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken
