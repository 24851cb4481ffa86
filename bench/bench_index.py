"""Benchmark the Nanoset index build and the greedy blend against the issue's targets.

Workloads (defaults = the issue's sizes):
- nanoset: 2,000,000 sequences (log-normal lengths, median 600 tokens), S = 2048, megatron
  semantics with 3 epochs (joint shuffle and separate-final-epoch variants) and nanotron.
  Baseline in the same run: Megatron's path emulated — its numpy calls exactly (mgrid/int32
  document shuffle, uint32 sample shuffle) plus helpers.cpp's build_sample_idx loop compiled
  with numba (a stand-in for the C++ helper, which is not installed here).
- blend: 8 datasets x 20,000,000 samples, megatron semantics: the default (numba engine, one
  speculated chunk per CPU), one thread, the numpy engine. Baselines: helpers.cpp's
  build_blending_indices loop compiled with numba (C++ stand-in), and the same loop in plain
  Python, timed on a smaller size and scaled linearly per sample.

Variants alternate within each repeat; wall and CPU seconds (process_time, all threads) are
reported as min and median. The machine is shared: the load average is recorded, and under
load the two-thread overlaps are lost (wall ~ CPU). Prints a table and writes
``bench/out/index.json``. Run: ``.venv/bin/python bench/bench_index.py [--repeats 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _util import OUT_DIR

from tokenmill.indices import _blend_kernels, _jit
from tokenmill.indices.blend import build_blend_indices, normalize_weights
from tokenmill.indices.nanoset import build_nanoset_indices

OUT = OUT_DIR / "index.json"
TARGETS = {"nanoset_megatron_3_epochs": 0.5, "blend_megatron_8x20M": 0.35}
REFERENCE_CPP = {"nanoset_megatron_3_epochs": 0.46, "blend_megatron_8x20M": 0.32}


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall, cpu) seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, np.rint(rng.lognormal(np.log(600), 0.8, size=n))).astype(np.int32)


def cpp_sample_idx(sizes, doc, seq, tokens_total, out):  # type: ignore[no-untyped-def]
    """helpers.cpp build_sample_idx (extra token, drop last), as the C++ writes it."""
    num_samples = (tokens_total - 1) // seq
    d, offset = 0, 0
    out[0, 0], out[0, 1] = 0, 0
    for k in range(1, num_samples + 1):
        remaining = seq + 1
        while remaining != 0:
            length = sizes[doc[d]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                d += 1
                offset = 0
        out[k, 0], out[k, 1] = d, offset


def cpp_blending(weights, size, dataset_index, sample_index, counts):  # type: ignore[no-untyped-def]
    """helpers.cpp build_blending_indices, as the C++ writes it (``counts``: a zero per dataset).
    Compiled, the stand-in for the C++; on lists, the plain-Python baseline."""
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_error = 0, weights[0] * x - counts[0]
        for d in range(1, len(weights)):
            error = weights[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1


def megatron_path(lengths: np.ndarray, epochs: int, kernel: Callable[..., Any]) -> None:
    """GPTDataset's build (joint epochs) with the compiled stand-in for its C++ helper."""
    rng = np.random.RandomState(1234)
    indices = np.arange(len(lengths), dtype=np.int32)
    tokens = int(np.sum(lengths[indices]))
    document_index = np.mgrid[0:epochs, 0 : len(indices)][1]
    document_index[:] = indices
    document_index = document_index.reshape(-1).astype(np.int32)
    rng.shuffle(document_index)
    num_samples = (epochs * tokens - 1) // 2048
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int32)
    kernel(lengths, document_index, 2048, epochs * tokens, sample_index)
    shuffle = np.arange(0, num_samples, dtype=np.uint32)
    rng.shuffle(shuffle)


def cpp_blend_path(weights: np.ndarray, size: int, kernel: Callable[..., Any]) -> None:
    """BlendedDataset's build with the compiled stand-in for its C++ helper."""
    counts = np.zeros(weights.shape[0], dtype=np.int64)
    kernel(weights, size, np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64), counts)


def reference_blend_loop(weights: np.ndarray, size: int) -> None:
    """helpers.cpp build_blending_indices as plain Python (the per-sample baseline)."""
    w = weights.tolist()
    cpp_blending(
        w, size, np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64), [0] * len(w)
    )


def workloads(quick: bool) -> list[dict[str, Any]]:
    """Each variant: name, group, callable, optional repeats and per-size scale."""
    n_seq = 200_000 if quick else 2_000_000
    blend_size = 2_000_000 if quick else 20_000_000
    loop_size = 50_000 if quick else 200_000
    lengths = lognormal_lengths(n_seq)
    per_epoch = (int(lengths.sum()) - 1) // 2048
    joint, separate = int(2.9 * per_epoch), int(2.5 * per_epoch)
    weights = np.random.default_rng(1).random(8)
    weights_2x = normalize_weights(normalize_weights(weights))
    sample_kernel = _jit.compile_kernel(cpp_sample_idx)
    blend_kernel = _jit.compile_kernel(cpp_blending)

    def nanoset(num_samples: int, semantics: str) -> Callable[[], Any]:
        return lambda: build_nanoset_indices(
            lengths,
            (0, n_seq),
            sequence_length=2048,
            seed=1234,
            num_samples=num_samples,
            semantics=semantics,
        )

    def blend(engine: str) -> Callable[[], Any]:
        return lambda: _blend_kernels.greedy_blend(
            weights_2x, blend_size, index_dtype=np.int16, engine=engine
        )

    def one_thread() -> None:
        counts = np.zeros(len(weights_2x))
        di, dsi = np.empty(blend_size, np.int16), np.empty(blend_size, np.int64)
        _blend_kernels._run_chunk(weights_2x, np.empty(0), counts, 0, blend_size, di, dsi)

    return [
        {"name": "nanoset_megatron_3_epochs", "group": "nanoset", "fn": nanoset(joint, "megatron")},
        {
            "name": "nanoset_megatron_3_epochs_separate_final",
            "group": "nanoset",
            "fn": nanoset(separate, "megatron"),
        },
        {"name": "nanoset_nanotron_3x", "group": "nanoset", "fn": nanoset(joint, "nanotron")},
        {
            "name": "baseline_megatron_path_emulated",
            "group": "nanoset",
            "fn": lambda: megatron_path(lengths, 3, sample_kernel),
        },
        {
            "name": "blend_megatron_8x20M",
            "group": "blend",
            "fn": lambda: build_blend_indices(weights, blend_size),
        },
        {"name": "blend_numba_one_thread", "group": "blend", "fn": one_thread},
        {"name": "blend_numpy_engine", "group": "blend", "fn": blend("numpy"), "repeats": 1},
        {
            "name": "baseline_helpers_cpp_loop_emulated",
            "group": "blend",
            "fn": lambda: cpp_blend_path(weights_2x, blend_size, blend_kernel),
        },
        {
            "name": "baseline_python_loop_scaled",
            "group": "blend",
            "scale": blend_size / loop_size,
            "fn": lambda: reference_blend_loop(weights_2x, loop_size),
            "repeats": 1,
        },
    ]


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel once, on tiny inputs."""
    lengths = lognormal_lengths(1000)
    build_nanoset_indices(lengths, (0, 1000), sequence_length=64, seed=1, num_samples=None)
    build_blend_indices([0.5, 0.5], _blend_kernels.PARALLEL_MIN_SIZE)
    megatron_path(lengths, 1, _jit.compile_kernel(cpp_sample_idx))
    cpp_blend_path(np.array([0.5, 0.5]), 10, _jit.compile_kernel(cpp_blending))


def run(repeats: int, quick: bool) -> dict[str, Any]:
    variants = workloads(quick)
    warm = timed(warm_up)
    samples: dict[str, list[tuple[float, float]]] = {v["name"]: [] for v in variants}
    for rep in range(repeats):
        order = variants if rep % 2 == 0 else variants[::-1]
        for v in order:
            if rep < v.get("repeats", repeats):
                wall, cpu = timed(v["fn"])
                scale = v.get("scale", 1.0)
                samples[v["name"]].append((wall * scale, cpu * scale))
    results = []
    for v in variants:
        walls = [w for w, _ in samples[v["name"]]]
        cpus = [c for _, c in samples[v["name"]]]
        results.append(
            {
                "name": v["name"],
                "group": v["group"],
                "runs": len(walls),
                "wall_min": min(walls),
                "wall_median": statistics.median(walls),
                "cpu_min": min(cpus),
                "cpu_median": statistics.median(cpus),
                "scaled": "scale" in v,
            }
        )
    by = {r["name"]: r for r in results}
    ratios = {
        "nanoset_vs_megatron_path_emulated": by["nanoset_megatron_3_epochs"]["wall_min"]
        / by["baseline_megatron_path_emulated"]["wall_min"],
        "blend_vs_helpers_cpp_loop_emulated": by["blend_megatron_8x20M"]["wall_min"]
        / by["baseline_helpers_cpp_loop_emulated"]["wall_min"],
        "blend_vs_python_loop": by["blend_megatron_8x20M"]["wall_min"]
        / by["baseline_python_loop_scaled"]["wall_min"],
        "blend_numpy_engine_vs_default": by["blend_numpy_engine"]["wall_min"]
        / by["blend_megatron_8x20M"]["wall_min"],
    }
    return {
        "quick": quick,
        "repeats": repeats,
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "numba": _jit.numba.__version__ if _jit.available() else None,
            "load_average": os.getloadavg(),
        },
        "warmup_seconds": warm[0],
        "targets_seconds": TARGETS,
        "reference_cpp_seconds_reported": REFERENCE_CPP,
        "results": results,
        "ratios": ratios,
    }


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{'workload':44} {'runs':>4} {'wall min':>9} {'wall med':>9} {'cpu min':>8} {'target':>7}"
    )
    for r in report["results"]:
        target = None if report["quick"] else report["targets_seconds"].get(r["name"])
        mark = "" if target is None else f"{target:7.2f}"
        note = "  (scaled from a smaller run)" if r["scaled"] else ""
        print(
            f"{r['name']:44} {r['runs']:4d} {r['wall_min']:9.3f} {r['wall_median']:9.3f} "
            f"{r['cpu_min']:8.3f} {mark:>7}{note}"
        )
    for name, value in report["ratios"].items():
        print(f"ratio {name}: {value:.3f}")
    print(
        f"numba warm-up (JIT or cache load): {report['warmup_seconds']:.2f} s; "
        f"load average {report['machine']['load_average'][0]:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="10x smaller sizes")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    report = run(args.repeats, args.quick)
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
