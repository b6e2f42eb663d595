"""The user docs cannot go stale silently: every `kvsplice serve` flag, SCR variable, request field kvsplice
adds, `usage.reuse` field, route and metric is checked against the code that defines it, links resolve,
and no development notes slip in."""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import runpy
import tokenize
from pathlib import Path
from types import SimpleNamespace

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


BENCHMARKS = DOCS / "BENCHMARKS.md"
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def run_all_module() -> SimpleNamespace:
    """The globals of benchmarks/run_all.py, the script that assembles docs/BENCHMARKS.md (benchmarks/
    is no package; runpy gives its dataclasses the module they need while it runs)."""
    return SimpleNamespace(**runpy.run_path(str(ROOT / "benchmarks" / "run_all.py"), run_name="run_all"))


def headline_bullets(text: str) -> list[str]:
    """The bullets of the '## Headline figures' section of `text`, each on one line."""
    section = text.split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    return [" ".join(item.split()) for item in re.split(r"\n- ", "\n" + section.strip())[1:]]


def test_benchmarks_page_fits_its_budget():
    size = len(BENCHMARKS.read_bytes())
    assert size <= run_all_module().PAGE_BUDGET <= 40_000, f"docs/BENCHMARKS.md is {size:,} bytes"


def test_benchmarks_page_is_what_run_all_assembles_from_the_stored_outputs():
    assert run_all_module().assemble() == BENCHMARKS.read_text(), \
        "docs/BENCHMARKS.md is out of date: run python benchmarks/run_all.py --assemble-only"


def test_every_benchmark_section_names_its_setting_date_and_command():
    sections = BENCHMARKS.read_text().split("\n## ")[2:]  # after the introduction and the headlines
    assert len(sections) == len(run_all_module().BENCHMARKS)
    for section in sections:
        title = section.splitlines()[0]
        assert "\nSetting: " in section and re.search(r" Measured 20\d\d-\d\d-\d\d ", section), title
        assert "```bash\n" in section, title


def test_readme_quotes_the_benchmarks_headlines():
    readme = headline_bullets((ROOT / "README.md").read_text())
    page = headline_bullets(BENCHMARKS.read_text())
    assert readme and readme == page, "README.md's headline figures must be docs/BENCHMARKS.md's, word for word"


def test_every_headline_figure_is_in_a_section_of_the_benchmarks_page():
    text = BENCHMARKS.read_text()
    body = text.split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[1].replace(",", "")
    found = set(NUMBER.findall(body))
    missing = [(number, bullet[:40]) for bullet in headline_bullets(text)
               for number in NUMBER.findall(bullet) if number.replace(",", "") not in found]
    assert not missing, f"headline figures no section of docs/BENCHMARKS.md shows: {missing}"


# measured figures (timings, speed-ups, throughput, KL values, CPU names) that belong in
# docs/BENCHMARKS.md or docs/BENCHMARKS_HISTORY.md; docstrings and comments state contracts and may
# point there. Numbers that define something (defaults, limits, sizes by construction) do not match.
MEASURED_FIGURE = re.compile(
    r"\d+(?:\.\d+)?\s?(?:ms|us|µs)\b|\b\d+(?:\.\d+)?-\d+(?:\.\d+)?\s?s\b|\b\d+\.\d+x\b|"
    r"\b\d+(?:\.\d+)?x (?:faster|slower|as long|more|less)\b|\d\.\d+(?:e-\d+)?\s?nats\b|"
    r"\d\s?(?:tokens|tok)/s\b|\d\s?GB/s\b|Sapphire Rapids|\bXeon\b|\bEPYC\b|\bRyzen\b")


def docstrings_and_comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every module, class and function docstring line and every comment of `path`."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                first = node.body[0].lineno
                found += [(first + i, line) for i, line in enumerate(docstring.splitlines())]
    found += [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
              if token.type == tokenize.COMMENT]
    return found


def test_no_measured_figures_in_code_docstrings_or_comments():
    found = [f"{path.relative_to(ROOT)}:{line}: {text.strip()}"
             for path in sorted((ROOT / "kvsplice").rglob("*.py"))
             for line, text in docstrings_and_comments(path) if MEASURED_FIGURE.search(text)]
    assert not found, ("measured figures belong in docs/BENCHMARKS.md (or docs/BENCHMARKS_HISTORY.md); "
                       f"point to the section instead: {found}")


# a pointer from code to a benchmark section: BENCHMARKS.md, "Title" (and "Other title")
SECTION_POINTER = re.compile(r'(BENCHMARKS(?:_HISTORY)?\.md),? ((?:"[^"]+"(?:,? and |, )?)+)')


def test_benchmark_sections_named_in_code_exist():
    headings = {page: {line[3:].strip() for line in (DOCS / page).read_text().splitlines() if line.startswith("## ")}
                for page in ("BENCHMARKS.md", "BENCHMARKS_HISTORY.md")}
    missing = []
    for path in sorted((ROOT / "kvsplice").rglob("*.py")):
        text = " ".join(re.sub(r"\n\s*#\s?", " ", path.read_text()).split())  # comments joined, as prose
        for page, titles in SECTION_POINTER.findall(text):
            missing += [f"{path.relative_to(ROOT)}: {page}, {title!r}" for title in re.findall(r'"([^"]+)"', titles)
                        if title not in headings[page]]
    assert not missing, f"no such section: {missing}"
