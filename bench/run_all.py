"""``make bench``: run every benchmark, then write bench/results.json and the table of
docs/performance.md (see ``bench/report.py``).

Each benchmark is a script that prints its own table and writes ``<out>/<name>.json``; they
run one after another (never side by side: they would measure each other). The pipeline bench
(``bench_pipeline.py``) runs when it exists. ``--quick`` is a smoke run on small inputs: its
JSON goes to ``bench/out/quick/`` and its report to ``bench/results-quick.json``, and
docs/performance.md is left alone. ``--report-only`` rebuilds the report from the JSON already
there. bench/out/ and bench/results*.json are git-ignored: results belong to a machine.

    python bench/run_all.py [--quick] [--only tokenize,loader] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402

DOC = ROOT / "docs" / "performance.md"
OUT_ENV = "TOKENMILL_BENCH_OUT"  # read by bench/_util.py: where each bench writes its JSON


@dataclass(frozen=True)
class Bench:
    """One benchmark script, its JSON name, its smoke-run arguments and those of a full run."""

    name: str
    script: str
    quick: tuple[str, ...]
    full: tuple[str, ...] = ()


# The large-input regime: GPT-2 against the best floor only, the engine's thread pool in use.
TOKENIZE_LARGE = ("--floors", "gigatoken", "--tokenizers", "gpt2", "--workers", "2")
TOKENIZE_LARGE += ("--skip-first-use", "--name", "tokenize-200mb")

BENCHES = (
    Bench(
        "tokenize",
        "bench_tokenize.py",
        ("--mb", "2", "--repeat", "1", "--floors", "gigatoken", "--skip-first-use"),
    ),
    Bench(
        "tokenize-200mb",
        "bench_tokenize.py",
        ("--mb", "4", "--repeat", "1", *TOKENIZE_LARGE),
        ("--mb", "200", *TOKENIZE_LARGE),
    ),
    Bench("merge", "bench_merge.py", ("--mb", "64", "--repeat", "1")),
    Bench("index", "bench_index.py", ("--quick", "--repeats", "1")),
    Bench("loader", "bench_loader.py", ("--tokens", "4000000", "--iters", "3", "--repeat", "2")),
    Bench("open", "bench_open.py", ("--sequences", "2000000", "--repeat", "3")),
    Bench("pipeline", "bench_pipeline.py", ("--quick",)),
    Bench(
        "scale",
        "bench_scale.py",
        ("--shards", "20", "--blend-gb", "0.2", "--s3-shards", "3"),
        ("--shards", "1000", "--blend-gb", "5", "--s3-shards", "50"),
    ),
)


def run_benches(benches: list[Bench], out_dir: Path, quick: bool) -> dict[str, dict[str, object]]:
    """Run each script in turn (all of them, even after a failure): exit code, seconds and the
    1-minute load average before and after."""
    env = {**os.environ, OUT_ENV: str(out_dir), "HF_HUB_OFFLINE": "1"}
    runs: dict[str, dict[str, object]] = {}
    for bench in benches:
        cmd = [sys.executable, str(HERE / bench.script), *(bench.quick if quick else bench.full)]
        print(f"\n=== {bench.name}: {' '.join(cmd[1:])} ===", flush=True)
        start, load = time.perf_counter(), os.getloadavg()[0]
        rc = subprocess.call(cmd, env=env)
        runs[bench.name] = {
            "exit_code": rc,
            "seconds": round(time.perf_counter() - start, 1),
            "load": [round(load, 2), round(os.getloadavg()[0], 2)],
        }
        if rc:
            print(f"{bench.script} failed with exit code {rc}", file=sys.stderr)
    return runs


def write_report(
    names: list[str],
    out_dir: Path,
    results_path: Path,
    *,
    quick: bool,
    runs: dict[str, dict[str, object]],
    load_before: list[float],
) -> str:
    """Collect the JSON of ``names``, write ``results_path``, return the markdown section.

    Benches not run this time are reported from their last JSON, with their last run's record
    (date, load) kept from the previous ``results_path``; one that failed in this run is
    reported as missing rather than by an older result. Without ``runs`` (``--report-only``)
    the machine description is the previous one too.
    """
    benches, missing = report.collect(out_dir, names)
    for name, run in runs.items():
        if run["exit_code"] and name in benches:
            del benches[name]
            missing.append(name)
    machine = report.machine_info(ROOT)
    machine["load_before"] = load_before
    machine["load_after"] = machine.pop("load_average")
    last_machine, last_runs = _previous(results_path)
    if not runs and last_machine:
        machine = last_machine
    runs = {**last_runs, **runs}
    results = report.build_results(benches, missing, machine, quick=quick, runs=runs)
    replace_text(results_path, json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    return report.markdown(results)


def _previous(results_path: Path) -> tuple[dict[str, object], dict[str, dict[str, object]]]:
    """The machine description and bench runs of the last report (empty when there is none)."""
    try:
        last = json.loads(results_path.read_text(encoding="utf-8"))
        return dict(last["machine"]), dict(last["runs"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}, {}


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` through a temporary sibling and a rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main() -> int:
    """Run the selected benches and write the report; 1 if any bench failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run on small inputs")
    parser.add_argument("--only", default="", help="comma-separated bench names to run")
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the report from existing JSON"
    )
    args = parser.parse_args()
    known = [b for b in BENCHES if (HERE / b.script).is_file()]
    wanted = [n for n in args.only.split(",") if n]
    unknown = sorted(set(wanted) - {b.name for b in known})
    if unknown:
        parser.error(f"--only: unknown or absent benches {unknown}")
    selected = [b for b in known if not wanted or b.name in wanted]
    out_dir = HERE / "out" / "quick" if args.quick else HERE / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs = {} if args.report_only else run_benches(selected, out_dir, args.quick)
    results_path = HERE / ("results-quick.json" if args.quick else "results.json")
    section = write_report(
        [b.name for b in known],
        out_dir,
        results_path,
        quick=args.quick,
        runs=runs,
        load_before=load_before,
    )
    print(f"\n{section}\n\nwrote {results_path}")
    if not args.quick:
        replace_text(DOC, report.update_doc(DOC.read_text(encoding="utf-8"), section))
        print(f"updated {DOC}")
    return 1 if any(run["exit_code"] for run in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
