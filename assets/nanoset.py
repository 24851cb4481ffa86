"""``<ds>/nanoset``: the merged dataset's Nanoset indices for train, valid and test.

Each split's document/sample/shuffle index goes to the shared content-addressed cache
``nanoset/<hash>-Nanoset-<split>-*`` (the hash covers the merged content and every setting), so
an unchanged dataset with unchanged settings costs a lookup (a load on a local root, one LIST on
S3), and a change never reuses stale arrays. Sample counts are the recipe's ``train_samples``/
``valid_samples``/``test_samples`` (null = one epoch of the split).

The step reads the current merged version (``merged/<ds>/current.json``) and of it only the
``.idx`` (sequence lengths) and manifest (content hash), never the ``.bin``. On an S3
root it names each split's entry (``tokenmill.indices.nanoset.entry_key``) and asks S3 for it
(``Workspace.stored_index_entry``: one LIST and the small description): an entry already there
is neither rebuilt, downloaded nor uploaded again; a missing one is built in the work directory
and uploaded, arrays first, description last.
"""

from pathlib import Path
from typing import Any

import numpy as np
from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    AutomationCondition,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.metadata import path_value
from assets.support.pointers import NANOSET_POOL
from assets.support.resources import StorageResource, Workspace
from assets.support.staleness import nanoset_data_version
from tokenmill.errors import ConfigError
from tokenmill.formats.dataset_manifest import (
    dataset_content_hash,
    dataset_manifest_path,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.formats.nanoset_cache import read_description
from tokenmill.indices.growing import shard_table
from tokenmill.indices.nanoset import (
    SPLITS,
    IndexInputs,
    cache_entry,
    cache_paths,
    entry_key,
    masked_of,
)
from tokenmill.recipe import DatasetConfig, NanosetConfig
from tokenmill.storage import layout
from tokenmill.storage.versions import read_pointer


def merged_lengths(prefix: Path) -> tuple[np.ndarray, str]:
    """Sequence lengths (from the ``.idx``) and content hash (from the manifest) of a merged
    version; the ``.bin`` is never read (a hand-made pair without a manifest is hashed whole)."""
    index_only = dataset_manifest_path(prefix).is_file()
    lengths = np.asarray(open_dataset(prefix, index_only=index_only).sequence_lengths)
    return lengths, dataset_content_hash(prefix, index_only=index_only)


def merged_version(storage: StorageResource, ds: DatasetConfig) -> str:
    """The current merged version of a dataset, as its pointer names it."""
    pointer = read_pointer(storage.path(layout.merged_pointer(ds.name)))
    if pointer is None:
        raise ConfigError(f"{ds.name}: never merged ({layout.merged_pointer(ds.name)} missing)")
    return str(pointer["version"])


def build_nanoset(
    ds: DatasetConfig, cfg: NanosetConfig, automation_condition: AutomationCondition
) -> AssetsDefinition:
    """The ``<ds>/nanoset`` asset of one dataset."""

    @asset(
        key=AssetKey([ds.name, "nanoset"]),
        deps=[AssetKey([ds.name, "merged"])],
        group_name=ds.name,
        kinds={"numpy"},
        automation_condition=automation_condition,
        description=f"Nanoset indices of merged {ds.name} ({cfg.semantics} semantics).",
        pool=NANOSET_POOL,
    )
    def nanoset(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        with storage.workspace([layout.merged_pointer(ds.name)]) as ws:
            rel = ws.storage.merged_key(ds.name, ds.text_key)
            ws.fetch_index(rel)
            lengths, content = merged_lengths(ws.storage.path(rel))
            growing = cfg.semantics == "growing"
            shards = shard_table(ws.storage.path(rel)) if growing else None
            masked = masked_of(ws.storage.path(rel))  # taken down: left out of every index
            rows = ["| split | samples | cache hash | entry |", "|---|---:|---|---|"]
            version = nanoset_data_version(merged_version(ws.storage, ds), cfg)
            metadata: dict[str, Any] = {"version": version}
            before = previous_merged(ws, ds, rel) if growing else None
            for split in SPLITS:
                previous = previous_entry(ws, before, cfg, split)
                samples, digest, how = split_entry(
                    ws, lengths, content, cfg, split, shards, masked, previous
                )
                rows.append(f"| {split} | {samples} | {digest or '(empty split)'} | {how} |")
                metadata[f"{split}_samples"] = samples
            context.log.info(f"{ds.name}: indices for {', '.join(SPLITS)} ready")
            metadata.update(
                sequence_length=cfg.sequence_length,
                semantics=cfg.semantics,
                content_hash=content,
                splits=MetadataValue.md("\n".join(rows)),
                path=path_value(ws.storage.nanoset_dir()),
            )
            return MaterializeResult(metadata=metadata, data_version=DataVersion(version))

    return nanoset


def previous_merged(ws: Workspace, ds: DatasetConfig, rel: str) -> dict[str, Any] | None:
    """The manifest of the merged version the current one extends (``extends``: it only
    appended shards), staged on S3; None without one."""
    extends = read_dataset_manifest(ws.storage.path(rel)).get("extends")
    if not extends:
        return None
    before = layout.merged_prefix(ds.name, ds.text_key, str(extends))
    ws.fetch([layout.dataset_manifest(before)])
    path = ws.storage.path(before)
    return read_dataset_manifest(path) if dataset_manifest_path(path).is_file() else None


def previous_entry(
    ws: Workspace, before: dict[str, Any] | None, cfg: NanosetConfig, split: str
) -> dict[str, Any] | None:
    """The description of the predecessor merged version's entry of ``split`` (its key from
    that version's manifest; on S3 one LIST and the small description): the new entry
    extends it, writing only the new rows. None when there is none."""
    if before is None:
        return None
    settings = cfg.settings()
    count, content = int(before["counts"]["sequences"]), str(before["content_hash"])
    samples = settings.index_sizes()[split]
    found = entry_key(count, content, split, settings, samples, shards=shard_table(before))
    if found is None:
        return None
    key, digest = found
    paths = cache_paths(ws.storage.nanoset_dir(), digest, split)
    return ws.stored_index_entry(paths, key, digest) or read_description(paths["description"])


def split_entry(
    ws: Workspace,
    lengths: np.ndarray,
    content: str,
    cfg: NanosetConfig,
    split: str,
    shards: list[tuple[str, int]] | None = None,
    masked: np.ndarray | None = None,
    previous: dict[str, Any] | None = None,
) -> tuple[int, str | None, str]:
    """(samples, cache hash, how) of one split's entry: ``stored`` when S3 already holds it
    complete, else ``loaded``/``built`` from the workspace's cache (``extended`` when it
    extends ``previous``); (0, None, "-") if empty."""
    settings = cfg.settings()
    samples = settings.index_sizes()[split]
    inputs = IndexInputs(lengths, content, shards, masked)
    cache_dir = ws.storage.nanoset_dir()
    entry = cache_entry(inputs, cache_dir, split, settings, samples, previous=previous)
    if entry is None:
        return 0, None, "-"
    stored = ws.stored_index_entry(entry.paths, entry.key, entry.digest)
    if stored is not None:
        return int(stored["counts"]["num_samples"]), entry.digest, "stored"
    held = entry.paths["description"].is_file()
    entry.ensure()
    if cfg.semantics == "growing":  # its segments (earlier entries) need not be staged here
        description = read_description(entry.paths["description"]) or {}
        how = "loaded" if held else "extended" if "document.0" in description["files"] else "built"
        return int(description["counts"]["num_samples"]), entry.digest, how
    return len(entry.load()), entry.digest, "loaded" if held else "built"
