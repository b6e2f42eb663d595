"""Several kvsplice replicas behind sglang-router on one machine: start, wait for, and stop the processes.

    replicas (kvsplice serve --replica-name rN)    router (python -m sglang_router.launch_router)
        http://127.0.0.1:P1  ─┐
        http://127.0.0.1:P2  ─┼──  --worker-urls ...  --policy cache_aware  ──  http://127.0.0.1:PORT/v1
        http://127.0.0.1:P3  ─┘

The router is SGLang's (pip install sglang-router), not a kvsplice one. `python -m kvsplice.bench.scale_out`
starts N replicas and the router, prints their URLs and runs until interrupted (scripts/scale_out.sh wraps
it); the tests and benchmarks/router_policies.py use `start_router` / `start_replica` directly.
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

import httpx

from kvsplice.server.launch import free_port

RouterPolicy = Literal["random", "round_robin", "cache_aware", "power_of_two", "manual"]
ROUTER_POLICIES: tuple[str, ...] = ("random", "round_robin", "cache_aware", "power_of_two", "manual")
# The header sglang-router's `manual` policy maps to a worker (sticky per key; also consistent_hashing's
# key in later router versions).
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def router_available() -> bool:
    """True when the `sglang_router` package (pip install sglang-router) is importable."""
    return importlib.util.find_spec("sglang_router") is not None


@dataclass(frozen=True)
class RouterOptions:
    """sglang-router flags that matter for kvsplice replicas.

    health_check_endpoint: '/health' (liveness) or '/readiness' (the engine answers between steps).
    health_check_interval_s / health_failure_threshold: a dead replica is dropped after about
        interval * threshold seconds; retries (retry_max_retries, backoff capped at retry_max_backoff_ms)
        carry requests that hit it in between to another replica.
    extra_args: further router flags, passed as they are.
    """

    policy: RouterPolicy = "cache_aware"
    health_check_endpoint: str = "/health"
    health_check_interval_s: int = 1
    health_failure_threshold: int = 1
    health_success_threshold: int = 1
    retry_max_retries: int = 8
    retry_max_backoff_ms: int = 500
    log_level: Literal["debug", "info", "warn", "error"] = "warn"
    extra_args: tuple[str, ...] = ()


def router_command(worker_urls: Sequence[str], host: str, port: int, prometheus_port: int,
                   options: RouterOptions) -> list[str]:
    """The argv that starts sglang-router in plain HTTP mode over `worker_urls`. ValueError for an unknown
    policy or an empty worker list."""
    if options.policy not in ROUTER_POLICIES:
        raise ValueError(f"policy must be one of {ROUTER_POLICIES}, got {options.policy!r}")
    if not worker_urls:
        raise ValueError("worker_urls must name at least one replica")
    return [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", host, "--port", str(port), "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
        "--worker-urls", *worker_urls, "--policy", options.policy,
        "--health-check-endpoint", options.health_check_endpoint,
        "--health-check-interval-secs", str(options.health_check_interval_s),
        "--health-failure-threshold", str(options.health_failure_threshold),
        "--health-success-threshold", str(options.health_success_threshold),
        "--retry-max-retries", str(options.retry_max_retries),
        "--retry-max-backoff-ms", str(options.retry_max_backoff_ms),
        "--worker-startup-check-interval", "1", "--log-level", options.log_level, *options.extra_args,
    ]


@dataclass
class ManagedProcess:
    """A child process with a base URL; `stop()` ends it (SIGTERM, then SIGKILL) and closes its log."""

    name: str
    url: str
    process: subprocess.Popen
    log_path: Optional[Path] = None
    _log_file: Optional[object] = field(default=None, repr=False)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the process (kill it if it outlives `timeout_s`); safe to call twice."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """SIGKILL the process at once (a replica dying mid-run)."""
        if self.alive():
            self.process.kill()
            self.process.wait(10)

    def log_text(self) -> str:
        """The process's output so far ('' when it was not logged to a file)."""
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""


def _spawn(name: str, url: str, argv: list[str], log_path: Optional[Path]) -> ManagedProcess:
    log_file = open(log_path, "w") if log_path is not None else subprocess.DEVNULL
    process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    return ManagedProcess(name, url, process, log_path, log_file if log_path is not None else None)


def wait_until(check, what: str, timeout_s: float, process: Optional[ManagedProcess] = None) -> None:
    """Poll `check()` (a callable returning bool, exceptions count as False) every 0.2 s until it is True;
    RuntimeError naming `what` after `timeout_s` or when `process` exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            pass
        if process is not None and not process.alive():
            raise RuntimeError(f"{what}: the process exited with {process.process.returncode}\n"
                               f"{process.log_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.2)


def healthy_workers(router_url: str) -> list[str]:
    """URLs of the workers the router lists as healthy (GET /workers)."""
    workers = httpx.get(f"{router_url}/workers", timeout=5).json()["workers"]
    return [worker["url"] for worker in workers if worker["is_healthy"]]


def start_router(worker_urls: Sequence[str], options: RouterOptions = RouterOptions(), host: str = "127.0.0.1",
                 port: Optional[int] = None, log_path: Optional[Path] = None,
                 ready_timeout_s: float = 60.0) -> ManagedProcess:
    """Start sglang-router over `worker_urls` and return once it lists all of them as healthy. The
    replicas must already answer /health. RuntimeError (after stopping the router) when it does not get
    there within `ready_timeout_s`."""
    port = port or free_port(host)
    argv = router_command(worker_urls, host, port, free_port(host), options)
    router = _spawn("router", f"http://{host}:{port}", argv, log_path)
    try:
        wait_until(lambda: len(healthy_workers(router.url)) == len(worker_urls), "router ready",
                   ready_timeout_s, router)
    except BaseException:
        router.stop()
        raise
    return router


def replica_command(model: str, host: str, port: int, replica_name: str, engine_args: Sequence[str] = ()) -> list[str]:
    """The argv of one `kvsplice serve` replica."""
    return [sys.executable, "-m", "kvsplice.cli", "serve", "--model", model, "--host", host, "--port", str(port),
            "--replica-name", replica_name, *engine_args]


def start_replica(model: str, replica_name: str, host: str = "127.0.0.1", port: Optional[int] = None,
                  engine_args: Sequence[str] = (), log_path: Optional[Path] = None,
                  ready_timeout_s: float = 300.0) -> ManagedProcess:
    """Start `kvsplice serve` in a child process and return once GET /readiness answers 200. RuntimeError
    (after stopping it) when it exits or is not ready within `ready_timeout_s`."""
    port = port or free_port(host)
    replica = _spawn(replica_name, f"http://{host}:{port}",
                     replica_command(model, host, port, replica_name, engine_args), log_path)
    try:
        wait_until(lambda: httpx.get(f"{replica.url}/readiness", timeout=5).status_code == 200,
                   f"replica {replica_name} ready", ready_timeout_s, replica)
    except BaseException:
        replica.stop()
        raise
    return replica


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvsplice.bench.scale_out",
                                     description="Start N kvsplice replicas and sglang-router on this machine.")
    parser.add_argument("--model", required=True, help="model for every replica (kvsplice serve --model)")
    parser.add_argument("--replicas", type=int, default=3, help="number of replicas (default 3)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="router port (default 30000)")
    parser.add_argument("--first-replica-port", type=int, default=8001, help="replica ports count up from here")
    parser.add_argument("--policy", choices=ROUTER_POLICIES, default="cache_aware")
    parser.add_argument("--health-check-endpoint", default="/readiness")
    parser.add_argument("--log-dir", default="scale_out_logs", help="one log file per process (default ./scale_out_logs)")
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help="after `--`: flags passed to every `kvsplice serve` (e.g. -- --num-slots 65536)")
    return parser


def _interrupt(signum, frame) -> None:
    """SIGTERM handler: stop like Ctrl-C, so `finally` stops the children."""
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    """Start the replicas, then the router; print the URLs; stop everything on Ctrl-C / SIGTERM."""
    args = _parser().parse_args(argv)
    if not router_available():
        print("sglang-router is not installed: pip install sglang-router==0.3.2", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("--replicas must be >= 1", file=sys.stderr)
        return 2
    engine_args = [arg for arg in args.engine_args if arg != "--"]
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    processes: list[ManagedProcess] = []
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for number in range(args.replicas):
            name = f"r{number}"
            processes.append(start_replica(args.model, name, args.host, args.first_replica_port + number,
                                           engine_args, log_dir / f"{name}.log"))
            print(f"replica {name}: {processes[-1].url}  (log {log_dir / f'{name}.log'})", flush=True)
        options = RouterOptions(policy=args.policy, health_check_endpoint=args.health_check_endpoint,
                                log_level="info")
        router = start_router([p.url for p in processes], options, args.host, args.port, log_dir / "router.log")
        processes.append(router)
        print(f"router ({args.policy}): {router.url}/v1  (log {log_dir / 'router.log'}); Ctrl-C stops all",
              flush=True)
        while all(p.alive() for p in processes):
            time.sleep(1)
        print("a process exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for process in reversed(processes):
            process.stop()


if __name__ == "__main__":
    sys.exit(main())
