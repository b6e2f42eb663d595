"""vLLM's and SGLang's own OpenAI-server tests, run against one `kvsplice serve`: how far a client moves over.

    python benchmarks/peer_tests.py                       # run them; prints passed/failed/deselected
    python benchmarks/peer_tests.py --prepare vllm=~/src/vllm,sglang=~/src/sglang

The peers' test files are not part of kvsplice's repository (their code is theirs): `--prepare` copies
the files named in PEER_FILES out of local git checkouts of vLLM and SGLang, at the commits named
there, into tests/peers/files/ (ignored by git), applying the one adaptation below. The run itself
fetches nothing: it needs those files, the default model and the shims in tests/peers/shims/.

The adaptation: vLLM's files send their module's MODEL_NAME (a hub id their fixture launches) as
`model`; it becomes `test-model`, the name the kvsplice server is served under, and test_chat.py's
server fixture stops taking the fixture that downloads its LoRA adapter. SGLang's files take
their model names and server from the shimmed `sglang.test.test_utils` and are copied unchanged.
The server fixtures themselves are not edited: the shims' RemoteOpenAIServer / popen_launch_server
return the running server (tests/peers/shims/README.md).

Tests that assert a peer's own model or tokenizer outputs, its LoRA adapters, version string,
non-OpenAI endpoints or in-process Python classes are deselected, each with its reason, in
tests/peers/deselected.py; every other test is kvsplice's to pass.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
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
    """One test file of a peer: `peer` is its folder under tests/peers/files/, `repo` its GitHub
    repository, `commit` the version copied, `path` its path in that repository."""

    peer: str
    repo: str
    commit: str
    path: str

    @property
    def local(self) -> Path:
        return FILES / self.peer / self.path


VLLM, SGLANG = "vllm-project/vllm", "sgl-project/sglang"
VLLM_OPENAI = "tests/entrypoints/openai"
SGLANG_OPENAI = "test/srt/openai_server"
PEER_FILES = (
    PeerFile("vllm", VLLM, "35daaf4dd032917896c665abc01dedd7bb4a0ad8", f"{VLLM_OPENAI}/basic/test_basic.py"),
    PeerFile("vllm", VLLM, "03f5298e5c557f4fb84b83451c515329c27f1fac", f"{VLLM_OPENAI}/chat_completion/test_chat.py"),
    PeerFile("vllm", VLLM, "0c292380d4662181b001e8cfaff80f49ffbfd59c",
             f"{VLLM_OPENAI}/chat_completion/test_chat_logit_bias_validation.py"),
    PeerFile("vllm", VLLM, "37fa82dee586a01d953581f8937c528b94a2816d",
             f"{VLLM_OPENAI}/chat_completion/test_chat_stop_token_ids_validation.py"),
    PeerFile("vllm", VLLM, "10efe9463b0a2529746fe5fb81d546cf1062b06c", f"{VLLM_OPENAI}/completion/test_completion.py"),
    PeerFile("sglang", SGLANG, "0a0dd3590799de5344ff8db9b1886105d4c18af9", f"{SGLANG_OPENAI}/basic/test_openai_server.py"),
    PeerFile("sglang", SGLANG, "2d369f693bb2faa938c897cc551125ff5529769d",
             f"{SGLANG_OPENAI}/validation/test_matched_stop.py"),
    PeerFile("sglang", SGLANG, "1740f505dd07164b05607881e4235925ebdb4127",
             f"{SGLANG_OPENAI}/validation/test_openai_server_ignore_eos.py"),
    PeerFile("sglang", SGLANG, "19b0a161ab0405706dbe2c9327a2eef3942eea6a",
             f"{SGLANG_OPENAI}/validation/test_request_body_validation.py"),
    PeerFile("sglang", SGLANG, "adcc3be8bc9790d304a35ff3a16f6585af6dfcb6",
             f"{SGLANG_OPENAI}/features/test_continuous_usage_stats.py"),
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


def prepare(checkouts: dict[str, Path]) -> None:
    """Copy every PEER_FILES entry out of the local git checkout given for its peer, adapted."""
    for item in PEER_FILES:
        checkout = checkouts.get(item.peer)
        if checkout is None:
            continue
        text = subprocess.run(["git", "-C", str(checkout), "show", f"{item.commit}:{item.path}"],
                              check=True, capture_output=True, text=True).stdout
        item.local.parent.mkdir(parents=True, exist_ok=True)
        item.local.write_text(adapt(item.peer, text))
        print(f"prepared {item.peer}/{item.path} at {item.commit[:12]}")


def run_pytest(extra: list[str]) -> tuple[Path, Path, int]:
    """Run every prepared file under the peers' pytest configuration; returns the JUnit report, the
    deselection report and pytest's exit code."""
    RUNS.mkdir(parents=True, exist_ok=True)
    junit, deselected = RUNS / "junit.xml", RUNS / "deselected.json"
    env = dict(os.environ, KVSPLICE_PEER_TESTS="1", KVSPLICE_PEER_DESELECTED=str(deselected),
               KVSPLICE_PEER_LOG=str(RUNS / "server.log"), PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "pytest", "-c", str(PEERS / "pytest.ini"), "--rootdir", str(PEERS),
               "--confcutdir", str(PEERS), "-q", "--no-header", "-rN", "--tb=native", f"--junitxml={junit}",
               *[str(item.local) for item in PEER_FILES], *extra]
    code = subprocess.run(command, env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL).returncode
    return junit, deselected, code


def file_of(test_id: str) -> str:
    """`vllm/tests/.../test_chat.py` from a node id or a JUnit classname."""
    return test_id.split("files/", 1)[-1].split("::", 1)[0]


def junit_outcomes(junit: Path) -> list[tuple[str, str, str]]:
    """(file, test name, outcome, message) per JUnit testcase: outcome passed, failed or skipped."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname, name = case.get("classname") or "", case.get("name", "")
        parts = classname.split(".")
        module_at = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        path = "/".join(parts[: module_at + 1]) + ".py"
        test = "::".join([*parts[module_at + 1:], name])
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        if problem is not None:
            message = (problem.get("message") or "").strip().splitlines()
            rows.append((path.split("files/", 1)[-1], test, "failed", message[0][:160] if message else ""))
        elif case.find("skipped") is not None:
            rows.append((path.split("files/", 1)[-1], test, "skipped", ""))
        else:
            rows.append((path.split("files/", 1)[-1], test, "passed", ""))
    return rows


def report(junit: Path, deselected_path: Path) -> None:
    rows = junit_outcomes(junit)
    deselected = json.loads(deselected_path.read_text()) if deselected_path.exists() else {}
    counts: dict[str, Counter] = defaultdict(Counter)
    for path, _, outcome, _ in rows:
        counts[path][outcome] += 1
    for node in deselected:
        counts[file_of(node)]["deselected"] += 1
    print("| peer file | passed | failed | deselected |")
    print("| --- | ---: | ---: | ---: |")
    total = Counter()
    for item in PEER_FILES:
        key = f"{item.peer}/{item.path}"
        c = counts.get(key, Counter())
        total.update(c)
        print(f"| {key} | {c['passed']} | {c['failed']} | {c['deselected']} |")
    print(f"| total | {total['passed']} | {total['failed']} | {total['deselected']} |")
    if total["skipped"]:
        print(f"skipped: {total['skipped']}")
    print()
    print("failed:" if total["failed"] else "failed: none")
    for path, test, outcome, message in rows:
        if outcome == "failed":
            print(f"  {path}::{test}: {message}")
    print()
    print("deselected (tests/peers/deselected.py):")
    for node, reason in deselected.items():
        print(f"  {node.split('files/', 1)[-1]}: {reason}")


def parse_checkouts(spec: str) -> dict[str, Path]:
    pairs = (part.split("=", 1) for part in spec.split(",") if part)
    return {peer: Path(path).expanduser() for peer, path in pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", metavar="PEER=CHECKOUT,...",
                        help="copy the peers' files from local git checkouts (vllm=DIR,sglang=DIR), then exit")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (e.g. -k NAME)")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(parse_checkouts(args.prepare))
        return 0
    missing = [item for item in PEER_FILES if not item.local.exists()]
    if missing:
        print(f"{len(missing)} peer test files are not prepared (first: {missing[0].peer}/{missing[0].path}); "
              "run with --prepare vllm=CHECKOUT,sglang=CHECKOUT first", file=sys.stderr)
        return 2
    from kvsplice.bench.machine import cpu_line

    print(cpu_line())
    for item in PEER_FILES:
        print(f"{item.repo}@{item.commit[:12]} {item.path}")
    print()
    junit, deselected, _ = run_pytest(args.pytest_args)
    report(junit, deselected)
    return 0


if __name__ == "__main__":
    sys.exit(main())
