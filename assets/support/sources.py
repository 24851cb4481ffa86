"""Listing a dataset's source: which shards exist now, and what changed since the last look.

Plain functions, shared by the shard sensors and ``tokenmill materialize``. A shard's
fingerprint is ``<size>:<mtime_ns>`` for a local file and ``<size>:<ETag>`` for an object under
an ``s3://bucket/prefix/`` source (listed through ``tokenmill.storage.s3``; the endpoint is the
``endpoint_url`` given, else ``$AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from assets.support.partitions import check_partition_key, partition_key_for
from tokenmill.atomic import TMP_MARK
from tokenmill.errors import ConfigError, InputError
from tokenmill.recipe import DatasetConfig
from tokenmill.storage.layout import shard_name_problem
from tokenmill.storage.s3 import list_objects, shared_client, split_uri


@dataclass(frozen=True)
class ShardFile:
    """One shard found in a source: a local file (``path``) or an S3 object (``uri``, and
    ``path`` None until a workspace downloads it)."""

    key: str
    path: Path | None
    fingerprint: str
    uri: str = ""

    @property
    def location(self) -> str:
        """Where the shard lives: its ``s3://`` URI or its local path."""
        return self.uri or str(self.path)


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


def _candidates(
    ds: DatasetConfig, endpoint_url: str | None, key: str | None = None
) -> Iterator[ShardFile]:
    """Files directly in the source as ShardFiles keyed by their file names (unchecked): every
    file, or with ``key`` only those that can be that shard's file (``<key><suffix>``), found
    without listing the whole source (a stat per suffix; an S3 listing under the key)."""
    if ds.is_s3:
        bucket, prefix = split_uri(ds.source)
        folder = f"{prefix}/" if prefix else ""
        client = shared_client(endpoint_url)
        for obj in list_objects(client, bucket, folder + (key or ""), recursive=False):
            name = obj.key[len(folder) :]
            yield ShardFile(name, None, f"{obj.size}:{obj.etag}", f"s3://{bucket}/{obj.key}")
        return
    source = Path(ds.source)
    if not source.is_dir():
        raise InputError(f"datasets.{ds.name}.source {source}: no such directory")
    paths = (
        sorted(source / f"{key}{suffix}" for suffix in ds.shard_suffixes)
        if key is not None
        else sorted(source.iterdir())
    )
    for path in paths:
        if path.is_file():
            st = path.stat()
            yield ShardFile(path.name, path, f"{st.st_size}:{st.st_mtime_ns}")


def list_shards(ds: DatasetConfig, endpoint_url: str | None = None) -> Listing:
    """Every shard file directly in ``ds.source`` (a directory or an ``s3://`` prefix) matching
    ``ds.glob`` and a suffix of its format (``.jsonl*``, or ``.parquet``/``.arrow`` for ``hf``)."""
    return _select(ds, _candidates(ds, endpoint_url))


def _select(ds: DatasetConfig, found: Iterable[ShardFile]) -> Listing:
    """The shards among ``found`` (in order; the first file of a shard name wins)."""
    shards: dict[str, ShardFile] = {}
    rejected: list[str] = []
    for candidate in found:
        name = candidate.key
        if TMP_MARK in name or not name.endswith(ds.shard_suffixes):
            continue
        if not fnmatch.fnmatchcase(name, ds.glob):
            continue
        try:
            key = partition_key_for(candidate.path or check_partition_key(name))
        except ConfigError as exc:
            rejected.append(f"{candidate.location}: {exc}")
            continue
        too_long = shard_name_problem(name, key, ds.text_key)
        if too_long:
            rejected.append(f"{candidate.location}: {too_long}")
            continue
        if key in shards:
            taken = shards[key].location.rsplit("/", 1)[-1]
            rejected.append(f"{candidate.location}: shard name {key!r} is taken by {taken}")
            continue
        shards[key] = ShardFile(key, candidate.path, candidate.fingerprint, candidate.uri)
    return Listing(shards, rejected)


def diff_listing(previous: Mapping[str, str], current: Mapping[str, str]) -> ListingDiff:
    """New, changed (different fingerprint) and vanished keys between two listings."""
    return ListingDiff(
        new=sorted(set(current) - set(previous)),
        changed=sorted(k for k in current if k in previous and previous[k] != current[k]),
        vanished=sorted(set(previous) - set(current)),
    )


def find_shard(ds: DatasetConfig, key: str, endpoint_url: str | None = None) -> ShardFile:
    """The shard file behind a partition key, looked up alone (a shard step never lists the
    whole source); ConfigError for an unsafe key, InputError if the source no longer has it."""
    check_partition_key(key)
    shard = _select(ds, _candidates(ds, endpoint_url, key)).shards.get(key)
    if shard is None:
        raise InputError(
            f"dataset {ds.name}: shard {key!r} is not in {ds.source} any more; the shard sensor "
            "removes vanished shards from the partition set"
        )
    return shard
