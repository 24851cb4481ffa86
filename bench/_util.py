"""Shared helpers for the benchmarks: timing subprocesses with CPU seconds, writing results."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Where results go: bench/out, or $TOKENMILL_BENCH_OUT (run_all's --quick uses bench/out/quick).
OUT_DIR = Path(os.environ.get("TOKENMILL_BENCH_OUT") or Path(__file__).resolve().parent / "out")


def run_timed(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Run a command to completion; wall seconds and CPU seconds (user+sys) of its tree."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu}


def remove_outputs(work: Path, prefix: str) -> None:
    """Delete what a ``tokenmill tokenize`` run at ``work/prefix`` wrote, so the next run there
    tokenizes: a run whose outputs already record its inputs and settings writes nothing."""
    for path in [*work.glob(f"{prefix}[_.]*"), *work.glob(f"manifests/{prefix}_*")]:
        if path.is_file():
            path.unlink()


def machine() -> dict[str, Any]:
    """A short description of the machine the numbers were taken on."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def write_results(name: str, results: dict[str, Any]) -> Path:
    """Write ``bench/out/<name>.json`` and return its path."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **results}, indent=2) + "\n")
    return path


def table(rows: list[list[str]]) -> str:
    """Left-aligned plain-text table; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
