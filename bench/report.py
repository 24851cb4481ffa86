"""The performance report of ``make bench``: bench/out/*.json → bench/results.json + a markdown
table in docs/performance.md (between ``<!-- bench:start -->`` and ``<!-- bench:end -->``).

Pure functions, no benchmarks run here (``bench/run_all.py`` runs them), so the report can be
rebuilt from existing results and tested on small fake inputs. Each known bench has a summarizer
that turns its JSON into table rows (what was measured, ours, the same-run baseline, the ratio,
the issue's target and whether it is met); a bench may instead ship its own rows under
``report_rows`` (a list of objects with the ``COLUMNS`` keys, ``met`` true/false/null).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
COLUMNS = ("benchmark", "measure", "ours", "baseline", "ratio", "target", "met")
HEADER = ("benchmark", "measure", "ours", "same-run baseline", "ratio", "target", "met")
Row = dict[str, Any]


# -- machine ---------------------------------------------------------------------------------
def _proc_field(path: str, key: str) -> str | None:
    """The value of the first ``key: value`` line of a /proc file, or None."""
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        return None
    return None


def git_commit(root: Path) -> str | None:
    """The checked-out commit, read from ``.git`` files (no git process), or None."""
    git = root / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = (root / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        common = git / "commondir"
        base = (git / common.read_text().strip()).resolve() if common.is_file() else git
        for where in (git, base):
            if (where / ref).is_file():
                return (where / ref).read_text().strip()
        packed = base / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                sha, _, name = line.partition(" ")
                if name == ref:
                    return sha
    except (OSError, IndexError):
        return None
    return None


def machine_info(root: Path) -> dict[str, Any]:
    """CPU model, CPUs, RAM, OS, Python and numpy versions, commit, date, load average now."""
    import numpy

    mem_kb = _proc_field("/proc/meminfo", "MemTotal")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor(),
        "cpus": cpus,
        "ram_gib": round(int(mem_kb.split()[0]) / 2**20, 1) if mem_kb else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": numpy.__version__,
        "git_commit": git_commit(root),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


# -- summarizers -----------------------------------------------------------------------------
def _row(*cells: Any) -> Row:
    """A table row from its cells in ``COLUMNS`` order."""
    return dict(zip(COLUMNS, cells, strict=True))


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def tokenize_rows(data: dict[str, Any]) -> list[Row]:
    """CLI and in-process wall time per tokenizer and ``--workers`` against the best floor."""
    rows = []
    size = data["bytes"] / 1e6
    for name, res in data["results"].items():
        floors = {engine: _median(v) for engine, v in res["floors"].items()}
        engine = min(floors, key=floors.__getitem__)
        best = floors[engine]
        for what, key in (("CLI", "ours"), ("in-process", "in_process")):
            for workers, runs in res[key].items():
                wall = _median([r["wall"] for r in runs])
                cpu = _median([r["cpu"] for r in runs])
                rows.append(
                    _row(
                        f"tokenize {size:.0f} MB, {name}",
                        f"{what}, --workers {workers}, wall median (CPU)",
                        f"{wall:.2f} s ({cpu:.2f} s)",
                        f"{best:.2f} s ({engine} encode floor)",
                        f"{wall / best:.1f}×",
                        "≤ 1.5×" if what == "CLI" else "",
                        wall / best <= 1.5 if what == "CLI" else None,
                    )
                )
        reader = res.get("engine_reader")
        if reader:
            wall = _median([r["wall"] for r in reader])
            rows.append(
                _row(
                    f"tokenize {size:.0f} MB, {name}",
                    "gigatoken's own JSONL reader + encode (context: drops or misreads bad lines)",
                    f"{wall:.2f} s ({_median([r['cpu'] for r in reader]):.2f} s)",
                    f"{best:.2f} s ({engine} encode floor)",
                    f"{wall / best:.1f}×",
                    "",
                    None,
                )
            )
        bound = res.get("lower_bound")
        if bound is not None:
            rows.append(
                _row(
                    f"tokenize {size:.0f} MB, {name}",
                    f"lower bound for any exact run on {bound['cores']} cores: max(start-up + "
                    "engine + floor wall, their CPU + JSON parse + sha256s / cores)",
                    f"{bound['seconds']:.2f} s",
                    f"{best:.2f} s ({engine} encode floor)",
                    f"{bound['seconds'] / best:.1f}×",
                    "≤ 1.5× reachable?",
                    bound["seconds"] / best <= 1.5,
                )
            )
    for key, run in data.get("rss", {}).items():
        if isinstance(run, dict):
            mb = data["rss"]["bytes"] / 1e6
            rows.append(
                _row(
                    f"tokenize {mb:.0f} MB, {key}",
                    "peak RSS of the process tree",
                    f"{run['rss_mb']:.0f} MB",
                    "",
                    "",
                    "≤ 1024 MB",
                    run["rss_mb"] <= 1024,
                )
            )
    return rows


def merge_rows(data: dict[str, Any]) -> list[Row]:
    """``tokenmill merge`` against ``cp`` of the same bytes (medians)."""
    res = data["results"]
    ours, cp = res["tokenmill merge"], res["cp"]
    sync = res.get("cp+sync")
    baseline = f"{cp['wall_median']:.2f} s (cp)"
    if sync is not None:
        baseline += f"; cp + sync {sync['wall_median']:.2f} s"
    ratio = ours["ratio_vs_cp"]
    return [
        _row(
            f"merge {data['shards']} shards, {data['bytes'] / 1e6:.0f} MB",
            "CLI wall median (CPU); ratio = cp / ours",
            f"{ours['wall_median']:.2f} s ({ours['cpu_median']:.2f} s)",
            baseline,
            f"{ratio:.2f}×",
            "≥ 0.8×",
            ratio >= 0.8,
        )
    ]


INDEX_BASELINES = {
    "nanoset_megatron_3_epochs": "baseline_megatron_path_emulated",
    "blend_megatron_8x20M": "baseline_helpers_cpp_loop_emulated",
}


def index_rows(data: dict[str, Any]) -> list[Row]:
    """Nanoset index and blend builds (min of the repeats) against the issue's seconds."""
    by = {r["name"]: r for r in data["results"]}
    rows = []
    for name, target in data["targets_seconds"].items():
        ours = by[name]
        base = by[INDEX_BASELINES[name]]
        rows.append(
            _row(
                name.replace("_", " "),
                "wall min (median); CPU min",
                f"{ours['wall_min']:.2f} s ({ours['wall_median']:.2f}); {ours['cpu_min']:.2f} s",
                f"{base['wall_min']:.2f} s ({base['name'].replace('_', ' ')})",
                f"{ours['wall_min'] / base['wall_min']:.2f}×",
                f"≤ {target} s",
                None if data.get("quick") else ours["wall_min"] <= target,
            )
        )
    return rows


def loader_rows(data: dict[str, Any]) -> list[Row]:
    """Random ``get_batch`` against a contiguous read and a per-sample loop (medians)."""
    res = data["results"]
    shape = f"{data['batch']}×{data['sequence_length'] + 1}"
    gb, contiguous, loop = res["get_batch"], res["contiguous"], res["getitem loop"]
    ratio = data["ratio_get_batch_vs_contiguous"]
    speedup = data["speedup_get_batch_vs_getitem_loop"]
    return [
        _row(
            f"loader get_batch {shape}",
            "bandwidth vs contiguous memmap read → int64",
            f"{gb['mb_s']:.0f} MB/s ({gb['wall_ms']:.2f} ms/batch)",
            f"{contiguous['mb_s']:.0f} MB/s ({contiguous['wall_ms']:.2f} ms)",
            f"{ratio:.2f}×",
            "≥ 0.8×",
            ratio >= 0.8,
        ),
        _row(
            f"loader get_batch {shape}",
            "speed-up over a per-sample __getitem__ loop",
            f"{gb['wall_ms']:.2f} ms/batch",
            f"{loop['wall_ms']:.2f} ms (loop)",
            f"{speedup:.1f}×",
            "≥ 3×",
            speedup >= 3,
        ),
    ]


def pipeline_rows(data: dict[str, Any]) -> list[Row]:
    """Per-partition overhead of Dagster runs over a bare ``tokenize_files``, and scale-out
    (shard-phase wall time at C concurrent runs against C = 1). The issue sets no target."""
    base = data["baseline_tokenize_per_shard"]
    serial = [
        r["shards_wall"] for r in data["results"] if r["mode"] == "runs" and r["concurrency"] == 1
    ]
    rows = []
    for r in data["results"]:
        speedup = f"{min(serial) / r['shards_wall']:.2f}× vs C = 1" if serial else ""
        rows.append(
            _row(
                f"pipeline {data['shards']} shards of {data['shard_bytes'] / 1e3:.0f} kB",
                f"{r['mode']}, C = {r['concurrency']} ({r['runs']} runs): overhead per "
                "partition (CPU)",
                f"{r['overhead_per_partition']:.2f} s ({r['cpu_overhead_per_partition']:.2f} s)",
                f"{base['wall']:.2f} s ({base['cpu']:.2f} s) tokenize_files per shard",
                speedup,
                "",
                None,
            )
        )
    return rows


def shipped_rows(data: dict[str, Any]) -> list[Row]:
    """Rows a bench wrote itself under ``report_rows``."""
    return [{key: row.get(key, "") for key in COLUMNS} for row in data["report_rows"]]


SUMMARIZERS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "tokenize": tokenize_rows,
    "tokenize-200mb": tokenize_rows,
    "merge": merge_rows,
    "index": index_rows,
    "loader": loader_rows,
    "pipeline": pipeline_rows,
}


def bench_rows(name: str, data: dict[str, Any]) -> list[Row]:
    """Table rows of one bench; a bench whose JSON cannot be read gets a row saying why."""
    try:
        if "report_rows" in data:
            return shipped_rows(data)
        summarize = SUMMARIZERS.get(name)
        if summarize is None:
            return [_row(name, "no summary rows", f"see bench/out/{name}.json", "", "", "", None)]
        return summarize(data)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        return [_row(name, "could not summarize", reason, "", "", "", None)]


# -- results and markdown --------------------------------------------------------------------
def collect(out_dir: Path, names: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``{name: contents}`` of ``out_dir/<name>.json`` (with its mtime) and the missing names."""
    found, missing = {}, []
    for name in names:
        path = out_dir / f"{name}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            missing.append(name)
            continue
        mtime = time.gmtime(path.stat().st_mtime)
        found[name] = {"written_utc": time.strftime("%Y-%m-%d %H:%M UTC", mtime), "data": data}
    return found, missing


def build_results(
    benches: dict[str, Any],
    missing: list[str],
    machine: dict[str, Any],
    *,
    quick: bool,
    runs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``bench/results.json`` document: machine, every bench's JSON, the table rows."""
    rows = [row for name, entry in benches.items() for row in bench_rows(name, entry["data"])]
    return {
        "quick": quick,
        "machine": machine,
        "runs": runs or {},
        "missing": missing,
        "rows": rows,
        "benches": benches,
    }


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    return str(value).replace("|", "\\|")


def describe_machine(machine: dict[str, Any]) -> str:
    """One paragraph naming the machine, software and load the numbers were taken under."""
    before = machine.get("load_before") or machine.get("load_average")
    after = machine.get("load_after")
    load = f"1-minute load average {before[0]:.2f}" if before else "load average unknown"
    if before and after:
        load = f"1-minute load average {before[0]:.2f} before and {after[0]:.2f} after the run"
    commit = machine.get("git_commit")
    return (
        f"Machine: {machine.get('cpu_model')}, {machine.get('cpus')} CPUs, "
        f"{machine.get('ram_gib')} GiB RAM, {machine.get('platform')}; Python "
        f"{machine.get('python')}, numpy {machine.get('numpy')}; {load}. "
        f"Commit {commit[:12] if commit else 'unknown'}, {machine.get('date_utc')}."
    )


def markdown(results: dict[str, Any]) -> str:
    """The generated section: the machine paragraph, the table, missing benches."""
    lines = [describe_machine(results["machine"]), ""]
    if results["quick"]:
        lines += ["**Quick smoke run** (small inputs): the targets do not apply.", ""]
    lines.append("| " + " | ".join(HEADER) + " |")
    lines.append("|---|---|---:|---:|---:|---|---|")
    for row in results["rows"]:
        met = None if results["quick"] else row["met"]
        cells = [*(row[key] for key in COLUMNS[:-1]), met]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    dated = []
    for name, entry in results["benches"].items():
        load = results["runs"].get(name, {}).get("load")
        during = f" (load {load[0]:.1f} → {load[1]:.1f})" if load else ""
        dated.append(f"{name} {entry['written_utc']}{during}")
    if dated:
        lines += ["", "Results written: " + "; ".join(dated) + "."]
    if results["missing"]:
        lines += ["", "No results from: " + ", ".join(results["missing"]) + "."]
    return "\n".join(lines)


def update_doc(text: str, section: str) -> str:
    """``text`` with the part between the markers replaced by ``section`` (appended, with the
    markers, when the document has none yet)."""
    block = f"{START}\n{section}\n{END}"
    start, end = text.find(START), text.find(END)
    if start == -1 or end == -1 or end < start:
        return text.rstrip("\n") + "\n\n" + block + "\n"
    return text[:start] + block + text[end + len(END) :]
