"""Owns the Nanoset cache key: the ordered description of everything that changes a split's
arrays (its md5 names the entry's files), a split's key from a dataset's counts alone, and the
index version an orchestrator records before the dataset is read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tokenmill.errors import ConfigError
from tokenmill.formats import nanoset_cache as cache
from tokenmill.indices import growing
from tokenmill.indices._nanoset_indices import SPLITS, check_int, parse_split, split_ranges
from tokenmill.indices.settings import NanosetSettings
from tokenmill.storage.versions import version_hash

FORMAT_VERSION = 1
SEMANTICS = ("megatron", "nanotron", "growing")  # growing: tokenmill.indices.growing
ShardTable = Sequence[tuple[str, int]]


def check_choices(split: str, semantics: str) -> None:
    """ConfigError unless ``split`` and ``semantics`` are known names."""
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if semantics not in SEMANTICS:
        raise ConfigError(f"semantics must be one of {list(SEMANTICS)}, got {semantics!r}")


def cache_key(
    content_hash: str,
    split: str,
    settings: NanosetSettings,
    split_range: tuple[int, int] | None,
    num_samples: int | None,
    shard_table_sha256: str | None = None,
) -> dict[str, Any]:
    """The ordered description of everything that changes ``split``'s arrays under ``settings``
    (hashed for names); growing semantics has no split range and adds its split's era size and
    ``shard_table_sha256``."""
    key = {
        "class": "Nanoset",
        "format_version": FORMAT_VERSION,
        "dataset_content_hash": content_hash,
        "semantics": settings.semantics,
        "split": split,
        "split_spec": settings.split_spec,
        "split_range": None if split_range is None else list(split_range),
        "sequence_length": check_int("sequence_length", settings.sequence_length, minimum=2),
        "seed": check_int("seed", settings.seed, minimum=0, maximum=2**32 - 1),
        "num_samples": None
        if num_samples is None
        else check_int("num_samples", num_samples, minimum=0),
        "add_extra_token": bool(settings.add_extra_token),
        "drop_last_partial": bool(settings.drop_last(split)),
    }
    if settings.semantics == "growing":
        key["era_samples"] = growing.split_era(split, settings.era_samples)
        key["shard_table_sha256"] = shard_table_sha256
    return key


def entry_key(
    num_sequences: int,
    content_hash: str,
    split: str,
    settings: NanosetSettings,
    num_samples: int | None = None,
    *,
    shards: ShardTable | None = None,
    masked: np.ndarray | None = None,
) -> tuple[dict[str, Any], str] | None:
    """``(key, hash)`` of a split's cache entry (:func:`cache_key`, its file names' ``<hash>``)
    for a dataset of ``num_sequences`` sequences, ``masked`` of them masked; None if the split
    is empty (growing: of weight 0; an entry may hold 0 samples until one era is there)."""
    check_choices(split, settings.semantics)
    position, table_hash = SPLITS.index(split), None
    if settings.semantics == "growing":
        if shards is None:
            raise ConfigError("growing semantics needs the dataset's shard table (shards=...)")
        if sum(n for _, n in shards) != num_sequences:
            raise ConfigError(
                f"the shard table counts {sum(n for _, n in shards)} documents, the dataset has "
                f"{num_sequences} sequences: growing semantics needs one sequence per document"
            )
        if not settings.drop_last(split):
            raise ConfigError(
                "growing semantics always drops the last partial sample (it would change when "
                "data is added): drop_last_partial_validation must be true"
            )
        if parse_split(settings.split_spec)[position] == 0:
            return None
        split_range, table_hash = None, growing.shard_table_hash(shards)
    else:
        indexed = num_sequences - (0 if masked is None else len(masked))
        split_range = split_ranges(settings.split_spec, indexed, settings.semantics)[position]
        if split_range is None or split_range[0] >= split_range[1]:
            return None
    key = cache_key(content_hash, split, settings, split_range, num_samples, table_hash)
    return key, cache.key_hash(key)


def index_version(
    dataset_version: str | None,
    settings: NanosetSettings,
    num_samples: Mapping[str, int | None],
) -> str:
    """The version of a dataset's indices known before it is read: the hash of each split's
    :func:`cache_key` with ``dataset_version`` (which fixes the content, hence the split range
    and shard table) in place of the content hash. An orchestrator records it (e.g. as a Dagster
    data version) to tell stale indices from their upstream versions alone."""
    check_choices(SPLITS[0], settings.semantics)
    keys = [
        cache_key("", split, settings, None, num_samples[split])
        | {"dataset_content_hash": dataset_version}
        for split in SPLITS
    ]
    return version_hash({"kind": "nanoset", "keys": keys})
