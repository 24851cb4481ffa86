"""The commit order of a storage tree: data first, commit markers after, pointers last.

A marker's presence says "the files I name are complete" (a dataset's manifest, a shard's
``.stats.json``, a Nanoset entry's ``-description.json``, ``dataset_info.json``, a blend
version's ``manifest.json``); a pointer names the current version (``current.json``, a blend's
``blends/<name>/manifest.json``). Whoever copies a tree (a step's S3 upload, ``tokenmill pull``)
goes through :func:`publish`, rank by rank (:func:`commit_rank`), so a copy cut short never
leaves a marker without its files nor a pointer without its version. A pointer is replaced by
one atomic write (an S3 PUT, a local rename). Library code: no Dagster, no boto3.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tokenmill.storage.layout import BLEND_MANIFEST, POINTER_NAME

__all__ = ["commit_rank", "delete_first", "is_pointer", "publish", "publish_batches"]

T = TypeVar("T")

DATA, MARKER, MARKER_OF_MARKERS, DATASET_POINTER, BLEND_POINTER = range(5)
INDEX_DESCRIPTION = "-description.json"  # a Nanoset cache entry's commit marker
MARKER_SUFFIXES = (".manifest.json", INDEX_DESCRIPTION, ".stats.json")
MARKERS_OF_MARKERS = ("dataset_info.json",)


def commit_rank(rel: str) -> int:
    """The rank of a posix path (files of a lower rank go first): data, markers, markers over
    markers (``dataset_info.json``, a blend version's manifest), dataset, then blend pointers."""
    parts = rel.split("/")
    name = parts[-1]
    if name == POINTER_NAME:
        return DATASET_POINTER
    if name == BLEND_MANIFEST:
        return MARKER_OF_MARKERS if "versions" in parts[:-1] else BLEND_POINTER
    if name in MARKERS_OF_MARKERS:
        return MARKER_OF_MARKERS
    if name.endswith(MARKER_SUFFIXES):
        return MARKER
    return DATA


def is_pointer(rel: str) -> bool:
    """True for a pointer: ``current.json``, a blend's ``manifest.json`` outside ``versions/``."""
    return commit_rank(rel) >= DATASET_POINTER


def delete_first(rel: str) -> bool:
    """True when an existing copy of ``rel`` must be removed before this publication writes
    anything: a marker, so that no marker vouches for half-rewritten data. Never a pointer (one
    atomic write), nor an index description (its key hashes everything its arrays depend on:
    the same key always describes the same bytes)."""
    if rel.endswith(INDEX_DESCRIPTION):
        return False
    return MARKER <= commit_rank(rel) < DATASET_POINTER


def publish_batches(rels: Iterable[str]) -> list[list[str]]:
    """``rels`` grouped by rank, lowest first, each group sorted (the order of :func:`publish`)."""
    ordered = sorted(rels, key=lambda rel: (commit_rank(rel), rel))
    return [list(batch) for _, batch in itertools.groupby(ordered, key=commit_rank)]


def publish(rels: Iterable[str], transfer: Callable[[str], T], *, jobs: int = 1) -> list[T]:
    """Call ``transfer(rel)`` for every path, rank by rank (up to ``jobs`` at once within a rank);
    the first error stops everything, so no later rank starts. The results, in the order of
    :func:`publish_batches` flattened."""
    batches = publish_batches(rels)
    if jobs <= 1:
        return [transfer(rel) for batch in batches for rel in batch]
    results: list[T] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for batch in batches:
            results.extend(pool.map(transfer, batch))
    return results
