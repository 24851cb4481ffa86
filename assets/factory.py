"""Definitions from data: every dataset and blend of a recipe becomes assets and checks.

Per dataset: ``<ds>/raw_jsonl`` (JSONL sources only), ``<ds>/hf_dataset``, ``<ds>/tokens``
(partitioned by shard), ``<ds>/dataset_info``, ``<ds>/merged``, ``<ds>/pruned``,
``<ds>/nanoset``; per blend: ``blend/<name>``. The unpartitioned stages follow their
upstreams' data versions through Declarative Automation (:func:`downstream_condition`),
debounced, never waiting for shard partitions. The shard assets carry a concurrency
pool and a ``BackfillPolicy`` that batches backfills into ranges of shards
(``assets/shards.py``).
"""

from __future__ import annotations

from dagster import (
    AssetChecksDefinition,
    AssetKey,
    AssetsDefinition,
    AssetSelection,
    AutomationCondition,
)

from assets.blends import build_blend_asset
from assets.checks import (
    blend_checks,
    export_checks,
    merged_checks,
    nanoset_checks,
    raw_checks,
    token_checks,
)
from assets.hf_export import build_dataset_info, build_hf_dataset
from assets.merged import build_merged, build_pruned
from assets.nanoset import build_nanoset
from assets.raw import build_raw_jsonl
from assets.support.staleness import SHARD_STAGES, recipe_code_versions
from assets.tokenized import build_tokens
from tokenmill.recipe import Recipe


def downstream_condition(recipe: Recipe) -> AutomationCondition:
    """Refresh when an upstream's data changed, from what is complete, at most once per
    ``schedules.refresh_interval_minutes``; never while an unpartitioned upstream is missing,
    in progress or failed a blocking check.

    - **Changed** is "a dependency's data version changed (or it will be requested this tick)",
      or the asset is newly missing, since the asset was last requested or updated. Data
      versions are the staleness model's (``assets/support/staleness.py``): a shard run again
      to the same tokens, or a merge that reused its version, triggers nothing. Recipe edits
      are the recipe sensor's (``pipelines/sensors.py``).
    - **Shard partitions are never waited for.** Under continuous ingest some shard is always
      missing, being tokenized or failing; ``eager()`` would wait on each of them forever.
      The merge builds from the shards complete when it starts (``assets/support/complete.py``)
      and the next change brings the rest.
    - **Debounced, not "wait until quiet":** once requested, an asset is not requested again
      until the interval's cron ticks (``ScheduleConfig.refresh_interval_cron``); a steady
      trickle of shards gives one refresh per interval, the first change after a quiet
      interval one at once.
    """
    shards = AssetSelection.assets(
        *[AssetKey([ds.name, stage]) for ds in recipe.datasets for stage in SHARD_STAGES]
    )
    changed = AutomationCondition.any_deps_match(
        AutomationCondition.data_version_changed() | AutomationCondition.will_be_requested()
    ).with_label("any_deps_changed")
    pending = (AutomationCondition.newly_missing() | changed).since_last_handled()
    cron = recipe.schedules.refresh_interval_cron
    recent = (
        AutomationCondition.newly_requested()
        .since(AutomationCondition.cron_tick_passed(cron))
        .with_label(f"requested since the last tick of {cron}")
    )
    failed = AutomationCondition.any_checks_match(
        AutomationCondition.check_failed(), blocking_only=True
    )
    blocked = (
        AutomationCondition.any_deps_missing().ignore(shards)
        | AutomationCondition.any_deps_in_progress().ignore(shards)
        | AutomationCondition.any_deps_match(failed).ignore(shards)
        | AutomationCondition.in_progress()
    )
    return (pending & ~recent & ~blocked).with_label(
        f"data changed, at most once per {recipe.schedules.refresh_interval_minutes} min, "
        "shard partitions not waited for"
    )


def build_assets(recipe: Recipe) -> tuple[list[AssetsDefinition], list[AssetChecksDefinition]]:
    """Every asset and asset check of a recipe."""
    condition = downstream_condition(recipe)
    assets: list[AssetsDefinition] = []
    checks: list[AssetChecksDefinition] = []
    for ds in recipe.datasets:
        if ds.has_raw_stage:
            assets.append(build_raw_jsonl(ds))
            checks += raw_checks(ds)
        assets += [
            build_hf_dataset(ds),
            build_dataset_info(ds, condition),
            build_tokens(ds),
            build_merged(ds, condition),
            build_pruned(ds, condition),
            build_nanoset(ds, recipe.nanoset, condition),
        ]
        checks += export_checks(ds) + token_checks(ds) + merged_checks(ds)
        checks += nanoset_checks(ds, recipe.nanoset)
    for blend in recipe.blends:
        members = [recipe.dataset(name) for name in blend.datasets]
        assets.append(build_blend_asset(blend, recipe.nanoset, members, condition))
        checks += blend_checks(blend)
    versions = recipe_code_versions(recipe)
    return [with_code_versions(a, versions) for a in assets], checks


def with_code_versions(
    assets_def: AssetsDefinition, versions: dict[AssetKey, str]
) -> AssetsDefinition:
    """The asset with the code version of its recipe settings (``recipe_code_versions``)."""
    if assets_def.key not in versions:
        return assets_def
    return assets_def.map_asset_specs(
        lambda spec: spec.replace_attributes(code_version=versions[spec.key])
    )
