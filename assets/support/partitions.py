"""Shard partitions: one ``DynamicPartitionsDefinition`` per dataset, keyed by shard name.

Keys are shard file names without their input suffix (``part-00001`` for ``part-00001.jsonl.gz``)
and are used to build artifact paths, so anything that could escape a directory or confuse a
log (``..``, slashes, absolute paths, control characters) is rejected, not rewritten.
"""

from __future__ import annotations

import functools
import os

from dagster import DagsterInstance, DynamicPartitionsDefinition

from tokenmill.formats.merge import natural_key
from tokenmill.ingest.records import shard_name
from tokenmill.recipe import DatasetConfig
from tokenmill.storage.layout import check_name


def partitions_name(dataset: str) -> str:
    """``<ds>_shards``: the name of a dataset's partition set in the Dagster instance."""
    return f"{dataset}_shards"


@functools.cache
def shard_partitions(dataset: str) -> DynamicPartitionsDefinition:
    """The dataset's partitions definition (one object per dataset, shared by every user)."""
    return DynamicPartitionsDefinition(name=partitions_name(dataset))


def shard_keys(instance: DagsterInstance, ds: DatasetConfig) -> list[str]:
    """The dataset's current partition keys in merge order (``part-2`` before ``part-10``)."""
    return sorted(instance.get_dynamic_partitions(partitions_name(ds.name)), key=natural_key)


def check_partition_key(key: str) -> str:
    """Return ``key`` if it is a safe shard name; ConfigError naming the problem otherwise
    (the rule of every name part in the storage layout, ``tokenmill.storage.layout.check_name``)."""
    return check_name(key, "partition key")


def partition_key_for(path: str | os.PathLike[str]) -> str:
    """The partition key of a shard file: its sanitized shard name."""
    return check_partition_key(shard_name(path))
