"""Benchmark ``open_blend`` on a blend of 10⁸ train samples: fast (the default) against full.

The blend is synthetic but in the real on-disk format, built cheaply with numpy instead of the
index builders (only its size matters here): two small merged datasets whose sequences are all
``sequence_length`` tokens long, a Nanoset cache entry per dataset (document, sample and
shuffle index of ``samples / 2`` samples each, shuffle = an affine permutation) with its
description, and a version folder holding the blend arrays (``int16`` dataset index, ``int64``
sample index) and the sealed manifest, behind the ``manifest.json`` pointer — written with
``tokenmill.indices.blend_build``'s own helpers, so ``open_blend`` checks exactly what it checks on
a pipeline blend. About 2.6 GB of arrays at the default size.

Measured per mode, on a warm page cache (one untimed open first): wall time (median of
``--repeat`` opens; full: one open) and bytes read, as ``rchar`` of ``/proc/self/io`` (every
byte returned by read()-type calls, page-cache hits included: what the open asks the OS for)
and ``read_bytes`` (bytes fetched from storage: ~0 when warm). Memory-mapped pages touched are
in neither; the fast open touches only the ``.npy`` headers (read with read()) and no array
page. A batch of 512 samples is read after the fast open to show it works. Targets (issue 12):
fast open ≤ 0.5 s and ≤ 10 MB read.

    python bench/bench_open.py [--samples 100000000] [--repeat 5] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _util import table, write_results

from tokenmill.atomic import write_json
from tokenmill.formats import nanoset_cache as _index_cache
from tokenmill.formats.blend_manifest import FORMAT_VERSION, seal
from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.indices.blend_build import _rebased
from tokenmill.indices.blend_plan import dataset_entry, file_entry
from tokenmill.indices.nanoset import cache_key
from tokenmill.loader import open_blend
from tokenmill.storage.versions import version_hash

S = 64  # sequence length
DOCS = 4096  # sequences per dataset
CHUNK = 1 << 24
TARGET_SECONDS, TARGET_BYTES = 0.5, 10_000_000


def io_counters() -> dict[str, int]:
    """``rchar`` and ``read_bytes`` of this process (Linux ``/proc/self/io``)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"rchar": int(fields["rchar"]), "read_bytes": int(fields["read_bytes"])}


def chunked(path: Path, dtype: str, shape: tuple[int, ...], fill: Any) -> None:
    """A ``.npy`` written in chunks: ``fill(start, stop)`` gives rows start..stop."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    for start in range(0, shape[0], CHUNK):
        stop = min(shape[0], start + CHUNK)
        out[start:stop] = fill(start, stop)
    out.flush()
    del out


def dataset(root: Path, name: str, seed: int) -> Path:
    prefix = root / f"merged/{name}/{'0' * 16}/{name}_text_document"
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(rng.integers(0, 50000, DOCS * S), np.full(DOCS, S))
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={})
    return prefix


def cache_entry(root: Path, content_hash: str, n: int) -> tuple[str, dict[str, Path], dict]:
    """One Nanoset cache entry of ``n`` samples: sample k = sequence k % DOCS plus one token."""
    key = cache_key(
        content_hash,
        semantics="megatron",
        split="train",
        split_spec="1,0,0",
        split_range=(0, DOCS),
        sequence_length=S,
        seed=1234,
        num_samples=n,
        add_extra_token=True,
        drop_last_partial=True,
    )
    digest = _index_cache.key_hash(key)
    base = root / "nanoset" / f"{digest}-Nanoset-train"
    paths = {kind: Path(f"{base}-{kind}_index.npy") for kind in ("document", "sample", "shuffle")}
    paths["description"] = Path(f"{base}-description.json")
    base.parent.mkdir(parents=True, exist_ok=True)
    step = 2654435761 % n or 1
    while np.gcd(step, n) != 1:
        step += 1
    chunked(paths["document"], "<i4", (n + 1,), lambda a, b: np.arange(a, b) % DOCS)
    chunked(
        paths["sample"],
        "<i4",
        (n + 1, 2),
        lambda a, b: np.stack([np.arange(a, b), np.zeros(b - a, np.int64)], axis=1),
    )
    chunked(paths["shuffle"], "<u4", (n,), lambda a, b: (np.arange(a, b) * step + 7) % n)
    files = {}
    for kind in ("document", "sample", "shuffle"):
        arr = np.load(paths[kind], mmap_mode="r", allow_pickle=False)
        entry = file_entry(paths[kind], paths[kind].parent)
        files[kind] = {
            "file": paths[kind].name,
            "dtype": arr.dtype.str,
            "shape": list(arr.shape),
            "bytes": entry["bytes"],
            "sha256": entry["sha256"],
        }
    description = {"key": key, "hash": digest, "counts": {"num_samples": n}, "files": files}
    _index_cache.write_description(paths["description"], description)
    return digest, paths, description


def build(root: Path, samples: int) -> Path:
    """The synthetic blend (see the module docstring); returns the pointer manifest path."""
    per = samples // 2
    prefixes = {"docs": dataset(root, "docs", 1), "code": dataset(root, "code", 2)}
    blend = root / "blends/bench"
    provisional = blend / "versions" / ("0" * 16)
    entries = [dataset_entry(n, p, provisional) for n, p in prefixes.items()]
    caches = [cache_entry(root, e["content_hash"], per) for e in entries]
    version = version_hash(
        {"bench_open": samples, "datasets": [e["content_hash"] for e in entries]}
    )
    vdir = blend / "versions" / version[:16]
    vdir.mkdir(parents=True, exist_ok=True)
    arrays = {"dataset_index": vdir / "train-dataset_index.npy"}
    arrays["dataset_sample_index"] = vdir / "train-dataset_sample_index.npy"
    chunked(arrays["dataset_index"], "<i2", (2 * per,), lambda a, b: np.arange(a, b) % 2)
    chunked(arrays["dataset_sample_index"], "<i8", (2 * per,), lambda a, b: np.arange(a, b) // 2)
    parts = []
    for entry, (digest, paths, description) in zip(entries, caches, strict=True):
        index_files = {
            kind: file_entry(path, vdir, description["files"].get(kind, {}).get("sha256"))
            for kind, path in paths.items()
        }
        parts.append(
            {
                "name": entry["name"],
                "split_range": [0, DOCS],
                "tokens": DOCS * S,
                "num_samples": per,
                "length": per,
                "samples_used": per,
                "epochs": round(per / (DOCS - 1), 6),
                "index": {"cache_hash": digest, "files": index_files},
            }
        )
    manifest = seal(
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
                "weights": {"docs": 0.5, "code": 0.5},
                "temperature": None,
                "normalized": {"docs": 0.5, "code": 0.5},
            },
            "datasets": [{**e, "prefix": e["prefix"]} for e in entries],
            "splits": {
                "train": {
                    "mode": "weighted",
                    "samples_requested": 2 * per,
                    "size": 2 * per,
                    "files": {
                        k: {**file_entry(p, vdir), "path": p.name} for k, p in arrays.items()
                    },
                    "datasets": parts,
                }
            },
        }
    )
    write_json(vdir / "manifest.json", manifest)
    pointer = blend / "manifest.json"
    write_json(pointer, seal(_rebased(manifest, f"versions/{vdir.name}")))
    return pointer


def measure(pointer: Path, verify: str, repeat: int) -> dict[str, Any]:
    open_blend(pointer, verify=verify)  # warm the page cache (and the imports)
    walls, reads = [], []
    for _ in range(repeat):
        before, start = io_counters(), time.perf_counter()
        ds = open_blend(pointer, verify=verify)
        walls.append(time.perf_counter() - start)
        after = io_counters()
        reads.append({k: after[k] - before[k] for k in after})
    return {
        "wall_s": statistics.median(walls),
        "wall_min_s": min(walls),
        "rchar": int(statistics.median(r["rchar"] for r in reads)),
        "read_bytes": int(statistics.median(r["read_bytes"] for r in reads)),
        "samples": len(ds),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="where to build (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the built blend")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-open-"))
    try:
        start = time.perf_counter()
        pointer = build(root, args.samples)
        built = time.perf_counter() - start
        arrays = sum(p.stat().st_size for p in root.rglob("*.npy"))
        fast = measure(pointer, "fast", args.repeat)
        full = measure(pointer, "full", 1)
        ds = open_blend(pointer)
        picks = np.random.default_rng(0).integers(0, len(ds), 512)
        start = time.perf_counter()
        batch = ds.get_batch(picks)
        batch_s = time.perf_counter() - start
        assert batch.shape == (512, S + 1)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    quick = args.samples < 100_000_000
    rows = [["mode", "wall (s)", "rchar (bytes)", "read_bytes", "target"]]
    for mode, res in (("fast", fast), ("full", full)):
        target = f"≤ {TARGET_SECONDS} s, ≤ {TARGET_BYTES // 10**6} MB" if mode == "fast" else ""
        rows.append(
            [mode, f"{res['wall_s']:.4f}", str(res["rchar"]), str(res["read_bytes"]), target]
        )
    print(f"open_blend of {args.samples:,} train samples ({arrays / 1e9:.2f} GB of arrays)")
    print(table(rows))
    print(f"then get_batch of 512 random samples: {batch_s * 1e3:.2f} ms")
    met = fast["wall_s"] <= TARGET_SECONDS and fast["rchar"] <= TARGET_BYTES
    label = f"open_blend {args.samples:,} samples"
    results = {
        "quick": quick,
        "samples": args.samples,
        "array_bytes": arrays,
        "build_s": built,
        "fast": fast,
        "full": full,
        "get_batch_512_ms": batch_s * 1e3,
        "bytes_read_measure": "rchar of /proc/self/io (read() calls, page-cache hits included)",
        "report_rows": [
            {
                "benchmark": label,
                "measure": "verify=fast: wall (warm cache), rchar",
                "ours": f"{fast['wall_s'] * 1e3:.1f} ms, {fast['rchar'] / 1e3:.0f} kB",
                "baseline": f"verify=full: {full['wall_s']:.1f} s, {full['rchar'] / 1e9:.2f} GB",
                "ratio": f"{full['wall_s'] / fast['wall_s']:.0f}×",
                "target": "≤ 0.5 s, ≤ 10 MB",
                "met": None if quick else met,
            }
        ],
    }
    path = write_results("open", results)
    print(f"wrote {path}")
    print(json.dumps({"fast": fast, "full": full}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
