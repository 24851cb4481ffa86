"""Metadata shown on an asset's page: counts, sizes, hashes, paths and a length histogram.

The histogram is a markdown cell holding an inline PNG (``assets.png``) and a table, which
the Dagster UI renders without any plugin.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy.typing as npt
from dagster import MetadataValue

from assets.png import bar_chart_png, markdown_image, short_number
from assets.support.resources import display_path
from tokenmill.formats.dataset_manifest import read_dataset_manifest
from tokenmill.formats.indexed import IndexedDataset
from tokenmill.tokenize.stats import histogram_markdown, length_histogram


def histogram_md(lengths: npt.ArrayLike, what: str = "document length (tokens)") -> MetadataValue:
    """Markdown with a bar chart PNG and the table of a power-of-two length histogram."""
    buckets = length_histogram(lengths)
    png = bar_chart_png([b.count for b in buckets], [short_number(b.lo) for b in buckets])
    return MetadataValue.md(
        f"**{what}**, buckets [lo, 2·lo)\n\n{markdown_image(png, 'length histogram')}\n\n"
        + histogram_markdown(buckets)
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
