"""Metadata shown on an asset's page: counts, sizes, hashes, paths and a length histogram.

The histogram is a short markdown table with a text bar per power-of-two bucket (empty buckets
included): under 1,000 characters, so the Dagster UI draws it inline on the asset page.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy.typing as npt
from dagster import MetadataValue

from assets.support.resources import display_path
from tokenmill.formats.dataset_manifest import (
    dataset_manifest_path,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDataset
from tokenmill.formats.virtual_merge import is_virtual
from tokenmill.tokenize.stats import histogram_markdown, length_histogram


def histogram_md(lengths: npt.ArrayLike, unit: str = "tokens") -> MetadataValue:
    """The power-of-two histogram of document lengths in ``unit`` as an inline markdown bar
    table."""
    head = f"**document length ({unit})**, buckets [lo, 2·lo)\n\n"
    return MetadataValue.md(
        head + histogram_markdown(length_histogram(lengths), unit=unit, limit=1000 - len(head))
    )


def path_value(path: str | os.PathLike[str]) -> MetadataValue:
    """An artifact path as path metadata: absolute, or its ``s3://`` URI for an S3 root."""
    return MetadataValue.path(display_path(path))


def token_dataset_metadata(
    prefix: Path, *, seconds: float | None = None, tokenizer: str | None = None
) -> dict[str, Any]:
    """Everything the UI shows about one ``.bin``/``.idx`` dataset with a manifest; it reads the
    ``.idx`` and the manifest (sizes as recorded), so a step that staged no ``.bin`` can report."""
    manifest = read_dataset_manifest(prefix)
    if is_virtual(manifest):
        return virtual_dataset_metadata(prefix, manifest)
    with IndexedDataset(prefix, index_only=True) as ds:
        lengths = ds.sequence_lengths.copy()
        meta: dict[str, Any] = {
            "documents": ds.num_documents,
            "sequences": len(ds),
            "tokens": ds.num_tokens,
            "dtype": str(ds.dtype),
        }
    meta["bytes"] = sum(int(info["bytes"]) for info in manifest["files"].values())
    if seconds is not None:
        meta["tokens_per_second"] = round(meta["tokens"] / max(seconds, 1e-9), 1)
    if tokenizer is not None:
        meta["tokenizer_fingerprint"] = tokenizer
    meta["content_hash"] = str(manifest["content_hash"])
    meta["path"] = path_value(prefix)
    meta["length_histogram"] = histogram_md(lengths)
    return meta


def virtual_dataset_metadata(prefix: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """What the UI shows about a virtual merge: counts from its manifest, the bytes of the shard
    pairs it names, the bytes it wrote (its manifest), and the length histogram from the shard
    ``.idx`` files (the index step of the same run reads them too; no ``.bin`` is read)."""
    counts = manifest["counts"]
    shards = manifest["shards"]
    with open_dataset(prefix, index_only=True) as ds:
        histogram = histogram_md(ds.sequence_lengths)
    return {
        "documents": int(counts["documents"]),
        "sequences": int(counts["sequences"]),
        "tokens": int(counts["tokens"]),
        "dtype": str(manifest["dtype"]),
        "bytes": sum(int(f["bytes"]) for s in shards for f in s["files"].values()),
        "bytes_written": dataset_manifest_path(prefix).stat().st_size,
        "merge": "virtual",
        "extends": str(manifest.get("extends")),
        "content_hash": str(manifest["content_hash"]),
        "path": path_value(dataset_manifest_path(prefix)),
        "length_histogram": histogram,
    }
