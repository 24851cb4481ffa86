"""Benchmark ``open_blend`` at realistic size: datasets of 2.5 × 10⁸ sequences, per process.

The blend is synthetic but in the real on-disk format, and sparse: two datasets of
``--sequences`` sequences each (default 2.5 × 10⁸, ``--tokens-per-sequence`` 1,024 tokens, so
a 512 GB ``.bin`` and a 7 GB ``.idx`` each, written as sparse files of a few MB). Each ``.idx``
has a valid header and sizes; its arrays are real (lengths, pointers, boundaries) for the
first ``WINDOW`` sequences and at the ends, holes (zeros) elsewhere. Each dataset has its
manifest with the counts a tokenizer records and its per-block sha256 list (one entry per
8 MB of ``.bin``: what a real writer records), a Nanoset cache entry of one epoch (document,
sample and shuffle index, real in the window), and the blend has its arrays (real in the
window) and sealed manifests, pointer and version. Sha256 records are placeholders: only
``verify="fast"`` runs here (a full verify hashes every byte by design).

Measured per process, each in a fresh Python (imports done before measuring), on a warm page
cache (one untimed open first): the wall time of ``open_blend``, the growth of its resident set
(``VmRSS`` after − before; in brackets ``RssAnon``, the process's own memory, the rest being
shared page-cache pages it mapped) and its peak (``VmHWM`` after resetting it, − before), minor and
major page faults (``getrusage``) and ``rchar`` of ``/proc/self/io``; then the same for reading
the first batch of ``BatchSampler`` (``--batch`` samples of S + 1 tokens). Goals (issue 23):
opening takes ≤ 50 ms and adds ≤ 16 MB RSS per process.

    python bench/bench_open.py [--sequences 250000000] [--repeat 5] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _util import table, write_results

from tokenmill.atomic import file_sha256, write_json
from tokenmill.formats import nanoset_cache as _index_cache
from tokenmill.formats.blend_manifest import FORMAT_VERSION, seal
from tokenmill.formats.indexed import HEADER_SIZE, MAGIC, VERSION, dtype_code
from tokenmill.formats.virtual_merge import is_virtual, shard_entry, write_virtual_manifest
from tokenmill.indices.nanoset import cache_key
from tokenmill.indices.settings import NanosetSettings
from tokenmill.storage.versions import version_hash

S = 2048  # sequence length of the samples
WINDOW = 8192  # sequences with real index values and tokens at the start of each dataset
BLOCK = 8 << 20  # the dataset manifests' per-block sha256 block size
GOAL_SECONDS, GOAL_RSS = 0.050, 16 << 20
FAKE_SHA = "0" * 64


def sparse_file(path: Path, size: int, writes: list[tuple[int, bytes]]) -> None:
    """A file of ``size`` bytes: holes except ``writes`` (offset, bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)
        for offset, data in writes:
            fh.seek(offset)
            fh.write(data)


def sparse_npy(path: Path, dtype: str, shape: tuple[int, ...], window: np.ndarray) -> int:
    """A ``.npy`` of ``shape``, holes except its first rows (``window``); its size."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    out[: len(window)] = window
    out.flush()
    del out
    return path.stat().st_size


def dataset(
    root: Path, name: str, n: int, length: int, seed: int, shards: int
) -> tuple[Path, dict]:
    """The merged dataset ``name``: one sparse pair of ``n`` sequences, or (``shards`` > 0) a
    virtual merge of that many sparse shard pairs; its prefix and manifest."""
    prefix = root / f"merged/{name}/{'0' * 16}/{name}_text_document"
    if not shards:
        return prefix, pair(prefix, n, length, seed, kind="merged")
    records = []
    for k in range(shards):
        lo, hi = k * n // shards, (k + 1) * n // shards
        shard = root / f"tokens/{name}/s{k:05d}_text_document"
        made = pair(shard, hi - lo, length, seed + k, kind="tokenized", window=k == 0)
        records.append(shard_entry(f"s{k:05d}", shard, prefix.parent, made))
    config = {"merge": "virtual"}
    path = prefix.parent / "manifests" / f"{prefix.name}.manifest.json"
    manifest = write_virtual_manifest(
        path, name=prefix.name, shards=records, dtype="uint16", config=config, quarantined=0,
        extends=None,
    )  # fmt: skip
    return prefix, manifest


def pair(prefix: Path, n: int, length: int, seed: int, *, kind: str, window: bool = True) -> dict:
    """A sparse pair of ``n`` sequences of ``length`` tokens (real in the window) + manifest."""
    itemsize = 2
    w = min(n, WINDOW) if window else 0
    lengths = np.full(w, length, "<i4")
    pointers = np.arange(w, dtype="<i8") * length * itemsize
    docs_head = np.arange(w + 1, dtype="<i8")
    header = MAGIC + struct.pack("<QBQQ", VERSION, dtype_code(np.uint16), n, n + 1)
    lengths_at, pointers_at = HEADER_SIZE, HEADER_SIZE + 4 * n
    docs_at = pointers_at + 8 * n
    idx_size = docs_at + 8 * (n + 1)
    sparse_file(
        Path(f"{prefix}.idx"),
        idx_size,
        [
            (0, header),
            (lengths_at, lengths.tobytes()),
            (pointers_at, pointers.tobytes()),
            (docs_at, docs_head.tobytes()),
            (idx_size - 8, struct.pack("<q", n)),
        ],
    )
    tokens = np.random.default_rng(seed).integers(0, 50000, w * length, dtype=np.uint16)
    bin_size = n * length * itemsize
    sparse_file(Path(f"{prefix}.bin"), bin_size, [(0, tokens.tobytes())])
    files = {
        f"{prefix.name}.bin": {
            "bytes": bin_size,
            "sha256": FAKE_SHA,
            "block_bytes": BLOCK,
            "block_sha256": [f"{i:064x}" for i in range(-(-bin_size // BLOCK))],
        },
        f"{prefix.name}.idx": {"bytes": idx_size, "sha256": FAKE_SHA},
    }
    manifest = {
        "format_version": 1,
        "kind": kind,
        "prefix": prefix.name,
        "inputs": [],
        "config": {},
        "counts": {"documents": n, "sequences": n, "tokens": n * length, "quarantined": 0},
        "files": files,
        "content_hash": version_hash({"bench_open": str(prefix), "n": n}),
    }
    write_json(prefix.parent / "manifests" / f"{prefix.name}.manifest.json", manifest)
    return manifest


def cache_entry(root: Path, content: str, n: int, length: int) -> tuple[str, dict, dict]:
    """A one-epoch Nanoset entry over ``n`` sequences of ``length`` tokens (real in the
    window): sample j starts at token j·S."""
    samples = (n * length - 1) // S
    key = cache_key(content, "train", NanosetSettings(S, "1,0,0", seed=1234), (0, n), samples)
    digest = _index_cache.key_hash(key)
    base = root / "nanoset" / f"{digest}-Nanoset-train"
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = {kind: Path(f"{base}-{kind}_index.npy") for kind in ("document", "sample", "shuffle")}
    paths["description"] = Path(f"{base}-description.json")
    w = (min(n, WINDOW) * length - 1) // S  # samples wholly inside the window
    starts = np.arange(w + 1, dtype=np.int64) * S
    window = {
        "document": np.arange(min(n, WINDOW), dtype="<i4"),
        "sample": np.stack([starts // length, starts % length], axis=1).astype("<i4"),
        "shuffle": ((np.arange(w) * 7919 + 13) % w).astype("<u4"),
    }
    shapes = {"document": (n,), "sample": (samples + 1, 2), "shuffle": (samples,)}
    dtypes = {"document": "<i4", "sample": "<i4", "shuffle": "<u4"}
    files = {}
    for kind in ("document", "sample", "shuffle"):
        size = sparse_npy(paths[kind], dtypes[kind], shapes[kind], window[kind])
        files[kind] = {
            "file": paths[kind].name,
            "dtype": dtypes[kind],
            "shape": list(shapes[kind]),
            "bytes": size,
            "sha256": FAKE_SHA,
        }
    description = {"key": key, "hash": digest, "counts": {"num_samples": samples}, "files": files}
    _index_cache.write_description(paths["description"], description)
    return digest, {k: p for k, p in paths.items()}, {"samples": samples, "window": w}


def dataset_files(prefix: Path, manifest: dict, entry: Any) -> dict[str, Any]:
    """A blend's record of a dataset's files: the pair, or a virtual merge's manifest (whose
    sha256 open_blend checks: a real one)."""
    if not is_virtual(manifest):
        return {k: entry(Path(f"{prefix}.{k}")) for k in ("bin", "idx")}
    path = prefix.parent / "manifests" / f"{prefix.name}.manifest.json"
    return {"manifest": {**entry(path), "sha256": file_sha256(path)}}


def blend_manifest(
    base: Path, version: str, datasets: list[dict], split: dict, files: dict[str, Path]
) -> dict[str, Any]:
    """The sealed blend manifest with every path relative to ``base`` (pointer or version)."""

    def rel(path: Path) -> str:
        return os.path.relpath(path, base)

    def entry(path: Path) -> dict[str, Any]:
        return {"path": rel(path), "bytes": path.stat().st_size, "sha256": FAKE_SHA}

    dataset_entries = [
        {
            "name": d["name"],
            "prefix": rel(d["prefix"]),
            "content_hash": d["manifest"]["content_hash"],
            "dtype": "uint16",
            "num_sequences": d["manifest"]["counts"]["sequences"],
            "num_tokens": d["manifest"]["counts"]["tokens"],
            "files": dataset_files(d["prefix"], d["manifest"], entry),
        }
        for d in datasets
    ]
    parts = [
        {
            "name": d["name"],
            "split_range": [0, d["manifest"]["counts"]["sequences"]],
            "tokens": d["manifest"]["counts"]["tokens"],
            "num_samples": d["samples"],
            "length": d["samples"],
            "samples_used": d["samples"],
            "epochs": 1.0,
            "index": {
                "cache_hash": d["digest"],
                "files": {kind: entry(p) for kind, p in d["paths"].items()},
            },
        }
        for d in datasets
    ]
    names = [d["name"] for d in datasets]
    return seal(
        {
            "format_version": FORMAT_VERSION,
            "kind": "blend",
            "name": "bench",
            "version": version,
            "semantics": "megatron",
            "sequence_length": S,
            "add_extra_token": True,
            "split": "1,0,0",
            "seed": 1234,
            "weighting": {
                "weights": dict.fromkeys(names, 0.5),
                "temperature": None,
                "normalized": dict.fromkeys(names, 0.5),
            },
            "datasets": dataset_entries,
            "splits": {
                "train": {
                    **split,
                    "files": {k: entry(p) for k, p in files.items()},
                    "datasets": parts,
                }
            },
        }
    )


def build(root: Path, n: int, length: int, shards: int = 0) -> Path:
    """The sparse blend (see the module docstring); returns the pointer manifest path."""
    datasets = []
    for i, name in enumerate(("docs", "code")):
        prefix, manifest = dataset(root, name, n, length, i, shards)
        digest, paths, sizes = cache_entry(root, manifest["content_hash"], n, length)
        entry = {"name": name, "prefix": prefix, "manifest": manifest, "digest": digest}
        datasets.append({**entry, "paths": paths, **sizes})
    size = sum(d["samples"] for d in datasets)
    window = 2 * min(d["window"] for d in datasets)
    version = version_hash({"bench_open": n, "datasets": [d["digest"] for d in datasets]})
    blend = root / "blends/bench"
    vdir = blend / "versions" / version[:16]
    vdir.mkdir(parents=True, exist_ok=True)
    files = {
        "dataset_index": vdir / "train-dataset_index.npy",
        "dataset_sample_index": vdir / "train-dataset_sample_index.npy",
    }
    head = np.arange(window)
    sparse_npy(files["dataset_index"], "<i2", (size,), head % 2)
    sparse_npy(files["dataset_sample_index"], "<i8", (size,), head // 2)
    split = {"mode": "weighted", "samples_requested": size, "size": size}
    write_json(vdir / "manifest.json", blend_manifest(vdir, version, datasets, split, files))
    pointer = blend / "manifest.json"
    write_json(pointer, blend_manifest(blend, version, datasets, split, files))
    return pointer


# The measurement, run in a fresh interpreter per repeat: prints one JSON line.
CHILD = r"""
import json, os, resource, sys, time
from pathlib import Path
from tokenmill.loader import BatchSampler, open_blend

def status():
    fields = dict(l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines())
    io = dict(l.split(": ") for l in Path("/proc/self/io").read_text().splitlines())
    ru = resource.getrusage(resource.RUSAGE_SELF)
    kb = lambda name: int(fields[name].split()[0]) << 10
    return {"rss": kb("VmRSS"), "hwm": kb("VmHWM"), "anon": kb("RssAnon"),
            "minflt": ru.ru_minflt, "majflt": ru.ru_majflt, "rchar": int(io["rchar"])}

def measured(fn):
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before, start = status(), time.perf_counter()
    value = fn()
    wall = time.perf_counter() - start
    after = status()
    return value, {"wall_s": wall, "rss_delta": after["rss"] - before["rss"],
                   "peak_rss_delta": after["hwm"] - before["rss"],
                   "anon_delta": after["anon"] - before["anon"],
                   **{k: after[k] - before[k] for k in ("minflt", "majflt", "rchar")}}

pointer, batch = sys.argv[1], int(sys.argv[2])
ds, opened = measured(lambda: open_blend(pointer))
indices = next(iter(BatchSampler(len(ds), global_batch_size=batch, rank=0, world_size=1)))
tokens, first = measured(lambda: ds.get_batch(indices))
assert tokens.shape == (batch, ds.width), tokens.shape
print(json.dumps({"open": opened, "batch": first, "samples": len(ds)}))
"""


def measure(pointer: Path, batch: int, repeat: int) -> dict[str, Any]:
    """Medians over ``repeat`` fresh processes (after one untimed warm-up process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-c", CHILD, str(pointer), str(batch)]
    runs = []
    for i in range(repeat + 1):
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        if i:
            runs.append(json.loads(out.splitlines()[-1]))
    result: dict[str, Any] = {"samples": runs[0]["samples"]}
    for phase in ("open", "batch"):
        keys = runs[0][phase]
        result[phase] = {k: statistics.median(r[phase][k] for r in runs) for k in keys}
        result[phase]["wall_min_s"] = min(r[phase]["wall_s"] for r in runs)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=250_000_000)
    parser.add_argument("--tokens-per-sequence", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument(
        "--virtual", type=int, default=0, metavar="SHARDS", help="virtual merges of SHARDS pairs"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="where to build (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the built blend")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-open-"))
    try:
        start = time.perf_counter()
        pointer = build(root, args.sequences, args.tokens_per_sequence, args.virtual)
        built = time.perf_counter() - start
        apparent = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        res = measure(pointer, args.batch, args.repeat)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    rows = [["phase", "wall ms (min)", "RSS +MB (anon)", "peak RSS +MB", "minflt", "majflt"]]
    rows[0].append("rchar")
    for phase in ("open", "batch"):
        r = res[phase]
        rows.append(
            [
                "open_blend" if phase == "open" else f"first batch {args.batch}×{S + 1}",
                f"{r['wall_s'] * 1e3:.1f} ({r['wall_min_s'] * 1e3:.1f})",
                f"{r['rss_delta'] / 2**20:.1f} ({r['anon_delta'] / 2**20:.1f})",
                f"{r['peak_rss_delta'] / 2**20:.1f}",
                f"{r['minflt']:.0f}",
                f"{r['majflt']:.0f}",
                f"{r['rchar']:.0f}",
            ]
        )
    print(
        f"open_blend of 2 datasets × {args.sequences:,} sequences, {res['samples']:,} samples "
        f"({apparent / 1e12:.2f} TB of sparse files), median of {args.repeat} processes"
    )
    print(table(rows))
    quick = args.sequences < 250_000_000
    opened = res["open"]
    met = opened["wall_s"] <= GOAL_SECONDS and opened["peak_rss_delta"] <= GOAL_RSS
    results = {
        "quick": quick,
        "sequences": args.sequences,
        "tokens_per_sequence": args.tokens_per_sequence,
        "apparent_bytes": apparent,
        "build_s": built,
        **res,
        "report_rows": [
            {
                "benchmark": f"open_blend 2 × {args.sequences:,} sequences",
                "measure": "verify=fast, fresh process, warm: wall median; peak RSS added",
                "ours": f"{opened['wall_s'] * 1e3:.1f} ms; "
                f"{opened['peak_rss_delta'] / 2**20:.1f} MB",
                "baseline": "",
                "ratio": "",
                "target": "≤ 50 ms; ≤ 16 MB",
                "met": None if quick else met,
            }
        ],
    }
    path = write_results("open", results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
