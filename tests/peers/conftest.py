"""The peers' OpenAI-server tests (vLLM, SGLang) against one running `kvsplice serve`: opt-in.

    python benchmarks/peer_tests.py          # the way to run them (prints passed/failed/deselected)

The default suite never collects anything here: the peers' files and the shims are ignored unless
KVSPLICE_PEER_TESTS=1, which the runner sets. With it, one `kvsplice serve --served-model-name
test-model` on the default model is started before any test file is imported (the shims read its
address from KVSPLICE_PEER_URL), every test in deselected.py is deselected with its reason, and the
server is stopped at the end. Its log goes to KVSPLICE_PEER_LOG (rejected requests leave a line there).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENABLED = os.environ.get("KVSPLICE_PEER_TESTS") == "1"
SERVED_MODEL_NAME = "test-model"
START_TIMEOUT_S = 600

collect_ignore = [] if ENABLED else ["files", "shims"]

if ENABLED:
    sys.path.insert(0, str(HERE / "shims"))
    sys.path.insert(0, str(HERE))
    from deselected import DESELECTED  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvsplice serve exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"kvsplice serve was not healthy within {timeout_s} s")


def start_server(log_path: Path) -> tuple[subprocess.Popen, str]:
    """`kvsplice serve --served-model-name test-model` on the default model and a free port, with the
    arguments in KVSPLICE_PEER_SERVER_ARGS (what the files' own fixture launches its server with)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")  # its log lines as they happen
    command = [sys.executable, "-m", "kvsplice.cli", "serve", "--served-model-name", SERVED_MODEL_NAME,
               "--port", str(port), *shlex.split(os.environ.get("KVSPLICE_PEER_SERVER_ARGS", ""))]
    log = log_path.open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, START_TIMEOUT_S)
    return process, url


def pytest_configure(config):
    """Start the server, unless KVSPLICE_PEER_URL already names one (started by the caller, with
    `--served-model-name test-model` on the default model and KVSPLICE_PEER_SERVER_ARGS)."""
    if not ENABLED:
        return
    from kvsplice.models.default_model import default_model_dir

    os.environ["KVSPLICE_PEER_MODEL_DIR"] = str(default_model_dir())
    if os.environ.get("KVSPLICE_PEER_URL"):
        return
    log_path = Path(os.environ.get("KVSPLICE_PEER_LOG", REPO / "runs" / "peer_tests" / "server.log"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    process, url = start_server(log_path)
    config._kvsplice_peer_server = process
    os.environ["KVSPLICE_PEER_URL"] = url


def pytest_runtest_logreport(report):
    """One JSON line per test phase that decides an outcome (the call; a setup or teardown that failed
    or skipped) in KVSPLICE_PEER_RESULTS, as it happens: a run stopped at its time limit still says
    what it ran."""
    path = os.environ.get("KVSPLICE_PEER_RESULTS")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        lines = (crash.message if crash is not None else str(report.longrepr)).splitlines()
        message = lines[0][:200] if lines else ""
    with open(path, "a") as out:
        out.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                              "message": message}) + "\n")


def pytest_unconfigure(config):
    process = getattr(config, "_kvsplice_peer_server", None)
    if process is not None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def deselection_reason(nodeid: str) -> str | None:
    """The reason deselected.py gives for `nodeid` (an entry names a test, a class or a whole file, by
    its path under files/ and the usual ::-separated parts; parametrized ids are covered by their test)."""
    path = nodeid.split("files/", 1)[-1]
    for entry, reason in DESELECTED.items():
        if path == entry or path.startswith(entry + "::") or path.startswith(entry + "["):
            return reason
    return None


def pytest_collection_modifyitems(config, items):
    if not ENABLED:
        return
    kept, dropped = [], []
    for item in items:
        reason = deselection_reason(item.nodeid)
        (dropped if reason else kept).append((item, reason))
    if dropped:
        config.hook.pytest_deselected(items=[item for item, _ in dropped])
        items[:] = [item for item, _ in kept]
    report = os.environ.get("KVSPLICE_PEER_DESELECTED")
    if report:
        Path(report).write_text(json.dumps({item.nodeid: reason for item, reason in dropped}, indent=1))


# Fixtures vLLM's tests/entrypoints/conftest.py provides to its OpenAI-server tests, with values of
# the same kind (a few choices, an employee-profile schema, an IPv4 address pattern).
@pytest.fixture
def sample_structured_outputs_choices() -> list[str]:
    return ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]


@pytest.fixture
def sample_json_schema() -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 3},
            "work_history": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"company": {"type": "string"}, "duration": {"type": "number"},
                                   "position": {"type": "string"}},
                    "required": ["company", "position"],
                },
            },
        },
        "required": ["name", "age", "skills", "work_history"],
    }


@pytest.fixture
def sample_regex() -> str:
    octet = r"(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
    return rf"({octet}\.){{3}}{octet}"
