"""Jobs: per dataset, the shard job (validate, export, tokenize one partition) and the merge job
(merge and everything downstream of it); for the recipe, the refresh of all indices and blends.
"""

from __future__ import annotations

from typing import Any

from dagster import AssetKey, AssetSelection, define_asset_job, in_process_executor

from tokenmill.recipe import DatasetConfig, Recipe

SHARD_STAGES = ("raw_jsonl", "hf_dataset", "tokens")
DOWNSTREAM_STAGES = ("dataset_info", "merged", "pruned", "nanoset")
REFRESH_JOB = "refresh_job"
# What ``define_asset_job`` returns (its class is not exported by dagster).
AssetJob = Any


def shard_job_name(dataset: str) -> str:
    """``<ds>_shard_job``."""
    return f"{dataset}_shard_job"


def merge_job_name(dataset: str) -> str:
    """``<ds>_merge_job``."""
    return f"{dataset}_merge_job"


def shard_stages(ds: DatasetConfig) -> tuple[str, ...]:
    """The shard stages of a dataset: an ``hf``-format one has no ``raw_jsonl``."""
    return SHARD_STAGES if ds.has_raw_stage else SHARD_STAGES[1:]


def shard_job(ds: DatasetConfig) -> AssetJob:
    """Validate, export and tokenize one shard (one partition), with the blocking checks."""
    keys = [AssetKey([ds.name, stage]) for stage in shard_stages(ds)]
    return define_asset_job(
        shard_job_name(ds.name),
        selection=AssetSelection.assets(*keys),
        description=f"Validate, export and tokenize one shard of {ds.name}.",
        executor_def=in_process_executor,
    )


def merge_job(dataset: str) -> AssetJob:
    """Merge the dataset's current shards and rebuild everything downstream (indices, blends)."""
    return define_asset_job(
        merge_job_name(dataset),
        selection=AssetSelection.assets(AssetKey([dataset, "merged"])).downstream(),
        description=f"Merge {dataset}'s current shards; rebuild its indices and blends.",
        executor_def=in_process_executor,
    )


def downstream_keys(recipe: Recipe) -> list[AssetKey]:
    """Every unpartitioned asset: the takedown list (when the recipe names one), merged and
    nanoset per dataset, then every blend."""
    keys = [AssetKey(["takedowns"])] if recipe.takedown.list is not None else []
    keys += [AssetKey([ds.name, stage]) for ds in recipe.datasets for stage in DOWNSTREAM_STAGES]
    return keys + [AssetKey(["blend", blend.name]) for blend in recipe.blends]


def refresh_job(recipe: Recipe) -> AssetJob:
    """Re-merge, re-index and re-blend everything (the nightly refresh)."""
    return define_asset_job(
        REFRESH_JOB,
        selection=AssetSelection.assets(*downstream_keys(recipe)),
        description="Rebuild every merged dataset, Nanoset index and blend.",
        executor_def=in_process_executor,
    )
