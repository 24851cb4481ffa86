"""Owns the consistency checks: a ``.bin``/``.idx`` dataset against its manifest, an HF export's
``dataset_info.json`` against its Parquet shards, a blend against its files and indices, and a
blend's realized shares against its weights."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import file_sha256
from tokenmill.errors import CacheError, FormatError
from tokenmill.formats.blend_manifest import (
    SPLITS,
    load_blend_arrays,
    manifest_path,
    read_blend_manifest,
    schema_errors,
    verify_manifest,
)
from tokenmill.formats.dataset_manifest import (
    dataset_manifest_path,
    file_problems,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.loader import open_blend_split


def verify_dataset(prefix: str | os.PathLike[str], *, full: bool = True) -> list[str]:
    """Every problem found (empty = consistent): header, counts, sizes and pointers, and a
    manifest's recorded counts, sizes and (``full``) sha256 of both files."""
    prefix = Path(prefix)
    try:
        with open_dataset(prefix) as ds:
            ds.check_pointers()
            counts = {"documents": ds.num_documents, "sequences": len(ds), "tokens": ds.num_tokens}
        if not dataset_manifest_path(prefix).is_file():
            return []
        manifest = read_dataset_manifest(prefix)
    except FormatError as exc:
        return [str(exc)]
    problems = file_problems(prefix, manifest, full=full)
    for key, value in counts.items():
        recorded = manifest["counts"].get(key)
        if recorded is not None and recorded != value:
            problems.append(
                f"{dataset_manifest_path(prefix)}: counts.{key} is {recorded}, files have {value}"
            )
    return problems


def verify_dataset_info(path: str | os.PathLike[str], *, full: bool = True) -> list[str]:
    """Problems between an HF export's ``dataset_info.json`` and the Parquet shards it lists
    (empty list = consistent): each file present with its recorded size, the split's example
    count the sum of the shards' rows, and with ``full`` each file's sha256 and row count."""
    path = Path(path)
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        shards = info["shards"]
        examples = int(info["splits"]["train"]["num_examples"])
        records = [
            (str(s["file"]), int(s["size"]), str(s["sha256"]), int(s["num_rows"])) for s in shards
        ]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
        return [f"{path}: not a tokenmill dataset_info.json ({exc!r})"]
    problems = []
    if sum(rows for *_, rows in records) != examples:
        problems.append(
            f"{path}: splits.train.num_examples is {examples}, the shards list "
            f"{sum(rows for *_, rows in records)} rows"
        )
    for name, size, sha256, rows in records:
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts:
            problems.append(f"{path}: shards: {name!r} is not a path inside {path.parent}")
            continue
        shard = path.parent / rel
        if not shard.is_file():
            problems.append(f"{shard}: missing")
        elif shard.stat().st_size != size:
            problems.append(f"{shard}: {shard.stat().st_size} bytes, dataset_info says {size}")
        elif full and file_sha256(shard) != sha256:
            problems.append(f"{shard}: sha256 differs from dataset_info.json")
        elif full and (found := _parquet_rows(shard)) != rows:
            problems.append(f"{shard}: {found} rows, dataset_info says {rows}")
    return problems


def _parquet_rows(path: Path) -> int:
    """The row count in a Parquet file's footer (pyarrow imported only here)."""
    import pyarrow.parquet as pq

    return int(pq.read_metadata(path).num_rows)


def verify_blend(path: str | os.PathLike[str], *, full: bool = False) -> list[str]:
    """Problems between a blend manifest and its files (empty = consistent): its schema and own
    hash, every file's size, the index records (O(1) in the index sizes); ``full``: also every
    file's sha256 and every index value in bounds (as ``open_blend(verify="full")``)."""
    problems = verify_manifest(path, full=full)
    if full and not problems:  # the files hash right: now every index value and pointer
        mpath = manifest_path(path)
        manifest = read_blend_manifest(mpath)
        for split in manifest["splits"]:
            try:
                with schema_errors(mpath):
                    open_blend_split(manifest, mpath, split, full=True)
            except (FormatError, CacheError) as exc:
                problems.append(f"split {split!r}: {exc}")
    return problems


@dataclass(frozen=True)
class Share:
    """One dataset's part of one split of a blend: requested (normalized weight) vs realized."""

    split: str
    dataset: str
    requested: float
    realized: float
    samples: int
    size: int
    weighted: bool


def realized_shares(manifest: dict[str, Any], mpath: Path) -> list[Share]:
    """Requested against realized share per split and dataset (exhaustive splits follow the
    dataset sizes by design, so only weighted ones are expected to match the weights)."""
    normalized = manifest["weighting"]["normalized"]
    shares = []
    for split in (s for s in SPLITS if s in manifest["splits"]):
        info = manifest["splits"][split]
        # a dataset left out of the split: the others' weights are renormalized
        total = sum(float(normalized[ds["name"]]) for ds in info["datasets"]) or 1.0
        dataset_index = load_blend_arrays(info, mpath)[0]
        counts = np.bincount(dataset_index.astype(np.int64), minlength=len(info["datasets"]))
        for ds, count in zip(info["datasets"], counts.tolist(), strict=True):
            shares.append(
                Share(
                    split=split,
                    dataset=ds["name"],
                    requested=float(normalized[ds["name"]]) / total,
                    realized=count / max(1, len(dataset_index)),
                    samples=count,
                    size=len(dataset_index),
                    weighted=info["mode"] in ("weighted", "growing"),
                )
            )
    return shares
