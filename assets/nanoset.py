"""``<ds>/nanoset``: the merged dataset's Nanoset indices for train, valid and test.

Each split's document/sample/shuffle index goes to the shared content-addressed cache
``nanoset/<hash>-Nanoset-<split>-*`` (the hash covers the merged content and every setting), so
an unchanged dataset with unchanged settings costs a load, and a change never reuses stale
arrays. Sample counts are the recipe's ``train_samples``/``valid_samples``/``test_samples``
(null = one epoch of the split).
"""

import dataclasses
import hashlib
import json
from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    AutomationCondition,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.metadata import path_value
from pipelines.resources import StorageResource
from tokenmill import layout
from tokenmill.errors import ConfigError
from tokenmill.manifest import dataset_content_hash, dataset_manifest_path
from tokenmill.nanoset import SPLITS, NanosetIndex, build_or_load
from tokenmill.recipe import DatasetConfig, NanosetConfig


def split_indices(
    storage: StorageResource, ds: DatasetConfig, cfg: NanosetConfig
) -> dict[str, NanosetIndex | None]:
    """Each split's index of the merged dataset from the shared cache (built on a miss);
    None for an empty split. Requested samples per split come from the recipe (None = one epoch).
    """
    requested = {"train": cfg.train_samples, "valid": cfg.valid_samples, "test": cfg.test_samples}
    return {
        split: build_or_load(
            storage.merged_prefix(ds.name, ds.text_key),
            storage.nanoset_dir(),
            split=split,
            split_spec=cfg.split,
            sequence_length=cfg.sequence_length,
            seed=cfg.seed,
            num_samples=samples,
            semantics=cfg.semantics,
        )
        for split, samples in requested.items()
    }


def input_version(storage: StorageResource, ds: DatasetConfig, cfg: NanosetConfig) -> str:
    """Hash of the merged dataset's content and the index settings."""
    try:
        prefix = storage.merged_prefix(ds.name, ds.text_key)
    except ConfigError:  # never merged
        prefix = None
    done = prefix is not None and dataset_manifest_path(prefix).is_file()
    content = dataset_content_hash(prefix, index_only=True) if done else None
    return hashlib.sha256(json.dumps([content, dataclasses.asdict(cfg)]).encode()).hexdigest()


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
    )
    def nanoset(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        with storage.workspace([layout.merged_pointer(ds.name)]) as ws:
            key = ws.storage.merged_key(ds.name, ds.text_key)
            ws.fetch([f"{key}.idx", f"{key}.manifest.json"])  # lengths and content hash
            prefix = ws.storage.path(key)
            rows = ["| split | samples | cache hash |", "|---|---:|---|"]
            metadata: dict[str, Any] = {"input_version": input_version(ws.storage, ds, cfg)}
            for split, index in split_indices(ws.storage, ds, cfg).items():
                samples = 0 if index is None else len(index)
                rows.append(
                    f"| {split} | {samples} | {index.cache_hash if index else '(empty split)'} |"
                )
                metadata[f"{split}_samples"] = samples
            context.log.info(f"{ds.name}: indices for {', '.join(SPLITS)} ready")
            metadata.update(
                sequence_length=cfg.sequence_length,
                semantics=cfg.semantics,
                content_hash=dataset_content_hash(prefix, index_only=True),
                splits=MetadataValue.md("\n".join(rows)),
                path=path_value(ws.storage.nanoset_dir()),
            )
            return MaterializeResult(metadata=metadata)

    return nanoset
