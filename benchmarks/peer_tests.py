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
# cheapest first: a run stopped at its time limit has run the most files
PEER_FILES = (
    PeerFile("vllm", VLLM, "0c292380d4662181b001e8cfaff80f49ffbfd59c",
             f"{VLLM_OPENAI}/chat_completion/test_chat_logit_bias_validation.py"),
    PeerFile("vllm", VLLM, "37fa82dee586a01d953581f8937c528b94a2816d",
             f"{VLLM_OPENAI}/chat_completion/test_chat_stop_token_ids_validation.py"),
    PeerFile("vllm", VLLM, "35daaf4dd032917896c665abc01dedd7bb4a0ad8", f"{VLLM_OPENAI}/basic/test_basic.py"),
    PeerFile("vllm", VLLM, "10efe9463b0a2529746fe5fb81d546cf1062b06c", f"{VLLM_OPENAI}/completion/test_completion.py"),
    PeerFile("sglang", SGLANG, "2d369f693bb2faa938c897cc551125ff5529769d",
             f"{SGLANG_OPENAI}/validation/test_matched_stop.py"),
    PeerFile("sglang", SGLANG, "1740f505dd07164b05607881e4235925ebdb4127",
             f"{SGLANG_OPENAI}/validation/test_openai_server_ignore_eos.py"),
    PeerFile("sglang", SGLANG, "19b0a161ab0405706dbe2c9327a2eef3942eea6a",
             f"{SGLANG_OPENAI}/validation/test_request_body_validation.py"),
    PeerFile("sglang", SGLANG, "adcc3be8bc9790d304a35ff3a16f6585af6dfcb6",
             f"{SGLANG_OPENAI}/features/test_continuous_usage_stats.py"),
    PeerFile("vllm", VLLM, "03f5298e5c557f4fb84b83451c515329c27f1fac", f"{VLLM_OPENAI}/chat_completion/test_chat.py"),
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


def run_pytest(extra: list[str], url: str | None, time_limit_s: float) -> tuple[Path, Path, bool]:
    """Run every prepared file under the peers' pytest configuration, stopped after `time_limit_s`;
    returns the per-test results (JSON lines), the deselection report and whether it ran to the end."""
    RUNS.mkdir(parents=True, exist_ok=True)
    results, deselected = RUNS / "results.jsonl", RUNS / "deselected.json"
    results.unlink(missing_ok=True)
    env = dict(os.environ, KVSPLICE_PEER_TESTS="1", KVSPLICE_PEER_DESELECTED=str(deselected),
               KVSPLICE_PEER_RESULTS=str(results), KVSPLICE_PEER_LOG=str(RUNS / "server.log"),
               PYTHONPATH=str(ROOT))
    env.pop("KVSPLICE_PEER_URL", None)
    if url:
        env["KVSPLICE_PEER_URL"] = url
    command = [sys.executable, "-m", "pytest", "-c", str(PEERS / "pytest.ini"), "--rootdir", str(PEERS),
               "--confcutdir", str(PEERS), "-q", "--no-header", "-rN", "--tb=native",
               *[str(item.local) for item in PEER_FILES], *extra]
    process = subprocess.Popen(command, env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL)
    try:
        process.wait(timeout=time_limit_s)
        finished = True
    except subprocess.TimeoutExpired:
        process.terminate()  # pytest_unconfigure stops the server it started
        process.wait(timeout=60)
        finished = False
    return results, deselected, finished


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


def report(results: Path, deselected_path: Path, finished: bool) -> None:
    ran = outcomes(results)
    deselected = json.loads(deselected_path.read_text()) if deselected_path.exists() else {}
    counts: dict[str, Counter] = defaultdict(Counter)
    for node, (outcome, _) in ran.items():
        counts[file_of(node)][outcome] += 1
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


def parse_checkouts(spec: str) -> dict[str, Path]:
    pairs = (part.split("=", 1) for part in spec.split(",") if part)
    return {peer: Path(path).expanduser() for peer, path in pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", metavar="PEER=CHECKOUT,...",
                        help="copy the peers' files from local git checkouts (vllm=DIR,sglang=DIR), then exit")
    parser.add_argument("--url", help="a running `kvsplice serve --served-model-name test-model` to use "
                                      "instead of starting one")
    parser.add_argument("--time-limit-s", type=float, default=3600,
                        help="stop the run after this long and report what ran (default 3600)")
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
    results, deselected, finished = run_pytest(args.pytest_args, args.url, args.time_limit_s)
    report(results, deselected, finished)
    return 0


if __name__ == "__main__":
    sys.exit(main())
