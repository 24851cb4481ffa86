"""Summaries of a ``.bin``/``.idx`` dataset: counts and a document-length histogram."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tokenmill.formats.indexed import IndexedDataset


@dataclass(frozen=True)
class Bucket:
    """Sequences with ``lo <= length < hi`` tokens."""

    lo: int
    hi: int
    count: int


def length_histogram(lengths: npt.ArrayLike) -> list[Bucket]:
    """Power-of-two buckets ``[0,1) [1,2) [2,4) ...`` up to the longest length (empty dropped)."""
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return []
    top = int(arr.max())
    edges = [0, 1]
    while edges[-1] <= top:
        edges.append(edges[-1] * 2)
    counts, _ = np.histogram(arr, bins=np.array(edges))
    return [Bucket(edges[i], edges[i + 1], int(c)) for i, c in enumerate(counts.tolist()) if c]


def histogram_markdown(buckets: list[Bucket]) -> str:
    """A markdown table of a histogram (renders in the Dagster UI and in docs)."""
    rows = ["| tokens | sequences |", "|---:|---:|"]
    rows += [f"| {b.lo}–{b.hi - 1} | {b.count} |" for b in buckets]
    return "\n".join(rows)


def histogram_text(buckets: list[Bucket], width: int = 40) -> str:
    """A terminal bar chart of a histogram."""
    if not buckets:
        return "(no sequences)"
    peak = max(b.count for b in buckets)
    lines = []
    for b in buckets:
        bar = "#" * max(1, round(width * b.count / peak))
        lines.append(f"{b.lo:>9}–{b.hi - 1:<9} {b.count:>10}  {bar}")
    return "\n".join(lines)


def summarize(ds: IndexedDataset) -> dict[str, object]:
    """Counts and length statistics of a dataset."""
    lengths = ds.sequence_lengths
    return {
        "documents": ds.num_documents,
        "sequences": len(ds),
        "tokens": ds.num_tokens,
        "dtype": str(ds.dtype),
        "empty_documents": int(np.count_nonzero(np.diff(ds.document_indices) == 0)),
        "min_length": int(lengths.min()) if len(lengths) else 0,
        "max_length": int(lengths.max()) if len(lengths) else 0,
        "mean_length": float(lengths.mean()) if len(lengths) else 0.0,
        "bin_bytes": ds.bin_path.stat().st_size,
    }
