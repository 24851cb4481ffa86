"""Growing Nanoset entries that extend their predecessor: new rows written, old ones referenced.

Under growing semantics a dataset version that only appends shards only appends rows to each
split's three arrays (``tokenmill.indices.growing``). So an entry built with its predecessor's
description at hand writes just the rows after the predecessor's, whose array files it records
as its first parts (*segments*, oldest first): a refresh computes, writes and uploads O(new
documents + new samples) bytes, and readers see the concatenation (``SegmentedArray``).

The rows after any point follow from a small **state** recorded there (the description's
``growth``, docs/formats.md): sample k starts at token k·S of the split's stream, so the rows
after it need only the documents from ``at`` (the one its last row points into) on.

Segments are compacted like a binary counter: the new part absorbs the trailing segments while
the last is at most twice the part's size (absorbing the first segment is a full build). Each
segment is then more than twice the next: O(log dataset) segments, each row rewritten
O(log dataset) times over the growth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.errors import ConfigError
from tokenmill.formats.nanoset_cache import ARRAYS, segment_keys
from tokenmill.indices._nanoset_indices import SPLITS, shuffle_index_dtype
from tokenmill.indices._sample_index import INT32_MAX, count_samples, sample_index_dtype
from tokenmill.indices.growing import (
    GrowingPlan,
    document_splits,
    era_shuffle_range,
    shard_table_hash,
    split_era,
)

__all__ = ["Extension", "end_state", "plan_extension", "rows_after"]

ShardTable = Sequence[tuple[str, int]]
NPY_HEADER = 128  # bytes of a (small) .npy header: a segment's array bytes are its file's less it


def end_state(
    document_index: np.ndarray, sample_index: Any, plan: GrowingPlan, shards: ShardTable
) -> dict[str, Any] | None:
    """The state at the end of a split's arrays (module docstring); None before its first
    emitted sample (such an entry is small: its successor is built whole)."""
    if plan.emitted == 0:
        return None
    p, offset = (int(v) for v in sample_index[plan.emitted])
    return _state(shards, len(document_index), plan, [p, offset], int(document_index[p]))


def _state(
    shards: ShardTable, split_documents: int, plan: GrowingPlan, row: list[int], at: int
) -> dict[str, Any]:
    """The recorded state after ``plan``'s emitted samples (docs/formats.md lists the fields)."""
    return {
        "shards": len(shards),
        "shard_table_sha256": shard_table_hash(shards),
        "documents": sum(n for _, n in shards),
        "split_documents": split_documents,
        "tokens": plan.tokens,
        "emitted": plan.emitted,
        "num_samples": plan.num_samples,
        "row": row,
        "at": at,
    }


def rows_after(
    state: Mapping[str, Any],
    lengths: np.ndarray,
    shards: ShardTable,
    key: Mapping[str, Any],
    masked: np.ndarray | None = None,
) -> tuple[list[np.ndarray], GrowingPlan, dict[str, Any]]:
    """The rows of the three arrays after ``state`` (taken over the first ``state["shards"]``
    shards) for the dataset ``lengths``/``shards``, the split's plan and the new end state;
    ``key``: the entry's cache key; ``masked`` as ``growing.build_growing_indices``."""
    split, seq = key["split"], int(key["sequence_length"])
    extra = 1 if key["add_extra_token"] else 0
    counts = np.array([n for _, n in shards], dtype=np.int64)
    starts = np.cumsum(counts) - counts
    old = int(state["documents"])
    if int(counts[: state["shards"]].sum()) != old:
        raise ConfigError("the dataset's first shards no longer hold the recorded documents")
    at, (p, offset) = int(state["at"]), (int(v) for v in state["row"])
    first = int(np.searchsorted(starts, at, side="right")) - 1  # the shard holding `at`
    local = document_splits(shards[first:], key["split_spec"], key["seed"])
    ids = np.flatnonzero(local == SPLITS.index(split)) + int(starts[first])
    ids = ids[ids >= at]
    if masked is not None and len(masked):
        ids = ids[~np.isin(ids, masked)]
    new = ids[ids >= old]
    sizes = np.asarray(lengths)
    tokens = int(state["tokens"]) + int(np.sum(sizes[new], dtype=np.int64))
    available = count_samples(tokens, seq, extra, True) if tokens > extra else 0
    plan = GrowingPlan(tokens, available, split_era(split, key["era_samples"]), key["num_samples"])
    emitted = int(state["emitted"])
    ks = np.arange(emitted + 1, plan.emitted + 1, dtype=np.int64) * seq
    lens = sizes[ids].astype(np.int64)
    ends = np.cumsum(lens) + (emitted * seq - offset)  # token where each document ends
    c = np.searchsorted(ends, ks + (extra - 1), side="right")  # document of each new row
    documents = int(state["split_documents"]) + len(new)
    rows = np.empty((len(ks), 2), dtype=sample_index_dtype(documents, int(sizes.max())))
    rows[:, 0] = p + c
    rows[:, 1] = ks - (ends[c] - lens[c])
    shuffle = era_shuffle_range(
        key["seed"],
        split,
        plan.era_samples,
        int(state["num_samples"]),
        plan.num_samples,
        shuffle_index_dtype(plan.num_samples, "megatron"),
    )
    doc_rows = new.astype(np.int32 if int(counts.sum()) <= INT32_MAX else np.int64)
    row, at = ([int(v) for v in rows[-1]], int(ids[c[-1]])) if len(ks) else ([p, offset], at)
    return [doc_rows, rows, shuffle], plan, _state(shards, documents, plan, row, at)


@dataclass(frozen=True)
class Extension:
    """What an entry that extends its predecessor writes: its own part's arrays, the plan, the
    state at its end and the segments before it (``files`` records and states, oldest first)."""

    arrays: list[np.ndarray]
    plan: GrowingPlan
    state: dict[str, Any]
    segments: list[dict[str, Any]]

    def records(self) -> dict[str, dict[str, Any]]:
        """The segments' file records, keyed ``<array>.<i>`` as the description keeps them."""
        return {
            f"{name}.{i}": dict(segment["files"][name])
            for i, segment in enumerate(self.segments)
            for name in ARRAYS
        }

    def growth(self) -> dict[str, Any]:
        """The description's ``growth``: this entry's end state and its segments' entries."""
        return {
            "state": self.state,
            "segments": [{"entry": s["entry"], "end": s["end"]} for s in self.segments],
        }


def _chain(previous: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The predecessor's parts as segments: its own segments, then its own files."""
    files, growth = previous["files"], previous["growth"]
    chain = []
    for i, segment in enumerate(growth["segments"]):
        records = {name: files[segment_keys(files, name)[i]] for name in ARRAYS}
        chain.append({"entry": segment["entry"], "files": records, "end": segment["end"]})
    own = {name: files[name] for name in ARRAYS}
    chain.append({"entry": previous["hash"], "files": own, "end": growth["state"]})
    return chain


def _same_settings(previous: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
    """True when two growing keys differ at most in the data (content hash, shard table)."""
    data = ("dataset_content_hash", "shard_table_sha256")
    old = previous.get("key") or {}
    return key.get("semantics") == "growing" and {
        k: v for k, v in old.items() if k not in data
    } == {k: v for k, v in key.items() if k not in data}


def _data_bytes(segment: Mapping[str, Any]) -> int:
    """The array bytes of a segment's files (without their ``.npy`` headers)."""
    return sum(max(0, int(f["bytes"]) - NPY_HEADER) for f in segment["files"].values())


def plan_extension(
    previous: Mapping[str, Any] | None,
    key: Mapping[str, Any],
    lengths: np.ndarray,
    shards: ShardTable,
    masked: np.ndarray | None = None,
) -> Extension | None:
    """The extension of ``previous`` (the predecessor entry's description) to the entry ``key``
    over ``lengths`` and ``shards``; None when it must be built whole (other settings, a changed
    shard table prefix or dtype, or compaction reached the first segment)."""
    if previous is None or not _same_settings(previous, key):
        return None
    growth = previous.get("growth")
    if not isinstance(growth, dict) or not growth.get("state"):
        return None
    state = growth["state"]
    if state["shards"] > len(shards) or state["shard_table_sha256"] != shard_table_hash(
        shards[: state["shards"]]
    ):
        return None
    chain = _chain(previous)
    arrays, plan, after = rows_after(state, lengths, shards, key, masked)
    size = sum(a.nbytes for a in arrays)
    absorbed = False
    while chain and _data_bytes(chain[-1]) <= 2 * size:
        size += _data_bytes(chain.pop())
        absorbed = True
    if not chain:
        return None
    if absorbed:
        arrays, plan, after = rows_after(chain[-1]["end"], lengths, shards, key, masked)
    wanted = [a.dtype.str for a in arrays]  # a segment of another dtype: build whole
    if any([np.dtype(s["files"][n]["dtype"]).str for n in ARRAYS] != wanted for s in chain):
        return None
    return Extension(arrays, plan, after, chain)
