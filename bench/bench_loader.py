"""Loader read speed (issue: random ``get_batch`` >= 0.8x the bandwidth of a contiguous read of
the same bytes, and >= 3x a Megatron-style per-sample ``__getitem__`` loop).

Builds one uint16 dataset with log-normal document lengths (median ~400 tokens, mean ~700, like
web text), a one-epoch Megatron Nanoset index over it, warms the page cache, then alternates:

- ``contiguous``: one contiguous memmap slice of B·(S+1) tokens into a fresh int64 [B, S+1]
  array (the same output ``get_batch`` produces, from bytes laid out ideally);
- ``contiguous raw``: the same slice copied in the token dtype (context only);
- ``get_batch``: B uniformly random samples through ``NanosetDataset.get_batch``;
- ``getitem loop``: the same through ``np.stack([ds[k] ...])`` (Megatron's per-sample assembly);
- ``block gather floor``: the pieces of random batches read with no per-piece Python at all
  (fixed 64-token blocks from each piece start through one fancy index, no fix-ups, then the
  same int64 cast): a floor for any numpy-only gather of these pieces (context only).

Training inputs (``get_training_batch``, FORMATS §11): for each of the 32 flag combinations,
the vectorized batch against megatron-core's ``__getitem__`` per sample plus the default collate
(``_megatron_getitem.py``: per-piece reads, a dense float ``tril`` and a slice assignment per
EOD for the attention mask), on the same random indices, alternated; both outputs are checked
equal first. Documents end with an EOD. The combinations that build the dense ``[B, 1, S, S]``
mask run at ``--mask-batch`` (the output alone is B·S² bytes) and are reported apart from the
>= 10x goal, which covers the others. A third timing, the floor, is ``get_batch`` plus writing
each output array once (``np.ones``); Megatron loop / floor bounds any implementation that
reads the samples and writes the outputs.

On the shared 2-core VM this was written on (2026-11-25, 512 x 2048, two runs), the Megatron
loop costs 18-40 ms CPU per batch, ours 3.2-5.6 ms, within ~1.5 ms of the floor (~3-4 ms:
~0.5 ms to copy the ~2,000 pieces, the rest writing ~28 MB of fresh int64/float32 outputs):
4.7-9x in CPU (median ~7x), short of 10x because the bound itself is 5-16x (median ~9x). The
reset attention mask, one gather of S-byte rows, runs at 10-19x; the causal-only mask is a
copy either way (1x). Wall times on that VM carry other jobs' load; CPU is the steadier column.

Bandwidth counts token bytes read (B·(S+1)·itemsize per batch). Wall and CPU (process time) are
medians over repeats of per-batch means; the methods alternate (order reversed every repeat).

The baseline is the generous reading of "a contiguous read of the same number of bytes": it
pays the same int64 output as ``get_batch`` (a raw copy of the bytes is ~2.5x faster still).
On the 2-core VM this was written on, ``get_batch`` reaches ~0.25-0.3x of it, not 0.8x: the
contiguous read is one streaming cast, while a random batch is ~2,000 pieces (4 per sample at
~700-token documents) at random places of the memmap. Each piece costs ~0.4 µs of Python (a
memoryview slice joined into one buffer) and, whatever copies it, TLB and cache misses: the
block-gather floor, with no Python per piece, lands at ~0.6x, so 0.8x is out of
reach for numpy alone here.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _megatron_getitem import MegatronGetitem
from _util import table, write_results

from tokenmill.formats.indexed import IndexedDataset, IndexedDatasetWriter
from tokenmill.indices.nanoset import build_nanoset_indices
from tokenmill.loader import NanosetDataset

BLOCK = 64  # tokens per block of the floor gather
FLOOR_BATCHES = 32
EOD = 50256  # GPT-2's, ends every document
FLAGS = {
    "P": "reset_position_ids",
    "A": "reset_attention_mask",
    "L": "eod_mask_loss",
    "M": "create_attention_mask",
    "D": "inter_document_masking",
}
TRAINING_GOAL = 10.0


def make_dataset(prefix: Path, num_tokens: int, seed: int) -> IndexedDataset:
    """Random uint16 tokens in log-normal-length documents ending with ``EOD``, in chunks."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        written = 0
        while written < num_tokens:
            lengths = np.maximum(1, rng.lognormal(6.0, 1.0, 20_000).astype(np.int64))
            lengths = lengths[np.cumsum(lengths) <= num_tokens - written]
            if not len(lengths):
                break
            tokens = rng.integers(0, EOD, int(lengths.sum()), dtype=np.uint16)
            tokens[np.cumsum(lengths) - 1] = EOD
            writer.add_documents(tokens, lengths)
            written += int(lengths.sum())
    return IndexedDataset(prefix)


def measure(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """Mean wall and CPU seconds per call over ``iters`` calls."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - wall0) / iters, (time.process_time() - cpu0) / iters


def block_floor(ds: NanosetDataset, batch: int, rng: np.random.Generator) -> Callable[[], object]:
    """The same pieces read without per-piece Python: fixed ``BLOCK``-token blocks from each
    piece start (one fancy index over a strided view of the memmap; tails over-read, no
    fix-ups, so the bytes are not a valid batch), then the int64 cast. Block starts are
    precomputed for ``FLOOR_BATCHES`` random batches, used in turn."""
    tokens = np.asarray(ds.data.tokens)
    size, n = tokens.itemsize, len(tokens)
    blocks = np.ndarray(
        (n - BLOCK + 1,), f"V{BLOCK * size}", buffer=ds.data.buffer(0), strides=(size,)
    )
    pool = []
    for _ in range(FLOOR_BATCHES):
        _, starts, stops, _ = ds.pieces(rng.integers(0, len(ds), batch))
        first, count = starts // size, -(-(stops - starts) // size // BLOCK)
        step = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        pool.append(np.minimum(np.repeat(first, count) + BLOCK * step, n - BLOCK))
    turn = itertools.cycle(pool)
    span = batch * ds.width

    def floor() -> np.ndarray:
        gathered = blocks[next(turn)].view(tokens.dtype)
        out = np.empty((batch, ds.width), dtype=np.int64)
        np.copyto(out.reshape(-1), gathered[:span])
        return out

    return floor


def methods(
    ds: NanosetDataset, batch: int, iters: int
) -> dict[str, tuple[Callable[[], object], int]]:
    """The compared reads, each with the number of calls per measurement."""
    tokens = np.asarray(ds.data.tokens)
    width = ds.width
    span = batch * width
    rng = np.random.default_rng(1)

    def contiguous() -> np.ndarray:
        start = int(rng.integers(0, len(tokens) - span))
        out = np.empty((batch, width), dtype=np.int64)
        np.copyto(out, tokens[start : start + span].reshape(batch, width))
        return out

    def contiguous_raw() -> np.ndarray:
        start = int(rng.integers(0, len(tokens) - span))
        return tokens[start : start + span].copy()

    return {
        "contiguous": (contiguous, iters),
        "contiguous raw": (contiguous_raw, iters),
        "get_batch": (lambda: ds.get_batch(rng.integers(0, len(ds), batch)), iters),
        "block gather floor": (block_floor(ds, batch, rng), iters),
        "getitem loop": (
            lambda: np.stack([ds[k] for k in rng.integers(0, len(ds), batch)]),
            max(2, iters // 4),
        ),
    }


def run(ds: NanosetDataset, batch: int, iters: int, repeat: int) -> dict[str, dict[str, float]]:
    """Alternate the methods ``repeat`` times (order reversed every other round)."""
    compared = methods(ds, batch, iters)
    for fn, _ in compared.values():
        fn()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in compared}
    for rep in range(repeat):
        for name in list(compared) if rep % 2 == 0 else list(reversed(compared)):
            fn, calls = compared[name]
            runs[name].append(measure(fn, calls))
    nbytes = batch * ds.width * ds.data.dtype.itemsize
    summary = {}
    for name, results in runs.items():
        wall = statistics.median(r[0] for r in results)
        summary[name] = {
            "wall_ms": wall * 1e3,
            "cpu_ms": statistics.median(r[1] for r in results) * 1e3,
            "mb_s": nbytes / wall / 1e6,
        }
    return summary


def report(summary: dict[str, dict[str, float]]) -> dict[str, object]:
    """Print the table and the two ratios; the results for the JSON."""
    base = summary["contiguous"]["mb_s"]
    rows = [["method", "wall ms/batch", "cpu ms/batch", "MB/s", "vs contiguous"]]
    for name, s in summary.items():
        rows.append(
            [
                name,
                f"{s['wall_ms']:.3f}",
                f"{s['cpu_ms']:.3f}",
                f"{s['mb_s']:.0f}",
                f"{s['mb_s'] / base:.2f}x",
            ]
        )
    ratio = summary["get_batch"]["mb_s"] / base
    speedup = summary["getitem loop"]["wall_ms"] / summary["get_batch"]["wall_ms"]
    print(table(rows))
    print(
        f"get_batch bandwidth / contiguous: {ratio:.2f} (target >= 0.80); "
        f"get_batch vs getitem loop: {speedup:.1f}x (target >= 3x)"
    )
    return {
        "results": summary,
        "ratio_get_batch_vs_contiguous": ratio,
        "speedup_get_batch_vs_getitem_loop": speedup,
    }


def training_combos() -> list[dict[str, bool]]:
    """The 32 flag combinations, flag-free first."""
    names = list(FLAGS.values())
    return [
        dict(zip(names, bits, strict=True))
        for bits in itertools.product((False, True), repeat=len(names))
    ]


def combo_label(flags: dict[str, bool]) -> str:
    """``PALMD`` letters of the flags set, ``-`` for none."""
    return "".join(letter for letter, name in FLAGS.items() if flags[name]) or "-"


def run_training(
    ds: NanosetDataset, batch: int, mask_batch: int, iters: int, repeat: int
) -> list[dict[str, Any]]:
    """Every flag combination, the dense-mask ones at ``mask_batch``."""
    rng = np.random.default_rng(2)
    results = []
    for flags in training_combos():
        dense = flags["create_attention_mask"] and not flags["inter_document_masking"]
        size = mask_batch if dense else batch
        pool = [rng.integers(0, len(ds), size) for _ in range(4)]
        row: dict[str, Any] = {"flags": combo_label(flags), "dense_mask": dense, "batch": size}
        results.append(row | time_combo(ds, flags, pool, iters, repeat))
    return results


def time_combo(
    ds: NanosetDataset, flags: dict[str, bool], pool: list[np.ndarray], iters: int, repeat: int
) -> dict[str, float]:
    """Vectorized vs the Megatron per-sample loop on the batches of ``pool`` in turn, checked
    equal first, then alternated ``repeat`` times (order reversed every other round) with a
    floor (``get_batch`` plus writing each output array once with ``np.ones``): medians of
    per-batch wall and CPU milliseconds and the speed-ups."""
    megatron = MegatronGetitem(ds, EOD, **flags)
    ours, theirs = ds.get_training_batch(pool[0], eod_id=EOD, **flags), megatron.batch(pool[0])
    if list(ours) != list(theirs) or not all(
        ours[k].dtype == theirs[k].dtype and np.array_equal(ours[k], theirs[k]) for k in ours
    ):
        raise AssertionError(f"{combo_label(flags)}: get_training_batch != the Megatron loop")
    shapes = [(v.shape, v.dtype) for v in ours.values()]
    del ours, theirs
    turn = itertools.cycle(pool)

    def floor() -> list[np.ndarray]:
        return [ds.get_batch(next(turn))] + [np.ones(shape, dtype) for shape, dtype in shapes]

    compared = {
        "vectorized": (lambda: ds.get_training_batch(next(turn), eod_id=EOD, **flags), iters),
        "megatron": (lambda: megatron.batch(next(turn)), 1),
        "floor": (floor, iters),
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in compared}
    for rep in range(repeat):
        for name in list(compared) if rep % 2 == 0 else list(reversed(compared)):
            fn, calls = compared[name]
            runs[name].append(measure(fn, calls))
    out = {}
    for name, values in runs.items():
        out[f"{name}_wall_ms"] = statistics.median(v[0] for v in values) * 1e3
        out[f"{name}_cpu_ms"] = statistics.median(v[1] for v in values) * 1e3
    out["speedup_wall"] = out["megatron_wall_ms"] / out["vectorized_wall_ms"]
    out["speedup_cpu"] = out["megatron_cpu_ms"] / out["vectorized_cpu_ms"]
    out["bound_wall"] = out["megatron_wall_ms"] / out["floor_wall_ms"]
    return out


def report_training(results: list[dict[str, Any]], width: int) -> dict[str, float]:
    """Print the per-combination table and the goal line; the summary for the JSON."""
    rows = [
        [
            "flags",
            "batch",
            "ours wall/cpu ms",
            "Megatron loop wall/cpu ms",
            "speed-up w/c",
            "floor wall/cpu ms",
            "bound",
        ]
    ]
    for r in results:
        rows.append(
            [
                r["flags"] + (" (dense mask)" if r["dense_mask"] else ""),
                f"{r['batch']}x{width}",
                f"{r['vectorized_wall_ms']:.1f} / {r['vectorized_cpu_ms']:.1f}",
                f"{r['megatron_wall_ms']:.1f} / {r['megatron_cpu_ms']:.1f}",
                f"{r['speedup_wall']:.1f}x / {r['speedup_cpu']:.1f}x",
                f"{r['floor_wall_ms']:.1f} / {r['floor_cpu_ms']:.1f}",
                f"{r['bound_wall']:.1f}x",
            ]
        )
    print(table(rows))
    print("flags: " + ", ".join(f"{letter}={name}" for letter, name in FLAGS.items()))
    print("floor: get_batch + one np.ones per output array; bound: Megatron loop / floor")
    goal = [r["speedup_wall"] for r in results if not r["dense_mask"]]
    dense = [r["speedup_wall"] for r in results if r["dense_mask"]]
    summary = {
        "min_speedup_wall": min(goal),
        "median_speedup_wall": statistics.median(goal),
        "min_speedup_wall_dense_mask": min(dense),
    }
    print(
        f"get_training_batch vs Megatron per-sample loop: min {min(goal):.1f}x, median "
        f"{statistics.median(goal):.1f}x over the {len(goal)} combinations without the dense "
        f"mask (goal >= {TRAINING_GOAL:.0f}x); dense mask: min {min(dense):.1f}x"
    )
    return summary


def bench(args: argparse.Namespace, root: Path) -> None:
    """Build the dataset and index under ``root``, warm the page cache, measure, report."""
    t0 = time.perf_counter()
    data = make_dataset(root / "bench_text_document", args.tokens, 0)
    arrays = build_nanoset_indices(
        data.sequence_lengths,
        (0, len(data)),
        sequence_length=args.sequence_length,
        seed=1234,
        num_samples=None,
    )
    ds = NanosetDataset(data, *arrays, sequence_length=args.sequence_length)
    print(
        f"dataset: {data.num_tokens} tokens, {len(data)} documents (mean "
        f"{data.num_tokens / len(data):.0f}), {len(ds)} samples; setup "
        f"{time.perf_counter() - t0:.1f}s"
    )
    tokens = np.asarray(data.tokens)
    int(np.add.reduce(tokens[:: 4096 // tokens.itemsize], dtype=np.int64))  # touch every page
    extra: dict[str, object] = {
        "batch": args.batch,
        "sequence_length": args.sequence_length,
        "token_bytes_per_batch": args.batch * ds.width * tokens.itemsize,
        "dataset": {"tokens": data.num_tokens, "documents": len(data), "samples": len(ds)},
        "repeat": args.repeat,
        "iters": args.iters,
    }
    if args.part in ("all", "read"):
        extra |= report(run(ds, args.batch, args.iters, args.repeat))
    if args.part in ("all", "training"):
        results = run_training(
            ds, args.batch, args.mask_batch, args.training_iters, args.training_repeat
        )
        summary = report_training(results, ds.sequence_length)
        extra["training"] = {
            "mask_batch": args.mask_batch,
            "iters": args.training_iters,
            "repeat": args.training_repeat,
            "goal_speedup": TRAINING_GOAL,
            **summary,
            "results": results,
        }
    path = write_results("loader" if args.part == "all" else f"loader-{args.part}", extra)
    print(f"wrote {path}")


def main() -> None:
    """Parse arguments and run in ``--dir`` or a temporary directory removed afterwards."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64_000_000, help="dataset size in tokens")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--sequence-length", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20, help="batches per measurement")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--part", choices=("all", "read", "training"), default="all")
    ap.add_argument("--mask-batch", type=int, default=64, help="batch of the dense-mask runs")
    ap.add_argument("--training-iters", type=int, help="our batches per measurement")
    ap.add_argument("--training-repeat", type=int)
    ap.add_argument("--dir", default=None, help="work directory kept afterwards (default: temp)")
    args = ap.parse_args()
    args.training_iters = args.training_iters or min(args.iters, 5)
    args.training_repeat = args.training_repeat or min(args.repeat, 5)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        bench(args, Path(args.dir))
        return
    with tempfile.TemporaryDirectory(prefix="tm-bench-loader-") as tmp:
        bench(args, Path(tmp))


if __name__ == "__main__":
    main()
