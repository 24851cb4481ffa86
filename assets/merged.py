"""``<ds>/merged``: every current shard of a dataset as one immutable merged version, then the
pointer moved; ``<ds>/pruned``: per-shard files of vanished shards removed.

The inputs are the dataset's partitions *now* (natural order: ``part-2`` before ``part-10``),
read through their token manifests. ``merge: virtual`` (the default) writes only a manifest of
the shard pairs (``tokenmill.formats.virtual_merge``): a refresh costs O(new shards) bytes.
``merge: physical`` copies every shard into Megatron's merged pair. The version is the library's
hash of what the merge reads (``tokenmill.tokenize.merged_versions``), so a refresh whose inputs
did not change finds its version complete and writes nothing; a version that only appends
shards records the one it ``extends``. A new version is written under ``merged/<ds>/<version>/``
and ``merged/<ds>/current.json`` is moved to it last: a failed merge leaves the current version
and the pointer as they were, and a job that pinned an older version keeps reading it until
``tokenmill gc`` removes it.
"""

from collections.abc import Mapping
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
from assets.support.pointers import MERGED_POOL, PRUNED_POOL, rerun_superseded
from assets.support.resources import StorageResource, display_path
from assets.support.takedowns import TAKEDOWNS, read_storage_ledger
from tokenmill.formats.dataset_manifest import (
    DATASET_MANIFEST_SUFFIX,
    dataset_manifest_path,
    prefix_of_manifest,
    read_dataset_manifest,
)
from tokenmill.formats.merge import natural_key
from tokenmill.formats.takedown_records import merge_masks
from tokenmill.formats.virtual_merge import is_virtual
from tokenmill.recipe import DatasetConfig
from tokenmill.storage import layout
from tokenmill.storage.versions import read_pointer
from tokenmill.tokenize.merged_versions import merge_version, previous_manifest
from tokenmill.tokenize.merged_versions import shard_identities as recorded_shards


def shard_identities(
    storage: StorageResource,
    ds: DatasetConfig,
    keys: list[str],
    parsed: Mapping[str, dict[str, Any]] | None = None,
) -> list[tuple[str, str | None]]:
    """``(shard, tokens content hash)`` of ``keys`` from the token manifests alone (a shard not
    tokenized yet counts as None; ``parsed``: manifests already read, by key): the inputs of the
    merged version."""
    parsed = parsed or {}
    inputs: list[tuple[str, str | None]] = []
    for key in keys:
        prefix = storage.tokens_prefix(ds.name, key, ds.text_key)
        if key in parsed:
            inputs.append((key, str(parsed[key]["content_hash"])))
            continue
        done = dataset_manifest_path(prefix).is_file()
        inputs.append((key, str(read_dataset_manifest(prefix)["content_hash"]) if done else None))
    return inputs


def build_merged(
    ds: DatasetConfig,
    merge: str,
    automation_condition: AutomationCondition,
    takedown_list: bool = False,
) -> AssetsDefinition:
    """The ``<ds>/merged`` asset of one dataset (``merge``: the recipe's merge mode;
    ``takedown_list``: the recipe names one, so the ``takedowns`` asset is an input)."""
    what = (
        "a manifest of its shard pairs (virtual: nothing is copied)"
        if merge == "virtual"
        else "one .bin/.idx pair (physical, Megatron's merge)"
    )

    @asset(
        key=AssetKey([ds.name, "merged"]),
        deps=[AssetKey([ds.name, "tokens"]), *([TAKEDOWNS] if takedown_list else [])],
        group_name=ds.name,
        kinds={"megatron"},
        automation_condition=automation_condition,
        description=f"All current shards of {ds.name} as one immutable merged version, "
        f"{what}; merged/{ds.name}/current.json names it.",
        pool=MERGED_POOL,
    )
    @rerun_superseded
    def merged(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        keys = shard_keys(context.instance, ds)
        if not keys:
            raise Failure(f"{ds.name}: no shards at all")
        tokens = [layout.tokens_prefix(ds.name, k, ds.text_key) for k in keys]
        pointer_key = layout.merged_pointer(ds.name)
        manifests = [layout.dataset_manifest(t) for t in tokens]
        with storage.workspace([pointer_key, *manifests]) as ws:
            previous = read_pointer(ws.storage.path(pointer_key))
            prefixes = [ws.storage.path(t) for t in tokens]
            found = dict(zip(keys, prefixes, strict=True))
            old = _previous(ws, ds, previous)
            held = dict(recorded_shards(old)) if old else {}
            parsed: dict[str, dict[str, Any]] = {}
            keys, left_out = complete_shards(context.instance, ds, found, held, parsed)
            report_left_out(context, ds, keys, left_out)
            tokens = [layout.tokens_prefix(ds.name, k, ds.text_key) for k in keys]
            prefixes = [ws.storage.path(t) for t in tokens]
            identities = shard_identities(ws.storage, ds, keys, parsed)
            # the takedown ledger: documents every merge masks (ConfigError for a physical one)
            ledger = read_storage_ledger(storage)
            masks, taken = merge_masks(ledger, ds.name, identities, merge)
            made = merge_version(
                ws.storage.path(layout.merged_dir(ds.name)),
                ds.name,
                ds.text_key,
                list(zip(keys, prefixes, strict=True)),
                merge=merge,
                identities=identities,
                previous=previous,
                old_manifest=old,
                masks=masks,
                takedown=taken,
                input_uri=display_path,
                fetch=None if ws.stage is None else ws.fetch_paths,
            )
            version, out, reused = made.version, made.prefix, made.reused
            seconds, base = made.seconds, made.extends
            # the shard .idx files a virtual merge's histogram reads (uploads follow the step)
            ws.fetch_index(layout.merged_prefix(ds.name, ds.text_key, version))
            metadata: dict[str, Any] = token_dataset_metadata(out)
            manifest = read_dataset_manifest(out)
            before = previous["version"] if previous else None
            if seconds is not None and merge == "physical":  # a copy rate, not a tokenizing rate
                metadata["copy_mb_per_second"] = round(metadata["bytes"] / 1e6 / seconds, 1)
            metadata.update(
                quarantined=int(manifest["counts"].get("quarantined", 0)),
                tokenizer_fingerprint=str(manifest["config"].get("tokenizer_fingerprint")),
                shards=len(keys),
                version=version,
                previous_version=str(before),
                extends=str(manifest.get("extends")),
                reused_version=reused,
                takedown_removed=sum(len(v) for v in masks.values()),
            )
            if "takedown" in manifest:
                metadata["takedown"] = MetadataValue.json(manifest["takedown"])
            context.log.info(
                f"{ds.name}: version {version[:16]} "
                f"({'unchanged inputs, reused' if reused else merge + ' merge'}); pointer moved "
                f"from {before and before[:16]}" + (f"; extends {base[:16]}" if base else "")
            )
            return MaterializeResult(metadata=metadata, data_version=DataVersion(version))

    return merged


def _previous(ws: Any, ds: DatasetConfig, previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """The manifest of the version the pointer names (staged from S3 first), None without one:
    the shards it holds stay in, and a new version extends it when it only appends shards."""
    if previous is None:
        return None
    prev_key = f"{layout.merged_dir(ds.name)}/{previous['target']}"
    ws.fetch([layout.dataset_manifest(prev_key)])
    return previous_manifest(ws.storage.path(prev_key))


def shard_files(ds: DatasetConfig) -> dict[str, tuple[str, ...]]:
    """Folders of per-shard artifacts and the suffixes that follow the shard key in them."""
    document = f"_{ds.text_key}_document"
    return {
        f"{layout.raw_dir(ds.name)}/": (".stats.json", ".quarantine.jsonl", ".dochash.npy"),
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


def referenced_shards(storage: StorageResource, ds: DatasetConfig) -> set[str]:
    """The shard keys that a virtual merged version still on the root names: their token
    pairs are read in place, so they stay until the last such version is removed."""
    folder = layout.merged_dir(ds.name)
    manifests = [
        key
        for key in storage.list_keys([f"{folder}/"])
        if key.endswith(DATASET_MANIFEST_SUFFIX) and f"/{layout.DATASET_MANIFESTS}/" in key
    ]
    named: set[str] = set()
    with storage.workspace(manifests, upload=False) as ws:
        for key in manifests:
            manifest = read_dataset_manifest(prefix_of_manifest(ws.storage.path(key)))
            if is_virtual(manifest):
                named.update(str(shard["key"]) for shard in manifest["shards"])
    return named


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
        pool=PRUNED_POOL,
    )
    def pruned(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        folders = shard_files(ds)
        listed = [(shard_of(rel, folders), rel) for rel in storage.list_keys(list(folders))]
        # partitions read after the listing: a shard is registered before any file of it is
        # written, so a shard whose files were listed is in ``current`` unless it vanished
        current = set(shard_keys(context.instance, ds))
        stale, kept = [], set()
        candidates = [(s, rel) for s, rel in listed if s is not None and s not in current]
        named = referenced_shards(storage, ds) if candidates else set()
        tokens_folder = f"{layout.tokens_dir(ds.name)}/"
        for shard, rel in candidates:
            if shard in named and rel.startswith(tokens_folder):
                kept.add(shard)  # a merged version still on the root reads this pair in place
            else:
                stale.append((shard, rel))
        storage.delete_keys([rel for _, rel in stale])
        shards = sorted({s for s, _ in stale}, key=natural_key)
        if shards:
            context.log.warning(
                f"{ds.name}: removed {len(stale)} files of vanished shards {shards}"
            )
        if kept:
            context.log.info(
                f"{ds.name}: kept the tokens of vanished shards {sorted(kept)}: merged versions "
                "still on the root read them (they go once `tokenmill gc` removes those)"
            )
        return MaterializeResult(
            metadata={
                "shards_removed": MetadataValue.json(shards),
                "tokens_kept_for_versions": MetadataValue.json(sorted(kept)),
                "files_removed": len(stale),
                "shards": len(current),
            }
        )

    return pruned
