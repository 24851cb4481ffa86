"""The ``make bench`` report (bench/report.py, bench/run_all.py) on small fake bench results:
table rows and verdicts, the machine paragraph, the marked section of docs/performance.md,
and bench/results.json. No benchmark is run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _helpers import bench_module

report = bench_module("report")

MACHINE = {
    "cpu_model": "Test CPU",
    "cpus": 2,
    "ram_gib": 24.0,
    "platform": "Linux-test",
    "python": "3.11.7",
    "numpy": "2.3.5",
    "git_commit": "0123456789abcdef0123",
    "date_utc": "2026-01-02 03:04 UTC",
    "load_before": [1.5, 1.0, 1.0],
    "load_after": [2.25, 1.0, 1.0],
}


def fake_tokenize() -> dict[str, Any]:
    runs = [{"wall": w, "cpu": w + 0.1, "rss_mb": 200.0, "pss_mb": 150.0} for w in (0.5, 0.7, 0.6)]
    return {
        "bytes": 20_000_000,
        "results": {
            "gpt2": {
                "floors": {"hf": [4.0, 5.0, 6.0], "gigatoken": [0.2, 0.4, 0.3]},
                "ours": {"1": runs, "2": [{**r, "wall": 0.4} for r in runs]},
                "in_process": {"1": [{"wall": 0.45, "cpu": 0.5}]},
                "lower_bound": {"cores": 2, "seconds": 0.48},
                "engine_reader": [{"wall": w, "cpu": 2 * w} for w in (0.36, 0.33, 0.5)],
            }
        },
        "rss": {"bytes": 100_000_000, "corpus": "c.jsonl", "gpt2-w1": {"rss_mb": 210.0}},
    }


def fake_merge() -> dict[str, Any]:
    def entry(wall: float, ratio: float) -> dict[str, float]:
        return {"wall_median": wall, "cpu_median": wall / 2, "ratio_vs_cp": ratio}

    return {
        "bytes": 1_073_741_824,
        "shards": 8,
        "results": {
            "cp": entry(0.5, 1.0),
            "cp+sync": entry(1.0, 0.5),
            "tokenmill merge": entry(0.6, 0.5 / 0.6),
        },
    }


def fake_index(quick: bool = False) -> dict[str, Any]:
    def entry(name: str, wall: float) -> dict[str, Any]:
        return {"name": name, "wall_min": wall, "wall_median": wall + 0.1, "cpu_min": wall}

    return {
        "quick": quick,
        "targets_seconds": {"nanoset_megatron_3_epochs": 0.5, "blend_megatron_8x20M": 0.35},
        "results": [
            entry("nanoset_megatron_3_epochs", 0.45),
            entry("baseline_megatron_path_emulated", 0.9),
            entry("blend_megatron_8x20M", 0.4),
            entry("baseline_helpers_cpp_loop_emulated", 0.5),
        ],
    }


def fake_loader() -> dict[str, Any]:
    return {
        "batch": 512,
        "sequence_length": 2048,
        "results": {
            "contiguous": {"wall_ms": 1.0, "mb_s": 2000.0},
            "get_batch": {"wall_ms": 4.0, "mb_s": 500.0},
            "getitem loop": {"wall_ms": 20.0, "mb_s": 100.0},
        },
        "ratio_get_batch_vs_contiguous": 0.25,
        "speedup_get_batch_vs_getitem_loop": 5.0,
    }


def fake_pipeline() -> dict[str, Any]:
    def mode(name: str, c: int, wall: float) -> dict[str, Any]:
        return {
            "mode": name,
            "concurrency": c,
            "runs": 4,
            "shards_wall": wall,
            "overhead_per_partition": wall / 10,
            "cpu_overhead_per_partition": wall / 20,
        }

    return {
        "shards": 16,
        "shard_bytes": 32_000.0,
        "baseline_tokenize_per_shard": {"wall": 0.25, "cpu": 0.2},
        "results": [mode("runs", 1, 40.0), mode("runs", 4, 16.0), mode("backfill", 4, 8.0)],
    }


def write_outputs(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fakes = {
        "tokenize": fake_tokenize(),
        "merge": fake_merge(),
        "index": fake_index(),
        "loader": fake_loader(),
    }
    for name, data in fakes.items():
        (out / f"{name}.json").write_text(json.dumps(data))


def rows_by_measure(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["benchmark"], r["measure"]): r for r in rows}


def test_tokenize_rows_compare_medians_with_the_best_floor() -> None:
    rows = rows_by_measure(report.tokenize_rows(fake_tokenize()))
    w1 = rows[("tokenize 20 MB, gpt2", "CLI, --workers 1, wall median (CPU)")]
    assert (w1["ours"], w1["baseline"]) == ("0.60 s (0.70 s)", "0.30 s (gigatoken encode floor)")
    assert (w1["ratio"], w1["target"], w1["met"]) == ("2.0×", "≤ 1.5×", False)
    w2 = rows[("tokenize 20 MB, gpt2", "CLI, --workers 2, wall median (CPU)")]
    assert (w2["ratio"], w2["met"]) == ("1.3×", True)
    inproc = rows[("tokenize 20 MB, gpt2", "in-process, --workers 1, wall median (CPU)")]
    assert (inproc["ratio"], inproc["target"], inproc["met"]) == ("1.5×", "", None)
    rss = rows[("tokenize 100 MB, gpt2-w1", "peak RSS of the process tree")]
    assert (rss["ours"], rss["met"]) == ("210 MB", True)
    (bound,) = [row for key, row in rows.items() if key[1].startswith("lower bound")]
    assert (bound["ours"], bound["ratio"], bound["met"]) == ("0.48 s", "1.6×", False)
    (reader,) = [row for key, row in rows.items() if key[1].startswith("gigatoken's own")]
    assert (reader["ours"], reader["ratio"], reader["met"]) == ("0.36 s (0.72 s)", "1.2×", None)


def test_tokenize_lower_bound_is_the_larger_of_chain_and_cpu_spread() -> None:
    bench_tokenize = bench_module("bench_tokenize")
    work = {
        "start-up": {"wall": 0.1, "cpu": 0.2},
        "engine load (gigatoken)": {"wall": 0.05, "cpu": 0.05},
        "JSON parse": {"wall": 0.5, "cpu": 0.5},
        "sha256 of .bin": {"wall": 0.25, "cpu": 0.25},
    }
    res = {
        "floors": {"hf": [3.0], "gigatoken": [1.0, 0.8, 0.9]},
        "floors_cpu": {"hf": [3.0], "gigatoken": [1.8, 1.6, 1.7]},
        "unavoidable": [work, work],
    }
    bound = bench_tokenize.lower_bound(res, 2)
    assert bound["floor"] == "gigatoken" and bound["floor_cpu"] == 1.7
    assert bound["chain_wall"] == pytest.approx(0.1 + 0.05 + 0.9)
    assert bound["cpu_spread_wall"] == pytest.approx((0.2 + 0.05 + 0.5 + 0.25 + 1.7) / 2)
    assert bound["seconds"] == pytest.approx(1.35)
    assert bound["ratio_to_floor"] == pytest.approx(1.5)
    one_core = bench_tokenize.lower_bound(res, 1)
    assert one_core["seconds"] == pytest.approx(2.7)


def verdict(row: dict[str, Any]) -> tuple[Any, ...]:
    """A report row's measured value, its ratio to the baseline, and whether it met the target."""
    return row["ours"], row["ratio"], row["met"]


def test_merge_index_and_loader_rows() -> None:
    (merge,) = report.merge_rows(fake_merge())
    assert merge["baseline"] == "0.50 s (cp); cp + sync 1.00 s"
    assert verdict(merge) == ("0.60 s (0.30 s)", "0.83×", True)
    nanoset, blend = report.index_rows(fake_index())
    assert nanoset["benchmark"] == "nanoset megatron 3 epochs"
    assert verdict(nanoset) == ("0.45 s (0.55); 0.45 s", "0.50×", True)
    assert (blend["target"], blend["met"]) == ("≤ 0.35 s", False)
    assert [r["met"] for r in report.index_rows(fake_index(quick=True))] == [None, None]
    bandwidth, speedup = report.loader_rows(fake_loader())
    assert bandwidth["benchmark"] == "loader get_batch 512×2049"
    assert verdict(bandwidth) == ("500 MB/s (4.00 ms/batch)", "0.25×", False)
    assert (speedup["ratio"], speedup["met"]) == ("5.0×", True)


def test_pipeline_rows_show_overhead_and_scale_out() -> None:
    serial, parallel, backfill = report.pipeline_rows(fake_pipeline())
    assert serial["benchmark"] == "pipeline 16 shards of 32 kB"
    assert serial["measure"] == "runs, C = 1 (4 runs): overhead per partition (CPU)"
    assert (serial["ours"], serial["ratio"]) == ("4.00 s (2.00 s)", "1.00× vs C = 1")
    assert serial["baseline"] == "0.25 s (0.20 s) tokenize_files per shard"
    assert (parallel["ratio"], backfill["ratio"]) == ("2.50× vs C = 1", "5.00× vs C = 1")
    assert {r["met"] for r in (serial, parallel, backfill)} == {None}


def test_shipped_unknown_and_broken_results() -> None:
    shipped = {"report_rows": [{"benchmark": "pipeline", "measure": "overhead", "met": True}]}
    (row,) = report.bench_rows("pipeline", shipped)
    assert row == {**dict.fromkeys(report.COLUMNS, ""), **shipped["report_rows"][0]}
    (row,) = report.bench_rows("other", {"x": 1})
    assert (row["measure"], row["ours"]) == ("no summary rows", "see bench/out/other.json")
    (row,) = report.bench_rows("merge", {"results": {}})
    assert row["measure"] == "could not summarize"
    assert row["ours"] == "KeyError: 'tokenmill merge'"


def test_markdown_describes_the_machine_and_marks_misses() -> None:
    benches = {"loader": {"written_utc": "2026-01-02 03:00 UTC", "data": fake_loader()}}
    runs = {"loader": {"exit_code": 0, "seconds": 9.0, "load": [0.5, 1.25]}}
    results = report.build_results(benches, ["pipeline"], MACHINE, quick=False, runs=runs)
    text = report.markdown(results)
    lines = text.splitlines()
    assert lines[0] == (
        "Machine: Test CPU, 2 CPUs, 24.0 GiB RAM, Linux-test; Python 3.11.7, numpy 2.3.5; "
        "1-minute load average 1.50 before and 2.25 after the run. Commit 0123456789ab, "
        "2026-01-02 03:04 UTC."
    )
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + 2
    assert table[2] == (
        "| loader get_batch 512×2049 | bandwidth vs contiguous memmap read → int64 | "
        "500 MB/s (4.00 ms/batch) | 2000 MB/s (1.00 ms) | 0.25× | ≥ 0.8× | **no** |"
    )
    assert table[3].endswith("| 5.0× | ≥ 3× | yes |")
    assert "Results written: loader 2026-01-02 03:00 UTC (load 0.5 → 1.2)." in lines
    assert lines[-1] == "No results from: pipeline."
    quick = report.markdown(report.build_results(benches, [], MACHINE, quick=True))
    assert "**Quick smoke run**" in quick
    assert "Results written: loader 2026-01-02 03:00 UTC." in quick.splitlines()
    quick_rows = [line for line in quick.splitlines() if line.startswith("| loader")]
    assert len(quick_rows) == 2 and all(line.endswith("| – |") for line in quick_rows)


def test_update_doc_replaces_only_the_marked_section() -> None:
    doc = "# Performance\n\nintro\n"
    once = report.update_doc(doc, "table v1")
    assert once == f"# Performance\n\nintro\n\n{report.START}\ntable v1\n{report.END}\n"
    edited = once.replace("intro", "intro, edited") + "\n## Analysis\n\nkept\n"
    twice = report.update_doc(edited, "table v2")
    assert twice == edited.replace("table v1", "table v2")
    assert report.update_doc(twice, "table v2") == twice


def test_git_commit_reads_refs_without_git(tmp_path: Path) -> None:
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    assert report.git_commit(tmp_path) is None
    (git / "packed-refs").write_text("# pack-refs\n" + "a" * 40 + " refs/heads/main\n")
    assert report.git_commit(tmp_path) == "a" * 40
    (git / "refs" / "heads" / "main").write_text("b" * 40 + "\n")
    assert report.git_commit(tmp_path) == "b" * 40
    (git / "HEAD").write_text("c" * 40 + "\n")
    assert report.git_commit(tmp_path) == "c" * 40


def test_write_report_makes_results_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_all = bench_module("run_all")
    out = tmp_path / "out"
    write_outputs(out)
    runs = {"loader": {"exit_code": 3, "seconds": 1.0}, "merge": {"exit_code": 0, "seconds": 2.0}}
    path = tmp_path / "results.json"
    section = run_all.write_report(
        ["tokenize", "merge", "index", "loader", "pipeline"],
        out,
        path,
        quick=False,
        runs=runs,
        load_before=[0.5, 0.5, 0.5],
    )
    results = json.loads(path.read_text())
    assert sorted(results["benches"]) == ["index", "merge", "tokenize"]
    again = {"index": {"exit_code": 0, "seconds": 3.0}}
    run_all.write_report(["index"], out, path, quick=False, runs=again, load_before=[0.5] * 3)
    assert json.loads(path.read_text())["runs"] == {**runs, **again}
    path.write_text(json.dumps(results))
    assert results["missing"] == ["pipeline", "loader"]
    assert results["runs"] == runs
    assert results["benches"]["merge"]["data"] == fake_merge()
    machine = results["machine"]
    assert machine["load_before"] == [0.5, 0.5, 0.5] and len(machine["load_after"]) == 3
    assert machine["cpus"] >= 1 and machine["python"].count(".") == 2 and machine["numpy"]
    assert [r["benchmark"] for r in results["rows"]].count("merge 8 shards, 1074 MB") == 1
    assert section == report.markdown(results)
    assert section.endswith("No results from: pipeline, loader.")


def test_report_only_keeps_the_machine_of_the_run(tmp_path: Path) -> None:
    """Rebuilding without running keeps the load and date of the run that made the JSON."""
    run_all = bench_module("run_all")
    out = tmp_path / "out"
    write_outputs(out)
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"machine": MACHINE, "runs": {"merge": {"exit_code": 0}}}))
    section = run_all.write_report(
        ["merge"], out, path, quick=False, runs={}, load_before=[9.0, 9.0, 9.0]
    )
    results = json.loads(path.read_text())
    assert results["machine"] == MACHINE and results["runs"] == {"merge": {"exit_code": 0}}
    assert section.startswith(report.describe_machine(MACHINE))
    path.unlink()
    run_all.write_report(["merge"], out, path, quick=False, runs={}, load_before=[9.0, 9.0, 9.0])
    assert json.loads(path.read_text())["machine"]["load_before"] == [9.0, 9.0, 9.0]
