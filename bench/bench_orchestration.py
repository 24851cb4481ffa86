"""Orchestration CPU of ``tokenmill materialize``: 128 new shards of ~100 KB, whole process tree.

Per repeat: a fresh ``DAGSTER_HOME`` and storage root, ``--shards`` JSONL shards of real text
(stdlib sources and their prose, ``tokenmill_dev.corpus``, ~``--kb`` KB each) in one dataset
with one blend, then ``python -m tokenmill.cli materialize`` (this checkout) as a child that
this process waits for. Its CPU is user+sys of the whole tree (``RUSAGE_CHILDREN``; this bench
is a child subreaper, so nothing escapes the count): the CLI, the Dagster run, every stage, the
checks and the refresh of merged, nanoset and the blend. The baseline is pure tokenization of
the same shards (``tokenize_files`` per shard in a warm process, its checker child included:
lone calls, and calls sharing one ``TokenizeSession`` as a pipeline step does); orchestration
per shard is the tree's CPU / shards − the session figure. The tokenizer's verification record
is made before the first repeat (a first use, not orchestration). ``--profile DIR`` also runs
``pipelines.materialize`` once under cProfile timed in CPU seconds (``DIR/materialize.prof``)
and prints where the CPU goes.
Prints a table, writes ``bench/out/orchestration.json``.

Run: ``.venv/bin/python bench/bench_orchestration.py [--shards 128] [--kb 100] [--repeats 3]``
(about 1 minute a repeat on 2 vCPUs).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pstats
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from _util import table, write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PR_SET_CHILD_SUBREAPER = 36
GOAL = 0.3  # issue 22: orchestration CPU-s per shard
# ``pipelines.materialize`` under cProfile timed in CPU seconds of the process (all threads).
PROFILED = """
import cProfile, sys, time
from pipelines.materialize import main
prof = cProfile.Profile(time.process_time)
out = sys.argv.pop(1)
code = prof.runcall(main, sys.argv[1:])
prof.dump_stats(out)
sys.exit(code)
"""


def make_shards(out: Path, shards: int, kb: int) -> list[Path]:
    """``shards`` JSONL files of real text, ~``kb`` KB each (documents dealt round-robin)."""
    from tokenmill_dev.corpus import stdlib_documents, write_jsonl_shards

    docs = ({"text": d["text"]} for d in stdlib_documents(kind="all"))
    return write_jsonl_shards(docs, out, shards=shards, max_bytes=shards * kb * 1000)


def write_recipe(path: Path, root: Path, source: Path, tokenizer: Path) -> Path:
    """One dataset (``docs``) and a blend of it, the demo's index settings."""
    recipe = {
        "storage": {"root": str(root)},
        "tokenizer": {"path": str(tokenizer), "append_eod": True, "workers": 1},
        "datasets": {"docs": {"source": str(source), "on_bad_record": "quarantine"}},
        "nanoset": {"sequence_length": 1024, "split": "96,2,2", "seed": 1, "train_samples": 2000},
        "blends": {"mix": {"weights": {"docs": 1.0}}},
    }
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def tokenize_baseline(shards: list[Path], tokenizer: Path, out: Path) -> dict[str, float]:
    """CPU seconds per shard of ``tokenize_files`` in this (warm) process, the checker child
    included: a lone call per shard (``cpu``, of which ``cpu_self`` in this process), and the
    calls sharing one ``TokenizeSession`` (``session_cpu``); ``wall`` of a lone call."""
    from tokenmill.tokenize.run import TokenizeSession, tokenize_files

    def tree() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime + children_cpu()

    n = len(shards)
    tokenize_files(shards[:1], out / "warm", tokenizer, append_eod=True, progress=False)
    wall, cpu, own = time.perf_counter(), tree(), time.process_time()
    for i, shard in enumerate(shards):
        tokenize_files([shard], out / f"b{i}", tokenizer, append_eod=True, progress=False)
    result = {"wall": (time.perf_counter() - wall) / n, "cpu": (tree() - cpu) / n}
    result["cpu_self"] = (time.process_time() - own) / n
    cpu = tree()
    with TokenizeSession() as session:
        for i, shard in enumerate(shards):
            prefix = out / f"s{i}"
            tokenize_files([shard], prefix, tokenizer, append_eod=True, progress=False,
                           session=session)  # fmt: skip
    result["session_cpu"] = (tree() - cpu) / n
    return result


def children_cpu() -> float:
    """User+sys seconds of every child reaped so far (and what they reaped)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def materialize(work: Path, recipe: Path, env: dict[str, str], prof: Path | None = None) -> dict:
    """One ``materialize`` call in a fresh DAGSTER_HOME; its tree's wall and CPU seconds."""
    home = work / "dagster_home"
    shutil.rmtree(home, ignore_errors=True)
    env = {**env, "DAGSTER_HOME": str(home)}
    if prof is None:
        cmd = [sys.executable, "-m", "tokenmill.cli", "materialize", "--recipe", str(recipe)]
    else:
        cmd = [sys.executable, "-c", PROFILED, str(prof), "--recipe", str(recipe)]
    before, start = children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, children_cpu() - before
    if proc.returncode:
        raise SystemExit(f"materialize failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    ranges = [float(x) for x in re.findall(r": ok in ([\d.]+) s", proc.stdout)]
    return {"wall": wall, "cpu": cpu, "range_walls": ranges}


def startup_cpu(env: dict[str, str], repeats: int = 3) -> float:
    """CPU seconds of a process that only imports ``pipelines.materialize`` (the fixed start)."""
    cmd = [sys.executable, "-c", "import pipelines.materialize"]
    cpus = []
    for _ in range(repeats):
        before = children_cpu()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        cpus.append(children_cpu() - before)
    return min(cpus)


def profile_summary(prof: Path, top: int = 25) -> list[dict[str, Any]]:
    """The functions with the most cumulative time in the profile (where the CPU goes)."""
    stats = pstats.Stats(str(prof))
    rows = []
    for (file, line, func), (_, calls, _tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"func": f"{Path(file).name}:{line}({func})", "calls": calls, "cum_s": ct})
    rows.sort(key=lambda r: -r["cum_s"])
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=128)
    parser.add_argument("--kb", type=int, default=100, help="size of a shard in KB")
    parser.add_argument("--repeats", type=int, default=3, help="materialize calls (≥ 1)")
    parser.add_argument("--tokenizer", type=Path, default=ROOT / ".tokenizers" / "gpt2")
    parser.add_argument("--profile", type=Path, help="also profile one call; .prof files here")
    parser.add_argument("--name", default="orchestration", help="JSON name under bench/out/")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    if not (args.tokenizer / "tokenizer.json").is_file():
        raise SystemExit(f"{args.tokenizer}: no tokenizer (make tokenizers)")
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    with tempfile.TemporaryDirectory(prefix="bench-orch-") as tmp:
        work = Path(tmp)
        shards = make_shards(work / "source", args.shards, args.kb)
        size = sum(p.stat().st_size for p in shards) / len(shards) / 1000
        recipe = write_recipe(work / "recipe.yaml", work / "data", work / "source", args.tokenizer)
        baseline = tokenize_baseline(shards, args.tokenizer, work / "baseline")
        start = startup_cpu(env)
        runs = []
        for _ in range(args.repeats):
            shutil.rmtree(work / "data", ignore_errors=True)
            runs.append(materialize(work, recipe, env))
        profile = []
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(work / "data", ignore_errors=True)
            prof = args.profile / "materialize.prof"
            materialize(work, recipe, env, prof)
            profile = profile_summary(prof)
    n = args.shards
    cpus = sorted(r["cpu"] for r in runs)
    median = cpus[len(cpus) // 2]
    rows = [["run", "wall s", "CPU s", "CPU s/shard", "orchestration CPU s/shard"]]
    for i, r in enumerate(runs):
        per = r["cpu"] / n
        rows.append(
            [f"materialize #{i + 1}", f"{r['wall']:.1f}", f"{r['cpu']:.1f}", f"{per:.3f}",
             f"{per - baseline['session_cpu']:.3f}"]
        )  # fmt: skip
    print(f"{n} shards of {size:.0f} KB. tokenize_files per shard: {baseline['cpu']:.3f} CPU-s "
          f"a lone call ({baseline['cpu_self']:.3f} in process, the rest its checker), "
          f"{baseline['session_cpu']:.3f} in one TokenizeSession; import pipelines.materialize "
          f"{start:.2f} CPU-s; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(table(rows))
    print(f"median: {median / n:.3f} CPU-s per shard for the whole tree (goal ≤ {GOAL})")
    for row in profile:
        print(f"  {row['cum_s']:7.2f} s {row['calls']:7d}  {row['func']}")
    path = write_results(
        args.name,
        {
            "shards": n,
            "shard_kb": size,
            "baseline_tokenize_per_shard": baseline,
            "import_cpu": start,
            "runs": runs,
            "cpu_per_shard_median": median / n,
            "goal_cpu_per_shard": GOAL,
            "profile_top": profile,
            "load_after": os.getloadavg()[0],
            "report_rows": [
                {
                    "benchmark": f"materialize {n} new shards of {size:.0f} kB",
                    "measure": "CPU-s per shard, whole process tree, median of "
                    f"{len(runs)} (wall per shard)",
                    "ours": f"{median / n:.3f} s ({runs[0]['wall'] / n:.2f} s)",
                    "baseline": f"{baseline['session_cpu']:.3f} s tokenize_files per shard "
                    f"in a session ({baseline['cpu']:.3f} s alone)",
                    "ratio": f"{median / n / baseline['session_cpu']:.1f}×",
                    "target": f"≤ {GOAL} s",
                    "met": median / n <= GOAL,
                }
            ],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
