"""Growing index semantics: indices that only ever extend as shards are appended (pure functions).

A merged dataset is a list of shards in merge (= append) order; a document is named by its shard
key and its ordinal in that shard, and its global sequence id is its position in merge order
(one sequence per document). Three steps, each stable under appending shards (the formulas are
in docs/formats.md, "Growing indices"):

1. **Split by identity.** A document's split is a function of (shard key, ordinal, seed) only: a
   splitmix64 stream per shard compared with the cumulative split fractions. The dataset's size
   never enters, so adding shards never moves a document between splits.
2. **Pack.** A split's documents in merge order are one unshuffled epoch, packed as Megatron's
   sample index over it (drop-last): sample k starts at token k·S of the split's stream, so
   appending documents only adds samples after the old last one.
3. **Era shuffle** (Levanter's ``EraShufflingDataset``), train only: each complete era of
   ``era_samples`` samples is permuted by a function of (seed, split, era) alone. The trailing
   incomplete era is held back, even when no more data will come, so sample i never changes
   once emitted. Valid and test are evaluation sets, read whole or as a stable prefix: they keep
   merge order (an era of 1 sample), so they hold nothing back but the partial last sample.

There are no epochs: ``num_samples`` (``train_samples`` …) is a cap (None: none), the length
``min(num_samples, emitted)``. The arrays have the shapes and dtypes of Megatron's
(document_index int32/int64, sample_index (rows, 2), shuffle_index uint32/int64), so the loader
reads them unchanged.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import json_sha256
from tokenmill.errors import ConfigError
from tokenmill.formats.dataset_manifest import (
    dataset_content_hash,
    dataset_manifest_path,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDataset
from tokenmill.indices._nanoset_indices import SPLITS, check_int, parse_split, shuffle_index_dtype
from tokenmill.indices._sample_index import INT32_MAX, build_sample_index, count_samples

__all__ = [
    "ERA_SAMPLES",
    "GrowingPlan",
    "build_growing_indices",
    "document_splits",
    "era_shuffle_range",
    "lineage_hash",
    "shard_lineage",
    "shard_table",
    "shard_table_hash",
    "split_documents",
    "split_era",
]

# Default era (train): small, so that a small dataset's train split holds a whole era early.
# An era no larger than the global batch changes only the order inside each batch, not which
# samples it holds: for real shuffling set many global batches (e.g. 100 × the global batch).
ERA_SAMPLES = 64


def split_era(split: str, era_samples: int) -> int:
    """The era a split is shuffled in: ``era_samples`` for train, 1 (merge order) otherwise."""
    return check_int("era_samples", era_samples, minimum=1) if split == "train" else 1


_PHI = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_UNIT_BITS = 53


# -- the shard table -----------------------------------------------------------------------------
def shard_table(
    manifest_or_prefix: Mapping[str, Any] | str | os.PathLike[str],
) -> list[tuple[str, int]]:
    """``[(shard key, documents), ...]`` of a dataset in merge order, from its manifest's
    ``shards`` (a pair without them is one shard keyed by its prefix name); ConfigError when a
    shard holds more sequences than documents (growing semantics needs one each)."""
    return [(key, docs) for key, docs, _ in shard_lineage(manifest_or_prefix)]


def shard_lineage(
    manifest_or_prefix: Mapping[str, Any] | str | os.PathLike[str],
) -> list[tuple[str, int, str]]:
    """:func:`shard_table`'s rows with each shard's content hash, ``(key, documents, hash)``: a
    version extends another whose lineage is a prefix of its own."""
    if isinstance(manifest_or_prefix, Mapping):
        manifest: Mapping[str, Any] = manifest_or_prefix
        where = str(manifest.get("prefix", "manifest"))
    else:
        prefix = Path(manifest_or_prefix)
        where = str(prefix)
        has_manifest = dataset_manifest_path(prefix).is_file()
        manifest = read_dataset_manifest(prefix) if has_manifest else {}
        if "documents" not in manifest.get("counts", {}) and not manifest.get("shards"):
            data = IndexedDataset(prefix, index_only=True)  # counts from the .idx
            counts = {"documents": data.num_documents, "sequences": len(data)}
            content = dataset_content_hash(prefix, index_only=has_manifest)
            manifest = {"prefix": prefix.name, "counts": counts, "content_hash": content}
    rows = manifest.get("shards") or [
        {
            "key": str(manifest["prefix"]),
            "documents": manifest["counts"]["documents"],
            "sequences": manifest["counts"].get("sequences", manifest["counts"]["documents"]),
            "content_hash": str(manifest["content_hash"]),
        }
    ]
    table = []
    for i, row in enumerate(rows):
        key = str(row["key"])
        docs = check_int(f"shards[{i}].documents", row["documents"], minimum=0)
        if row.get("sequences", docs) != docs:
            raise ConfigError(
                f"{where}: shard {key!r} has {row['sequences']} sequences for {docs} documents; "
                "growing semantics needs one sequence per document (use megatron or nanotron)"
            )
        table.append((key, docs, _identity(row)))
    if len({row[0] for row in table}) != len(table):
        raise ConfigError(f"{where}: shard keys repeat; each shard needs its own key")
    return table


def _identity(row: Mapping[str, Any]) -> str:
    """A shard's content hash in a lineage; a masked shard (takedown) adds its mask, so a
    version that masks more of an old shard never extends the one before."""
    content = str(row.get("content_hash", ""))
    masked = row.get("masked")
    if not masked:
        return content
    text = ",".join(str(int(o)) for o in masked)
    return f"{content}+masked:{hashlib.sha256(text.encode()).hexdigest()}"


def lineage_hash(rows: Sequence[tuple[str, int, str]]) -> str:
    """sha256 of :func:`shard_lineage` rows (canonical JSON); compare it over a prefix."""
    return json_sha256([[str(k), int(n), str(h)] for k, n, h in rows])


def shard_table_hash(shards: Sequence[tuple[str, int]]) -> str:
    """sha256 of the table's canonical JSON: the identity the growing cache key records."""
    return json_sha256([[str(k), int(n)] for k, n in shards])


# -- stable splits -------------------------------------------------------------------------------
def _base(*parts: object) -> np.uint64:
    """A 64-bit stream base from sha256 over the parts (NUL-separated)."""
    text = "\0".join(str(p) for p in ("tokenmill-growing", *parts))
    return np.uint64(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little"))


def _splitmix64(state: np.ndarray) -> np.ndarray:
    """splitmix64's output function over uint64 states, in place (wrapping arithmetic)."""
    state ^= state >> np.uint64(30)
    state *= _MIX1
    state ^= state >> np.uint64(27)
    state *= _MIX2
    state ^= state >> np.uint64(31)
    return state


def _stream(base: np.ndarray | np.uint64, ordinals: np.ndarray) -> np.ndarray:
    """``splitmix64(base + (ordinal + 1)·φ)`` for each ordinal (uint64)."""
    state = ordinals.astype(np.uint64)
    state += np.uint64(1)
    state *= _PHI
    state += base
    return _splitmix64(state)


def document_splits(shards: Sequence[tuple[str, int]], split_spec: str, seed: int) -> np.ndarray:
    """The split (0 train, 1 valid, 2 test) of every document, in merge order (uint8)."""
    seed = check_int("seed", seed, minimum=0, maximum=2**32 - 1)
    counts = np.array([n for _, n in shards], dtype=np.int64)
    total = int(counts.sum())
    bases = np.array([_base("split", seed, key) for key, _ in shards], dtype=np.uint64)
    # base + (ordinal + 1)·φ = global·φ + (base − start·φ): one per-shard term, one arange
    starts = (np.cumsum(counts) - counts).astype(np.uint64)
    unit = _stream(np.repeat(bases - starts * _PHI, counts), np.arange(total, dtype=np.int64))
    unit >>= np.uint64(64 - _UNIT_BITS)
    weights = parse_split(split_spec)
    scale = 1 << _UNIT_BITS
    first = round(weights[0] * scale)
    second = scale if weights[2] == 0 else round((weights[0] + weights[1]) * scale)
    out = (unit >= np.uint64(first)).astype(np.uint8)
    out += unit >= np.uint64(second)
    return out


def split_documents(
    shards: Sequence[tuple[str, int]], split_spec: str, seed: int, split: str
) -> np.ndarray:
    """Global ids (merge order) of ``split``'s documents, ascending (int64)."""
    return np.flatnonzero(document_splits(shards, split_spec, seed) == SPLITS.index(split))


# -- indices -------------------------------------------------------------------------------------
class GrowingPlan:
    """Sizes of one split's growing index: samples packed, emitted (whole eras), returned."""

    def __init__(self, tokens: int, available: int, era_samples: int, cap: int | None) -> None:
        self.tokens = tokens
        self.available = available  # complete samples in the split's stream
        self.emitted = available // era_samples * era_samples  # held back: the partial era
        self.num_samples = self.emitted if cap is None else min(cap, self.emitted)
        self.era_samples = era_samples

    def counts(self) -> dict[str, int]:
        """The description's ``counts`` of an index entry."""
        return {
            "num_samples": self.num_samples,
            "sample_index_rows": self.emitted + 1,
            "tokens": self.tokens,
            "available_samples": self.available,
            "held_back_samples": self.available - self.emitted,
            "era_samples": self.era_samples,
        }


def build_growing_indices(
    sequence_lengths: np.ndarray | Sequence[int],
    shards: Sequence[tuple[str, int]],
    split: str,
    *,
    split_spec: str,
    sequence_length: int,
    seed: int,
    num_samples: int | None,
    era_samples: int = ERA_SAMPLES,
    add_extra_token: bool = True,
    masked: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, GrowingPlan]:
    """(document_index, sample_index, shuffle_index, plan) of ``split`` (module docstring) over
    all the dataset's ``sequence_lengths`` (one per document) and its :func:`shard_table`. A split
    without one complete era has 0 samples (a one-row sample index, none without documents);
    ``masked`` documents (global ids) leave their split: samples packed before the first stay."""
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {list(SPLITS)}, got {split!r}")
    seq = check_int("sequence_length", sequence_length, minimum=2)
    era = split_era(split, era_samples)
    cap = None if num_samples is None else check_int("num_samples", num_samples, minimum=0)
    sizes = np.asarray(sequence_lengths)
    total = sum(n for _, n in shards)
    if sizes.ndim != 1 or len(sizes) != total:
        raise ConfigError(
            f"the shard table counts {total} documents but the dataset has {len(sizes)} "
            "sequences: growing semantics needs one sequence per document"
        )
    extra = 1 if add_extra_token else 0
    ids = split_documents(shards, split_spec, seed, split)
    if masked is not None and len(masked):
        ids = ids[~np.isin(ids, masked)]
    document_index = ids.astype(np.int32 if total <= INT32_MAX else np.int64)
    tokens = int(np.sum(sizes[ids], dtype=np.int64))
    available = count_samples(tokens, seq, extra, True) if tokens > extra else 0
    plan = GrowingPlan(tokens, available, era, cap)
    if plan.emitted:  # rows of the emitted samples only: they depend on the stream's prefix
        sample_index = build_sample_index(
            sizes,
            document_index,
            sequence_length=seq,
            total_tokens=plan.emitted * seq + extra,
            drop_last=True,
            extra=extra,
        )
    else:  # row 0 points at the first document; with no document there is no row at all
        sample_index = np.zeros((1 if len(document_index) else 0, 2), dtype=np.int32)
    dtype = shuffle_index_dtype(plan.num_samples, "megatron")
    shuffle_index = era_shuffle_range(seed, split, era, 0, plan.num_samples, dtype)
    return document_index, sample_index, shuffle_index, plan


def era_shuffle_range(
    seed: int, split: str, era: int, start: int, stop: int, dtype: np.dtype
) -> np.ndarray:
    """Entries ``[start, stop)`` of the era-shuffled order (only the eras they fall in are
    computed: an entry that extends its predecessor computes its new eras alone)."""
    first, last = start // era, -(-stop // era)
    positions = np.arange(first * era, last * era, dtype=np.int64)
    keys = _stream(_base("era", seed, split), positions)
    order = np.argsort(keys.reshape(last - first, era), axis=1, kind="stable")
    order += positions[::era][:, None]
    return order.reshape(-1)[start - first * era : stop - first * era].astype(dtype)
