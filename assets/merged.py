"""``<ds>/merged``: every current shard of a dataset merged into one immutable ``.bin``/``.idx``
version, then the pointer moved; ``<ds>/pruned``: per-shard files of vanished shards removed.

The inputs are the dataset's partitions *now* (natural order: ``part-2`` before ``part-10``),
read through their token manifests and pairs only. The version is the hash of what the merge
reads (each shard's key and content hash, the text key, the format version), so a refresh whose
inputs did not change finds its version complete and copies nothing. A new version is written
under ``merged/<ds>/<version>/`` and ``merged/<ds>/current.json`` is moved to it last: a failed
merge leaves the current version and the pointer as they were, and a job that pinned an older
version keeps reading it until ``tokenmill gc`` removes it.
"""

from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    AutomationCondition,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.metadata import token_dataset_metadata
from assets.support.complete import complete_shards, report_left_out
from assets.support.partitions import shard_keys
from assets.support.resources import StorageResource, display_path
from assets.support.staleness import merged_data_version
from tokenmill.formats.dataset_manifest import (
    check_dataset_files,
    dataset_manifest_path,
    read_dataset_manifest,
)
from tokenmill.recipe import DatasetConfig
from tokenmill.storage import layout
from tokenmill.storage.versions import read_pointer, write_pointer
from tokenmill.tokenize.merge import merge_datasets, natural_key


def version_from_manifests(storage: StorageResource, ds: DatasetConfig, keys: list[str]) -> str:
    """The version a merge of ``keys`` would write now, from the shards' token manifests alone
    (a shard not tokenized yet counts as None); equal to the data version the staleness model
    expects from the shards' records (``merged_data_version``)."""
    inputs = []
    for key in keys:
        prefix = storage.tokens_prefix(ds.name, key, ds.text_key)
        done = dataset_manifest_path(prefix).is_file()
        inputs.append((key, str(read_dataset_manifest(prefix)["content_hash"]) if done else None))
    return merged_data_version(ds, inputs)


def build_merged(ds: DatasetConfig, automation_condition: AutomationCondition) -> AssetsDefinition:
    """The ``<ds>/merged`` asset of one dataset."""

    @asset(
        key=AssetKey([ds.name, "merged"]),
        deps=[AssetKey([ds.name, "tokens"])],
        group_name=ds.name,
        kinds={"megatron"},
        automation_condition=automation_condition,
        description=f"All current shards of {ds.name} merged into one immutable .bin/.idx "
        "version; merged/<ds>/current.json names it.",
    )
    def merged(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        keys = shard_keys(context.instance, ds)
        if not keys:
            raise Failure(f"{ds.name}: no shards at all")
        tokens = [layout.tokens_prefix(ds.name, k, ds.text_key) for k in keys]
        pointer_key = layout.merged_pointer(ds.name)
        manifests = [m for t in tokens for m in layout.dataset_manifests(t)]
        with storage.workspace([*manifests, pointer_key]) as ws:
            prefixes = [ws.storage.path(t) for t in tokens]
            found = dict(zip(keys, prefixes, strict=True))
            keys, left_out = complete_shards(context.instance, ds, found)
            report_left_out(context, ds, keys, left_out)
            tokens = [layout.tokens_prefix(ds.name, k, ds.text_key) for k in keys]
            prefixes = [ws.storage.path(t) for t in tokens]
            version = version_from_manifests(ws.storage, ds, keys)
            out_key = layout.merged_prefix(ds.name, ds.text_key, version)
            ws.fetch(layout.dataset_manifests(out_key))
            out = ws.storage.path(out_key)
            previous = read_pointer(ws.storage.path(pointer_key))
            reused = dataset_manifest_path(out).is_file()
            if reused:
                ws.fetch([f"{out_key}.idx"])
                reused = not check_dataset_files(out) if ws.stage is None else True
            seconds = None
            if not reused:
                ws.fetch([f"{t}.bin" for t in tokens] + [f"{t}.idx" for t in tokens])
                result = merge_datasets(prefixes, out, order="given", input_uri=display_path)
                seconds = result.seconds
            target = out_key.removeprefix(layout.merged_dir(ds.name) + "/")
            write_pointer(ws.storage.path(pointer_key), version, target)
            metadata: dict[str, Any] = token_dataset_metadata(out)
            manifest = read_dataset_manifest(out)
            before = previous["version"] if previous else None
            if seconds is not None:  # a copy rate, not a tokenizing rate
                metadata["copy_mb_per_second"] = round(metadata["bytes"] / 1e6 / seconds, 1)
            metadata.update(
                quarantined=int(manifest["counts"].get("quarantined", 0)),
                tokenizer_fingerprint=str(manifest["config"].get("tokenizer_fingerprint")),
                shards=len(keys),
                version=version,
                previous_version=str(before),
                reused_version=reused,
            )
            context.log.info(
                f"{ds.name}: version {version[:16]} "
                f"({'unchanged inputs, reused' if reused else 'merged'}); pointer moved from "
                f"{before and before[:16]}"
            )
            return MaterializeResult(metadata=metadata, data_version=DataVersion(version))

    return merged


def shard_files(ds: DatasetConfig) -> dict[str, tuple[str, ...]]:
    """Folders of per-shard artifacts and the suffixes that follow the shard key in them."""
    document = f"_{ds.text_key}_document"
    return {
        f"{layout.raw_dir(ds.name)}/": (".stats.json", ".quarantine.jsonl"),
        f"{layout.hf_dir(ds.name)}/data/": (".parquet",),
        f"{layout.hf_dir(ds.name)}/shards/": (".json",),
        f"{layout.tokens_dir(ds.name)}/": tuple(
            document + s for s in (".bin", ".idx", ".manifest.json")
        ),
        f"{layout.tokens_dir(ds.name)}/{layout.DATASET_MANIFESTS}/": (document + ".manifest.json",),
    }


def shard_of(rel: str, folders: dict[str, tuple[str, ...]]) -> str | None:
    """The shard key of a per-shard artifact (a path relative to the root), or None for any
    other file (temps included: they sit in a ``.tmp/`` subfolder, and end in the temp mark)."""
    for base, suffixes in folders.items():
        name = rel.removeprefix(base)
        if name == rel or "/" in name:
            continue
        for suffix in suffixes:
            if name.endswith(suffix) and len(name) > len(suffix):
                return name[: -len(suffix)]
    return None


def build_pruned(ds: DatasetConfig, automation_condition: AutomationCondition) -> AssetsDefinition:
    """The ``<ds>/pruned`` asset: removes the per-shard files (raw stats and quarantine, Parquet,
    export record, tokens) of shards that are no longer partitions, after the merge that left
    them out. It lists names; it reads no file."""

    @asset(
        key=AssetKey([ds.name, "pruned"]),
        deps=[AssetKey([ds.name, "merged"])],
        group_name=ds.name,
        kinds={"json"},
        automation_condition=automation_condition,
        description=f"Per-shard files of {ds.name}'s vanished shards, removed after the merge.",
    )
    def pruned(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        current = set(shard_keys(context.instance, ds))
        folders = shard_files(ds)
        stale = []
        for rel in storage.list_keys(list(folders)):
            shard = shard_of(rel, folders)
            if shard is not None and shard not in current:
                stale.append((shard, rel))
        storage.delete_keys([rel for _, rel in stale])
        shards = sorted({s for s, _ in stale}, key=natural_key)
        if shards:
            context.log.warning(
                f"{ds.name}: removed {len(stale)} files of vanished shards {shards}"
            )
        return MaterializeResult(
            metadata={
                "shards_removed": MetadataValue.json(shards),
                "files_removed": len(stale),
                "shards": len(current),
            }
        )

    return pruned
