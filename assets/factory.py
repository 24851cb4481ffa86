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
from assets.takedowns import build_takedowns
from assets.tokenized import build_tokens
from tokenmill.recipe import Recipe


def downstream_condition(recipe: Recipe) -> AutomationCondition:
    """Refresh after an upstream updated, from what is complete, at most once per
    ``schedules.refresh_interval_minutes``; never while an unpartitioned upstream is missing,
    in progress or failed a blocking check.

    - **Updated since requested.** A shard upstream materialized after this asset was last
      requested, an unpartitioned upstream's data version changed since then (the staleness
      model's, ``assets/support/staleness.py``: a merge that reused its version triggers
      nothing, nor does a change made by a run that built this asset too), or the asset is
      newly missing (on a first evaluation: missing). Shard updates carry timestamps, so one
      landing right after a request still counts (Dagster's ``since`` keeps a trigger newer
      than its reset); a shard run again to the same tokens costs one merge that reuses its
      version, and nothing after it. Each stage follows the one before it in a run of its own
      (never beside an upstream requested on the same tick): ``merged`` after shards,
      ``nanoset`` after ``merged``, the blend after the ``nanoset``s.
    - **Shard partitions are never waited for.** Under continuous ingest some shard is always
      missing, being tokenized or failing; ``eager()`` would wait on each of them forever.
      The merge builds from the shards complete when it starts (``assets/support/complete.py``)
      and the next update brings the rest.
    - **Debounced, not "wait until quiet":** once requested, an asset is not requested again
      until the interval's cron ticks (``ScheduleConfig.refresh_interval_cron``); a steady
      trickle of shards gives one refresh per interval, the first update after a quiet
      interval one at once. Recipe edits are the recipe sensor's (``pipelines/sensors.py``).
    """
    shards = AssetSelection.assets(
        *[AssetKey([ds.name, stage]) for ds in recipe.datasets for stage in SHARD_STAGES]
    )
    requested = AutomationCondition.newly_requested()
    shard_updated = (
        AutomationCondition.any_deps_match(AutomationCondition.newly_updated())
        .allow(shards)
        .with_label("any_shard_deps_updated")
    )
    own_run = AutomationCondition.executed_with_root_target()  # a run that built this too
    changed = (
        AutomationCondition.any_deps_match(AutomationCondition.data_version_changed() & ~own_run)
        .ignore(shards)
        .with_label("any_deps_changed")
    )
    pending = (
        shard_updated.since(requested)
        | changed.since(requested)
        | AutomationCondition.missing().newly_true().since(requested)
    )
    cron = recipe.schedules.refresh_interval_cron
    recent = requested.since(AutomationCondition.cron_tick_passed(cron)).with_label(
        f"requested since the last tick of {cron}"
    )
    failed = AutomationCondition.any_checks_match(
        AutomationCondition.check_failed(), blocking_only=True
    )
    blocked = (
        AutomationCondition.any_deps_missing().ignore(shards)
        | AutomationCondition.any_deps_in_progress().ignore(shards)
        | AutomationCondition.any_deps_match(failed).ignore(shards)
        | AutomationCondition.in_progress()
        | AutomationCondition.any_deps_match(AutomationCondition.will_be_requested())
    )
    return (pending & ~recent & ~blocked).with_label(
        f"upstream updated, at most once per {recipe.schedules.refresh_interval_minutes} min, "
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
            build_merged(ds, recipe.merge, condition, recipe.takedown.list is not None),
            build_pruned(ds, condition),
            build_nanoset(ds, recipe.nanoset, condition),
        ]
        checks += export_checks(ds) + token_checks(ds) + merged_checks(ds)
        checks += nanoset_checks(ds, recipe.nanoset)
    if recipe.takedown.list is not None:
        assets.append(build_takedowns(recipe.takedown))
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
