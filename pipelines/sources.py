"""Listing a dataset's source: which shards exist now, and what changed since the last look.

Plain functions, shared by the shard sensors and ``tokenmill materialize``. A shard's
fingerprint is ``<size>:<mtime_ns>`` for a local file (an S3 listing would use the ETag).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.partitions import partition_key_for
from tokenmill._atomic import TMP_MARK
from tokenmill.errors import ConfigError, InputError
from tokenmill.recipe import SHARD_SUFFIXES, DatasetConfig


@dataclass(frozen=True)
class ShardFile:
    """One shard found in a source."""

    key: str
    path: Path
    fingerprint: str


@dataclass(frozen=True)
class Listing:
    """The shards of a source by partition key, and the files that could not be shards."""

    shards: dict[str, ShardFile]
    rejected: list[str] = field(default_factory=list)

    def fingerprints(self) -> dict[str, str]:
        """``{key: fingerprint}``: the form kept in a sensor cursor."""
        return {k: s.fingerprint for k, s in sorted(self.shards.items())}


@dataclass(frozen=True)
class ListingDiff:
    """What changed between two ``{key: fingerprint}`` listings (keys sorted)."""

    new: list[str]
    changed: list[str]
    vanished: list[str]

    def __bool__(self) -> bool:
        return bool(self.new or self.changed or self.vanished)


def list_shards(ds: DatasetConfig) -> Listing:
    """Every shard file directly in ``ds.source`` matching ``ds.glob`` and a JSONL suffix."""
    if ds.is_s3:
        raise ConfigError(
            f"datasets.{ds.name}.source {ds.source}: S3 sources are not supported by this build "
            "yet; sync the prefix to a local directory and point the source there"
        )
    source = Path(ds.source)
    if not source.is_dir():
        raise InputError(f"datasets.{ds.name}.source {source}: no such directory")
    shards: dict[str, ShardFile] = {}
    rejected: list[str] = []
    for path in sorted(source.iterdir()):
        name = path.name
        if TMP_MARK in name or not path.is_file() or not name.endswith(SHARD_SUFFIXES):
            continue
        if not fnmatch.fnmatchcase(name, ds.glob):
            continue
        try:
            key = partition_key_for(path)
        except ConfigError as exc:
            rejected.append(f"{path}: {exc}")
            continue
        if key in shards:
            rejected.append(f"{path}: shard name {key!r} is taken by {shards[key].path.name}")
            continue
        st = path.stat()
        shards[key] = ShardFile(key, path, f"{st.st_size}:{st.st_mtime_ns}")
    return Listing(shards, rejected)


def diff_listing(previous: Mapping[str, str], current: Mapping[str, str]) -> ListingDiff:
    """New, changed (different fingerprint) and vanished keys between two listings."""
    return ListingDiff(
        new=sorted(set(current) - set(previous)),
        changed=sorted(k for k in current if k in previous and previous[k] != current[k]),
        vanished=sorted(set(previous) - set(current)),
    )


def find_shard(ds: DatasetConfig, key: str) -> ShardFile:
    """The shard file behind a partition key; InputError if the source no longer has it."""
    shard = list_shards(ds).shards.get(key)
    if shard is None:
        raise InputError(
            f"dataset {ds.name}: shard {key!r} is not in {ds.source} any more; the shard sensor "
            "removes vanished shards from the partition set"
        )
    return shard
