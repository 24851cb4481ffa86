"""Summaries of a ``.bin``/``.idx`` dataset: counts and a document-length histogram."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tokenmill.formats.indexed import IndexedDataset
from tokenmill.formats.virtual_merge import VirtualDataset

MARKDOWN_INLINE_LIMIT = 1000  # Dagster UI: shorter markdown metadata renders inline
BAR = "█"  # full block


@dataclass(frozen=True)
class Bucket:
    """Sequences with ``lo <= length < hi`` tokens."""

    lo: int
    hi: int
    count: int


def length_histogram(lengths: npt.ArrayLike) -> list[Bucket]:
    """Power-of-two buckets ``[0,1) [1,2) [2,4) ...`` from the first non-empty one up to the
    longest length; empty buckets in between stay (a gap in lengths is information)."""
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return []
    top = int(arr.max())
    edges = [0, 1]
    while edges[-1] <= top:
        edges.append(edges[-1] * 2)
    counts, _ = np.histogram(arr, bins=np.array(edges))
    first = int(np.flatnonzero(counts)[0])
    return [Bucket(edges[i], edges[i + 1], int(counts[i])) for i in range(first, len(counts))]


def short_number(value: int) -> str:
    """``1536`` -> ``1.5k``, ``2000000`` -> ``2M``: compact bucket labels."""
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if value >= size:
            text = f"{value / size:.1f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return str(value)


def histogram_markdown(
    buckets: list[Bucket], *, unit: str = "tokens", limit: int = MARKDOWN_INLINE_LIMIT
) -> str:
    """A markdown table of a histogram with a text bar per bucket, narrowed to stay under ``limit``
    characters when 1-block bars fit: the Dagster UI draws shorter markdown inline on the page."""
    rows = [f"| {unit} from | count | |", "|---:|---:|:---|"]
    peak = max((b.count for b in buckets), default=0)
    # a lower edge exact below 100,000 (powers of two read best whole), else short
    labels = [str(b.lo) if b.lo < 100_000 else short_number(b.lo) for b in buckets]
    for width in (24, 16, 12, 8, 4, 1):
        body = [
            f"| {label} | {b.count} | {BAR * _bar(b.count, peak, width)} |"
            for label, b in zip(labels, buckets, strict=True)
        ]
        text = "\n".join(rows + body)
        if len(text) < limit:
            return text
    return text


def _bar(count: int, peak: int, width: int) -> int:
    """Bar length: proportional to the peak, at least 1 for a non-empty bucket, 0 for empty."""
    return max(1, round(width * count / peak)) if count else 0


def histogram_text(buckets: list[Bucket], width: int = 40) -> str:
    """A terminal bar chart of a histogram (an empty bucket has no bar)."""
    if not buckets:
        return "(no sequences)"
    peak = max(b.count for b in buckets)
    lines = []
    for b in buckets:
        bar = "#" * _bar(b.count, peak, width)
        lines.append(f"{b.lo:>9}–{b.hi - 1:<9} {b.count:>10}  {bar}".rstrip())
    return "\n".join(lines)


def summarize(ds: IndexedDataset | VirtualDataset) -> dict[str, object]:
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
        "bin_bytes": ds.num_tokens * ds.dtype.itemsize,  # checked against the files on open
    }
