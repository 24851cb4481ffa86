"""Owns what a Nanoset index reads of a dataset: its sequence lengths (the ``.idx``), content
hash, shard table and masked (taken-down) sequence ids, never its ``.bin``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.formats.dataset_manifest import (
    dataset_content_hash,
    dataset_manifest_path,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.formats.virtual_merge import masked_sequences
from tokenmill.indices import growing
from tokenmill.indices.nanoset_keys import ShardTable


def masked_of(dataset_prefix: str | Path) -> np.ndarray:
    """The sequence ids a dataset masks (taken down; ascending int64, empty when none): the
    ``masked`` shard records of a virtual merge's manifest."""
    if not dataset_manifest_path(dataset_prefix).is_file():
        return np.zeros(0, dtype=np.int64)
    return masked_sequences(read_dataset_manifest(dataset_prefix))


def unmasked(num_sequences: int, masked: np.ndarray | None) -> np.ndarray | None:
    """The sequence ids an index of a masked dataset draws from (ascending), None without a
    mask."""
    if masked is None or not len(masked):
        return None
    keep = np.ones(num_sequences, dtype=bool)
    keep[np.asarray(masked, dtype=np.int64)] = False
    return np.flatnonzero(keep)


def index_lengths(dataset_prefix: str | Path, semantics: str) -> np.ndarray:
    """The sequence lengths (of the ``.idx``) a split's range and tokens count over: megatron and
    nanotron skip masked sequences (a masked merge indexes as the physical merge of its unmasked
    documents); growing keeps them (they leave their split by identity)."""
    index_only = dataset_manifest_path(dataset_prefix).is_file()
    lengths = np.asarray(open_dataset(dataset_prefix, index_only=index_only).sequence_lengths)
    kept = None if semantics == "growing" else unmasked(len(lengths), masked_of(dataset_prefix))
    return lengths if kept is None else lengths[kept]


@dataclass(frozen=True)
class IndexInputs:
    """What a dataset's Nanoset entries are computed from, no ``.bin`` needed: every sequence's
    length, the content hash, the shard table (growing only) and the masked sequence ids."""

    lengths: np.ndarray
    content_hash: str
    shards: ShardTable | None = None
    masked: np.ndarray | None = None

    @classmethod
    def of(cls, dataset_prefix: str | Path, semantics: str) -> IndexInputs:
        """The inputs of a dataset on disk, through its ``.idx`` and manifest alone (an S3 step
        need not stage the ``.bin``); a hand-made pair without a manifest is hashed whole."""
        index_only = dataset_manifest_path(dataset_prefix).is_file()
        return cls(
            np.asarray(open_dataset(dataset_prefix, index_only=index_only).sequence_lengths),
            dataset_content_hash(dataset_prefix, index_only=index_only),
            growing.shard_table(dataset_prefix) if semantics == "growing" else None,
            masked_of(dataset_prefix),
        )
