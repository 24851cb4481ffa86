"""``<ds>/merged``: every current shard of a dataset merged into one ``.bin``/``.idx`` pair.

The inputs are the dataset's partitions *now* (natural order: ``part-2`` before ``part-10``).
Shards that were in the previous merged build but have vanished from the source are reported
in the log and the metadata (``shards_removed``), and their per-shard artifacts (stats,
quarantine, Parquet, tokens) are deleted; ``hf/<ds>/dataset_info.json`` is rewritten to list
exactly the merged shards.
"""

import contextlib
import hashlib
import json
from pathlib import Path

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    AutomationCondition,
    DagsterInstance,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.hf_export import write_export_info
from assets.metadata import token_dataset_metadata
from pipelines.partitions import partitions_name
from pipelines.resources import StorageResource, display_path
from tokenmill.errors import FormatError
from tokenmill.formats.indexed import data_file_path, index_file_path
from tokenmill.manifest import dataset_content_hash, dataset_manifest_path, read_dataset_manifest
from tokenmill.merge import merge_datasets, natural_key
from tokenmill.recipe import DatasetConfig


def shard_keys(instance: DagsterInstance, ds: DatasetConfig) -> list[str]:
    """The dataset's current partition keys in merge order."""
    return sorted(instance.get_dynamic_partitions(partitions_name(ds.name)), key=natural_key)


def input_version(storage: StorageResource, ds: DatasetConfig, keys: list[str]) -> str:
    """Hash of what a merge would read: each shard's key and content hash, in order."""
    parts = []
    for key in keys:
        prefix = storage.tokens_prefix(ds.name, key, ds.text_key)
        done = dataset_manifest_path(prefix).is_file()
        parts.append([key, dataset_content_hash(prefix) if done else None])
    return hashlib.sha256(json.dumps([ds.text_key, parts]).encode()).hexdigest()


def previous_shards(prefix: Path, text_key: str) -> list[str]:
    """Shard keys of the last completed merge at ``prefix`` (empty if there is none)."""
    try:
        inputs = read_dataset_manifest(prefix)["inputs"]
    except FormatError:
        return []
    suffix = f"_{text_key}_document"
    return [Path(str(i["prefix"])).name.removesuffix(suffix) for i in inputs]


def prune_shards(storage: StorageResource, ds: DatasetConfig, removed: list[str]) -> list[str]:
    """Delete the per-shard artifacts of vanished shards; the paths that were deleted."""
    deleted = []
    for key in removed:
        prefix = storage.tokens_prefix(ds.name, key, ds.text_key)
        for path in (
            dataset_manifest_path(prefix),
            data_file_path(prefix),
            index_file_path(prefix),
            storage.parquet_path(ds.name, key),
            storage.raw_stats_path(ds.name, key),
            storage.quarantine_path(ds.name, key),
        ):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                deleted.append(str(path))
    return deleted


def describe_export(storage: StorageResource, ds: DatasetConfig, keys: list[str]) -> None:
    """Rewrite ``hf/<ds>/dataset_info.json`` for exactly the merged shards (shard runs each
    rewrite it too, but in parallel runs the last writer may have missed a sibling)."""
    write_export_info(storage, ds, keys)


def build_merged(ds: DatasetConfig, automation_condition: AutomationCondition) -> AssetsDefinition:
    """The ``<ds>/merged`` asset of one dataset."""

    @asset(
        key=AssetKey([ds.name, "merged"]),
        deps=[AssetKey([ds.name, "tokens"])],
        group_name=ds.name,
        kinds={"numpy"},
        automation_condition=automation_condition,
        description=f"All current shards of {ds.name} merged into one .bin/.idx pair.",
    )
    def merged(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        keys = shard_keys(context.instance, ds)
        inputs = [f"tokens/{ds.name}/", f"hf/{ds.name}/data/", f"raw/{ds.name}/"]
        inputs.append(f"merged/{ds.name}_{ds.text_key}_document.manifest.json")
        with storage.workspace(inputs) as ws:
            prefixes = [ws.storage.tokens_prefix(ds.name, k, ds.text_key) for k in keys]
            missing = [
                k
                for k, p in zip(keys, prefixes, strict=True)
                if not dataset_manifest_path(p).is_file()
            ]
            if not keys or missing:
                raise Failure(
                    f"{ds.name}: shards not tokenized yet: {missing or 'no shards at all'}"
                )
            out = ws.storage.merged_prefix(ds.name, ds.text_key)
            before = previous_shards(out, ds.text_key)
            version = input_version(ws.storage, ds, keys)
            result = merge_datasets([*prefixes], out, order="given", input_uri=display_path)
            removed = sorted(set(before) - set(keys), key=natural_key)
            if removed:
                context.log.warning(f"{ds.name}: shards gone from the source, left out: {removed}")
                deleted = prune_shards(ws.storage, ds, removed)
                context.log.info(f"deleted {len(deleted)} artifacts of removed shards: {deleted}")
            describe_export(ws.storage, ds, keys)
            metadata = token_dataset_metadata(out, seconds=result.seconds)
            metadata.update(
                shards=len(keys),
                shards_added=MetadataValue.json(sorted(set(keys) - set(before), key=natural_key)),
                shards_removed=MetadataValue.json(removed),
                input_version=version,
            )
            return MaterializeResult(metadata=metadata)

    return merged
