"""vLLM's and SGLang's own OpenAI-server tests, run against one `kvsplice serve`: how far a client moves over.

    python benchmarks/peer_tests.py                       # run them; prints passed/failed/deselected
    python benchmarks/peer_tests.py --prepare sglang=~/src/sglang      # SGLang's files, once
    python benchmarks/peer_tests.py --prepare vllm=pypi                # re-copy vLLM's (committed)

vLLM's files come from its sdist on PyPI (vllm-0.34.0.tar.gz, sha256 pinned in VLLM_SDIST), where vLLM
publishes its tests under the Apache License 2.0: they are committed, adapted, under
tests/peers/files/vllm/ with vLLM's LICENSE. SGLang's sdist does not carry its tests, so its files are
copied out of a local git checkout at the commits named in PEER_FILES into tests/peers/files/sglang/
(ignored by git: kvsplice commits no code taken from a repository snapshot). Without them the run
covers vLLM's files only and says so. The run itself fetches nothing: it needs those files, the
default model and the shims in tests/peers/shims/.

The adaptation: vLLM's files send their module's MODEL_NAME (a hub id their fixture launches) as
`model`; it becomes `test-model`, the name the kvsplice server is served under, and test_chat.py's
server fixture stops taking the fixture that downloads its LoRA adapter. SGLang's files take
their model names and server from the shimmed `sglang.test.test_utils` and are copied unchanged.
The server fixtures themselves are not edited: the shims' RemoteOpenAIServer / popen_launch_server
return the running server (tests/peers/shims/README.md). A file whose fixture launches its server with
settings of its own (`server_args` in PEER_FILES: kvsplice's flags for them) runs in a pytest of its
own, after the others, against a server started with those flags.

Tests that assert a peer's own model or tokenizer outputs, its LoRA adapters, version string,
non-OpenAI endpoints or in-process Python classes are deselected, each with its reason, in
tests/peers/deselected.py; every other test is kvsplice's to pass.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "tests" / "peers"
FILES = PEERS / "files"
RUNS = ROOT / "runs" / "peer_tests"
SERVED_MODEL_NAME = "test-model"
MODEL_NAME_LINE = re.compile(r'^MODEL_NAME = "(?P<name>[^"]+)"$', re.MULTILINE)
SERVER_WITH_LORA = re.compile(r"^def server\(zephyr_lora_files\):", re.MULTILINE)


@dataclass(frozen=True)
class PeerFile:
    """One test file of a peer: `peer` is its folder under tests/peers/files/, `source` where it was
    copied from (a PyPI sdist or a GitHub repository), `version` which release or commit, `path` its
    path in that source. `server_args`: kvsplice serve's arguments for what the file's fixture launches
    its server with, where that differs from the shared server (such a file gets a server of its own)."""

    peer: str
    source: str
    version: str
    path: str
    server_args: tuple[str, ...] = ()

    @property
    def local(self) -> Path:
        return FILES / self.peer / self.path


@dataclass(frozen=True)
class Sdist:
    """A peer's source distribution on PyPI, which carries its tests: the file, its address, its sha256."""

    name: str
    url: str
    sha256: str


# vLLM publishes its tests in its sdist on PyPI: the adapted files are committed under
# tests/peers/files/vllm/ with vLLM's LICENSE. SGLang's sdist holds only its package (no test/), so
# its files are prepared from a local git checkout and stay out of the repository (ignored by git).
VLLM_SDIST = Sdist("vllm-0.34.0.tar.gz",
                   "https://files.pythonhosted.org/packages/92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87"
                   "f8dc622eff/vllm-0.34.0.tar.gz",
                   "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113")
VLLM, SGLANG = "pypi:vllm", "sgl-project/sglang"
VLLM_OPENAI = "tests/entrypoints/openai"
SGLANG_OPENAI = "test/srt/openai_server"
# cheapest first: a run stopped at its time limit has run the most files
PEER_FILES = (
    PeerFile("vllm", VLLM, "0.34.0", f"{VLLM_OPENAI}/chat_completion/test_chat_logit_bias_validation.py"),
    PeerFile("vllm", VLLM, "0.34.0", "tests/entrypoints/serve/instrumentator/test_basic.py"),
    PeerFile("vllm", VLLM, "0.34.0", f"{VLLM_OPENAI}/completion/test_completion.py"),
    PeerFile("sglang", SGLANG, "2d369f693bb2faa938c897cc551125ff5529769d",
             f"{SGLANG_OPENAI}/validation/test_matched_stop.py"),
    PeerFile("sglang", SGLANG, "1740f505dd07164b05607881e4235925ebdb4127",
             f"{SGLANG_OPENAI}/validation/test_openai_server_ignore_eos.py"),
    PeerFile("sglang", SGLANG, "19b0a161ab0405706dbe2c9327a2eef3942eea6a",
             f"{SGLANG_OPENAI}/validation/test_request_body_validation.py",
             ("--max-body-bytes", "1024")),     # its fixture: --max-payload-size 1024
    PeerFile("sglang", SGLANG, "adcc3be8bc9790d304a35ff3a16f6585af6dfcb6",
             f"{SGLANG_OPENAI}/features/test_continuous_usage_stats.py"),
    PeerFile("vllm", VLLM, "0.34.0", f"{VLLM_OPENAI}/chat_completion/test_chat.py"),
    PeerFile("sglang", SGLANG, "0a0dd3590799de5344ff8db9b1886105d4c18af9", f"{SGLANG_OPENAI}/basic/test_openai_server.py"),
)


def adapt(peer: str, text: str) -> str:
    """vLLM's MODEL_NAME (and every other quote of the same hub id in the file) becomes the served name,
    and a server fixture that takes the LoRA download fixture no longer takes it (the server is running
    already; the LoRA tests are deselected)."""
    if peer != "vllm":
        return text
    match = MODEL_NAME_LINE.search(text)
    if match is not None:
        text = text.replace(f'"{match["name"]}"', f'"{SERVED_MODEL_NAME}"')
    return SERVER_WITH_LORA.sub("def server():", text)


def sdist_members(sdist: Sdist, where: str) -> tarfile.TarFile:
    """The sdist as an open tar archive: `where` is a local copy of it, or "pypi" to download it. Its
    sha256 must be the one pinned in `sdist`, else SystemExit (a CLI message, exit 2)."""
    data = (urllib.request.urlopen(sdist.url, timeout=300).read() if where == "pypi"
            else Path(where).expanduser().read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != sdist.sha256:
        print(f"{sdist.name}: sha256 {digest} is not the pinned {sdist.sha256}", file=sys.stderr)
        raise SystemExit(2)
    return tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")


def prepare_vllm(where: str) -> None:
    """Copy vLLM's PEER_FILES (and its LICENSE) out of its sdist, adapted, into tests/peers/files/vllm/."""
    root = VLLM_SDIST.name.removesuffix(".tar.gz")
    with sdist_members(VLLM_SDIST, where) as archive:
        for item in (item for item in PEER_FILES if item.peer == "vllm"):
            text = archive.extractfile(f"{root}/{item.path}").read().decode()
            item.local.parent.mkdir(parents=True, exist_ok=True)
            item.local.write_text(adapt(item.peer, text))
            print(f"prepared vllm/{item.path} from {VLLM_SDIST.name}")
        (FILES / "vllm" / "LICENSE").write_bytes(archive.extractfile(f"{root}/LICENSE").read())


def prepare_from_git(peer: str, checkout: Path) -> None:
    """Copy `peer`'s PEER_FILES out of its local git checkout at the commits named there, or, where
    `checkout` is a plain folder (no git history), from `checkout/<path>`: a copy of each file as
    stored at its PEER_FILES commit, which whoever made the folder vouches for."""
    from_git = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--git-dir"],
                              capture_output=True).returncode == 0
    for item in (item for item in PEER_FILES if item.peer == peer):
        text = (subprocess.run(["git", "-C", str(checkout), "show", f"{item.version}:{item.path}"],
                               check=True, capture_output=True, text=True).stdout
                if from_git else (checkout / item.path).read_text())
        item.local.parent.mkdir(parents=True, exist_ok=True)
        item.local.write_text(adapt(item.peer, text))
        print(f"prepared {item.peer}/{item.path} at {item.version[:12]}")


def prepare(sources: dict[str, str]) -> None:
    """`sources`: vllm -> its sdist (a path, or "pypi"); sglang -> a local git checkout."""
    if "vllm" in sources:
        prepare_vllm(sources["vllm"])
    if "sglang" in sources:
        prepare_from_git("sglang", Path(sources["sglang"]).expanduser())


def run_pytest(files: tuple[PeerFile, ...], extra: list[str], url: str | None, time_limit_s: float,
               results: Path, deselected: Path, server_args: tuple[str, ...] = ()) -> tuple[bool, int]:
    """Run `files` under the peers' pytest configuration against one server (`url`, or one started
    with `server_args`), stopped after `time_limit_s`; appends the per-test results (JSON lines) to
    `results`, writes the deselection report to `deselected`; returns whether it ran to the end and
    pytest's exit status."""
    log = RUNS / ("server.log" if not server_args else f"server-{'-'.join(server_args).strip('-')}.log")
    env = dict(os.environ, KVSPLICE_PEER_TESTS="1", KVSPLICE_PEER_DESELECTED=str(deselected),
               KVSPLICE_PEER_RESULTS=str(results), KVSPLICE_PEER_LOG=str(log),
               KVSPLICE_PEER_SERVER_ARGS=shlex.join(server_args),
               # the repository first; a PYTHONPATH already set (e.g. where the `peers` extra is installed) after it
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    env.pop("KVSPLICE_PEER_URL", None)
    if url and not server_args:     # a given server has the default settings
        env["KVSPLICE_PEER_URL"] = url
    command = [sys.executable, "-m", "pytest", "-c", str(PEERS / "pytest.ini"), "--rootdir", str(PEERS),
               "--confcutdir", str(PEERS), "-q", "--no-header", "-rN", "--tb=native",
               *[str(item.local) for item in files], *extra]
    process = subprocess.Popen(command, env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL)
    try:
        process.wait(timeout=time_limit_s)
        finished = True
    except subprocess.TimeoutExpired:
        process.terminate()  # pytest_unconfigure stops the server it started
        process.wait(timeout=60)
        finished = False
    return finished, process.returncode


def run_all(files: tuple[PeerFile, ...], extra: list[str], url: str | None,
            time_limit_s: float) -> tuple[Path, dict[str, str], bool, list[str]]:
    """Run `files`, one pytest (and server) per distinct `server_args`, the shared server's first,
    within `time_limit_s` in all; returns the results (JSON lines), the deselections, whether every
    run ran to the end, and a line for each pytest that stopped before its tests (a collection error)."""
    RUNS.mkdir(parents=True, exist_ok=True)
    results = RUNS / "results.jsonl"
    results.unlink(missing_ok=True)
    deadline = time.monotonic() + time_limit_s
    groups = sorted({item.server_args for item in files}, key=len)
    deselected: dict[str, str] = {}
    finished, broken = True, []
    for server_args in groups:
        report_path = RUNS / f"deselected-{groups.index(server_args)}.json"
        report_path.unlink(missing_ok=True)
        group = tuple(item for item in files if item.server_args == server_args)
        left = deadline - time.monotonic()
        finished, status = run_pytest(group, extra, url, left, results, report_path, server_args) if left > 0 else (False, 0)
        if finished and status not in (0, 1, 5):    # 2: interrupted (a collection error), 3, 4: pytest's own
            broken.append(f"pytest exited with {status} before running {', '.join(item.path for item in group)}")
        deselected.update(json.loads(report_path.read_text()) if report_path.exists() else {})
        if not finished:
            break
    return results, deselected, finished, broken


def file_of(test_id: str) -> str:
    """`vllm/tests/.../test_chat.py` from a node id."""
    return test_id.split("files/", 1)[-1].split("::", 1)[0]


def outcomes(results: Path) -> dict[str, tuple[str, str]]:
    """node id -> (passed | failed | skipped, first line of the failure) from the results' JSON lines."""
    seen: dict[str, tuple[str, str]] = {}
    lines = results.read_text().splitlines() if results.exists() else []
    for row in map(json.loads, lines):
        outcome = row["outcome"]
        if seen.get(row["nodeid"], ("",))[0] == "failed":
            continue
        seen[row["nodeid"]] = (outcome, row["message"] if outcome == "failed" else "")
    return seen


def report(files: tuple[PeerFile, ...], results: Path, deselected: dict[str, str], finished: bool) -> None:
    ran = outcomes(results)
    counts: dict[str, Counter] = defaultdict(Counter)
    for node, (outcome, _) in ran.items():
        counts[file_of(node)][outcome] += 1
    for node in deselected:
        counts[file_of(node)]["deselected"] += 1
    print("| peer file | passed | failed | deselected |")
    print("| --- | ---: | ---: | ---: |")
    total = Counter()
    for item in files:
        key = f"{item.peer}/{item.path}"
        c = counts.get(key, Counter())
        total.update(c)
        print(f"| {key} | {c['passed']} | {c['failed']} | {c['deselected']} |")
    print(f"| total | {total['passed']} | {total['failed']} | {total['deselected']} |")
    if total["skipped"]:
        print(f"skipped: {total['skipped']}")
    if not finished:
        print("stopped at the time limit: the tests after the last one counted did not run")
    print()
    print("failed:" if total["failed"] else "failed: none")
    for node, (outcome, message) in ran.items():
        if outcome == "failed":
            print(f"  {node.split('files/', 1)[-1]}: {message}")
    print()
    print("deselected (tests/peers/deselected.py):")
    for node, reason in deselected.items():
        print(f"  {node.split('files/', 1)[-1]}: {reason}")


def parse_sources(spec: str) -> dict[str, str]:
    """"vllm=pypi,sglang=~/src/sglang" -> {peer: where}; an unknown peer is a CLI error (exit 2)."""
    pairs = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    unknown = sorted(set(pairs) - {"vllm", "sglang"})
    if unknown or not pairs:
        print(f"--prepare: expected vllm=SDIST|pypi and/or sglang=CHECKOUT, got {spec!r}", file=sys.stderr)
        raise SystemExit(2)
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", metavar="PEER=WHERE,...",
                        help="copy the peers' files, then exit: vllm=pypi (or a local copy of its sdist), "
                             "sglang=a local git checkout (or a folder of the files at their paths)")
    parser.add_argument("--url", help="a running `kvsplice serve --served-model-name test-model` to use "
                                      "instead of starting one")
    parser.add_argument("--time-limit-s", type=float, default=3600,
                        help="stop the run after this long and report what ran (default 3600)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (e.g. -k NAME)")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(parse_sources(args.prepare))
        return 0
    prepared = tuple(item for item in PEER_FILES if item.local.exists())
    if not prepared:
        print("no peer test files are prepared: run with --prepare vllm=pypi,sglang=CHECKOUT first", file=sys.stderr)
        return 2
    from kvsplice.bench.machine import cpu_line

    print(cpu_line())
    for item in PEER_FILES:
        state = "" if item in prepared else "   (not prepared: not run)"
        state += f"   (its own server: {shlex.join(item.server_args)})" if item.server_args else ""
        print(f"{item.source}@{item.version[:12]} {item.path}{state}")
    print()
    results, deselected, finished, broken = run_all(prepared, args.pytest_args, args.url, args.time_limit_s)
    report(prepared, results, deselected, finished)
    for line in broken:     # a collection error: rerun those files with pytest to see it
        print(f"{line} (is the `peers` extra installed?)", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
