"""``bench_tokenize.py --scaling``: one run over all cores vs independent single-worker runs.

For each worker count N in 1, 2, 4, ... up to the cores present (the last one included), each
repetition runs, alternating: our CLI once with ``--workers N`` over the whole corpus, then N
concurrent CLI runs with ``--workers 1``, each over one of N equal parts of the same corpus (cut
on line boundaries): the embarrassingly parallel reference. Both report wall and CPU seconds of
their process trees and MB/s of the corpus; the efficiency is the reference's wall time over
ours (1.0: one run scales as well as separate processes), and the issue's 2-core check is our
wall over the reference's (goal <= 1.15 at N = 2). A third run, ``--workers N`` over the N parts
as N input files, times what a dataset of many shards costs (each input hashed and sampled).
Every run's ``.bin`` must equal the parts' ``.bin`` concatenated. The machine's load average is
recorded before each repetition.

It also measures the parent's serial work per MB of corpus on the output: the sha256 of the
``.bin`` and its copy with ``copy_file_range`` (what stitching does), and the same copy done
by reading and writing from Python, for the scaling model: wall(N) ~ start-up + max(parallel
CPU-s / N, serial CPU-s).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _util import remove_outputs, table

RunStats = dict[str, float]
HEADER = ("workers", "ours wall s", "ours CPU-s", "ours MB/s", "indep. wall s", "indep. CPU-s",
          "indep. MB/s", "efficiency", "ours/indep. per rep", "ours, N inputs: wall s (CPU-s)",
          "load")  # fmt: skip


def worker_counts(cores: int) -> list[int]:
    """1, 2, 4, ... below ``cores``, then ``cores``."""
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return [*counts, cores]


def split_lines(corpus: Path, parts: int, folder: Path) -> list[Path]:
    """``parts`` files of about equal size, cut after a newline, that concatenate to ``corpus``."""
    data = corpus.read_bytes()
    folder.mkdir(parents=True, exist_ok=True)
    cuts = [0]
    for k in range(1, parts):
        at = data.find(b"\n", max(cuts[-1], len(data) * k // parts - 1))
        cuts.append(len(data) if at < 0 else at + 1)
    cuts.append(len(data))
    paths = []
    for k in range(parts):
        path = folder / f"part-{k:02d}.jsonl"
        path.write_bytes(data[cuts[k] : cuts[k + 1]])
        paths.append(path)
    return paths


def _cmd(corpus: Path | list[Path], tok_dir: Path, prefix: Path, workers: int) -> list[str]:
    inputs = [str(p) for p in corpus] if isinstance(corpus, list) else [str(corpus)]
    return [
        sys.executable, "-m", "tokenmill.cli", "tokenize", "--input", *inputs,
        "--output-prefix", str(prefix), "--tokenizer", str(tok_dir), "--append-eod",
        "--workers", str(workers),
    ]  # fmt: skip


def run_together(cmds: list[list[str]], env: dict[str, str]) -> RunStats:
    """Start every command at once; wall until the last ends, CPU-s of all their trees."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    procs = [
        subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        for c in cmds
    ]
    errors = [p.communicate()[1] for p in procs]
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for proc, err, cmd in zip(procs, errors, cmds, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {err.decode(errors='replace')}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"wall": wall, "cpu": cpu}


def bin_digest(paths: list[Path]) -> str:
    """sha256 of the files' bytes back to back."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            while block := fh.read(16 << 20):
                h.update(block)
    return h.hexdigest()


def serial_work(bin_path: Path, mb: float) -> dict[str, float]:
    """CPU-s per MB of corpus of the parent's serial work on ``bin_path``: sha256 through a
    map, the copy with ``copy_file_range``, and the same copy read and written from Python."""
    out: dict[str, float] = {}
    dst = bin_path.with_name(bin_path.name + ".copy")
    size = bin_path.stat().st_size
    with open(bin_path, "rb") as src:
        view = mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ)
        cpu = time.process_time()
        hashlib.sha256(view).hexdigest()
        out["sha256"] = (time.process_time() - cpu) / mb
        view.close()
        with open(dst, "wb") as fh:
            cpu, off = time.process_time(), 0
            while off < size:
                off += os.copy_file_range(src.fileno(), fh.fileno(), size - off, off, off)
            out["copy_file_range"] = (time.process_time() - cpu) / mb
        with open(dst, "wb") as fh:
            src.seek(0)
            cpu = time.process_time()
            while block := src.read(16 << 20):
                fh.write(block)
            out["read_write"] = (time.process_time() - cpu) / mb
    dst.unlink()
    return out


def scaling_runs(
    corpus: Path,
    tok_dir: Path,
    work: Path,
    counts: list[int],
    repeat: int,
    env: dict[str, str],
    save: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """The runs for one tokenizer: per worker count, ours and the reference, alternating;
    ``save`` gets the results so far after each worker count (a cut-off run keeps them)."""
    size = corpus.stat().st_size
    mb = size / 1e6
    # A first run verifies the tokenizer (cached after) and warms the page cache.
    remove_outputs(work, "warm")
    warm = _cmd(corpus, tok_dir, work / "warm", 1)
    subprocess.run(warm, check=True, env=env, stdout=subprocess.DEVNULL)
    expected = bin_digest([work / "warm_text_document.bin"])
    serial = serial_work(work / "warm_text_document.bin", mb)
    rows: dict[int, dict[str, Any]] = {}
    for n in counts:
        parts = split_lines(corpus, n, work / f"parts-{n}")
        row: dict[str, Any] = {"ours": [], "independent": [], "ours_inputs": [], "load": []}
        for _ in range(repeat):
            row["load"].append([round(x, 2) for x in os.getloadavg()])
            outs = [work / f"ind-{k:02d}" for k in range(n)]
            for prefix in ["ours", "inputs", *(o.name for o in outs)]:
                remove_outputs(work, prefix)  # else a run finds its outputs up to date
            row["ours"].append(run_together([_cmd(corpus, tok_dir, work / "ours", n)], env))
            cmds = [_cmd(p, tok_dir, o, 1) for p, o in zip(parts, outs, strict=True)]
            row["independent"].append(run_together(cmds, env))
            # The same bytes as N input files in one run (what a dataset of shards looks like).
            row["ours_inputs"].append(run_together([_cmd(parts, tok_dir, work / "inputs", n)], env))
            digests = {
                bin_digest([work / "ours_text_document.bin"]),
                bin_digest([Path(f"{o}_text_document.bin") for o in outs]),
                bin_digest([work / "inputs_text_document.bin"]),
            }
            if digests != {expected}:
                raise RuntimeError(f"workers={n}: .bin differs from the parts' concatenation")
        for what in ("ours", "independent", "ours_inputs"):
            wall = statistics.median(r["wall"] for r in row[what])
            cpu = statistics.median(r["cpu"] for r in row[what])
            row[f"{what}_median"] = {"wall": wall, "cpu": cpu, "mb_s": mb / wall}
        row["efficiency"] = row["independent_median"]["wall"] / row["ours_median"]["wall"]
        row["ours_over_independent"] = [
            o["wall"] / i["wall"] for o, i in zip(row["ours"], row["independent"], strict=True)
        ]
        row["bin_equals_parts"] = True
        rows[n] = row
        for p in parts:
            p.unlink()
        print(f"workers {n}: done", file=sys.stderr)
        one = rows[counts[0]]["ours_median"]
        result = {
            "corpus": str(corpus),
            "bytes": size,
            "rows": rows,
            "model": {
                "serial_cpu_s_per_mb": serial,
                "parallel_cpu_s_per_mb": one["cpu"] / mb,
                "note": "wall(N) ~ start-up + max(parallel CPU-s / N, sha256 + copy CPU-s); "
                "the sha256 of the .bin is the one part no split shares out",
            },
        }
        save(result)
    return result


def report_scaling(data: dict[str, Any]) -> None:
    """Print one table per tokenizer."""
    for name, res in data["results"].items():
        rows = [list(HEADER)]
        for n, row in res["rows"].items():
            ours, ind = row["ours_median"], row["independent_median"]
            rows.append([
                str(n), f"{ours['wall']:.2f}", f"{ours['cpu']:.1f}", f"{ours['mb_s']:.0f}",
                f"{ind['wall']:.2f}", f"{ind['cpu']:.1f}", f"{ind['mb_s']:.0f}",
                f"{row['efficiency']:.2f}",
                " ".join(f"{x:.2f}" for x in row["ours_over_independent"]),
                f"{row['ours_inputs_median']['wall']:.2f} ({row['ours_inputs_median']['cpu']:.1f})",
                " ".join(f"{x[0]:.1f}" for x in row["load"]),
            ])  # fmt: skip
        print(f"\n{name}: {res['bytes'] / 1e6:.0f} MB, medians of {len(row['ours'])} runs")
        print(table(rows))
        model = res["model"]
        serial = ", ".join(f"{k} {v * 1000:.2f}" for k, v in model["serial_cpu_s_per_mb"].items())
        print(f"serial work, CPU-ms per MB: {serial}; parallel CPU-ms per MB (workers 1): "
              f"{model['parallel_cpu_s_per_mb'] * 1000:.1f}")  # fmt: skip
