"""Definitions from data: every dataset and blend of a recipe becomes assets and checks.

Per dataset: ``<ds>/raw_jsonl`` (JSONL sources only), ``<ds>/hf_dataset``, ``<ds>/tokens``
(partitioned by shard), ``<ds>/dataset_info``, ``<ds>/merged``, ``<ds>/pruned``,
``<ds>/nanoset``; per blend: ``blend/<name>``. The unpartitioned stages follow their
upstreams' data versions through Declarative Automation. The shard assets carry a concurrency
pool and a ``BackfillPolicy`` that batches backfills into ranges of shards
(``assets/shards.py``).
"""

from __future__ import annotations

from dagster import AssetChecksDefinition, AssetsDefinition, AutomationCondition

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
from assets.tokenized import build_tokens
from tokenmill.recipe import Recipe


def downstream_condition() -> AutomationCondition:
    """``eager()`` reading data versions (update after an upstream's data version changed; wait
    while any is missing or in progress), and not while an upstream's blocking check has
    failed: a bad shard stops at its checks.

    Data versions are the staleness model's (``assets/support/staleness.py``): a shard run
    again to the same tokens, or a merge that reused its version, triggers nothing, as it
    leaves ``tokenmill materialize`` nothing to do. Because a missing or running upstream
    partition holds the update back, a burst of new shards registered together leads to one
    downstream rebuild once they are all done.
    """
    changed = AutomationCondition.any_deps_match(
        AutomationCondition.data_version_changed() | AutomationCondition.will_be_requested()
    )
    eager = AutomationCondition.eager().replace(
        "any_deps_updated", changed.with_label("any_deps_changed")
    )
    failed = AutomationCondition.any_checks_match(
        AutomationCondition.check_failed(), blocking_only=True
    )
    return (eager & ~AutomationCondition.any_deps_match(failed)).with_label(
        "eager on data versions, unless an upstream blocking check failed"
    )


def build_assets(recipe: Recipe) -> tuple[list[AssetsDefinition], list[AssetChecksDefinition]]:
    """Every asset and asset check of a recipe."""
    condition = downstream_condition()
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
            build_merged(ds, recipe.merge, condition),
            build_pruned(ds, condition),
            build_nanoset(ds, recipe.nanoset, condition),
        ]
        checks += export_checks(ds) + token_checks(ds) + merged_checks(ds)
        checks += nanoset_checks(ds, recipe.nanoset)
    for blend in recipe.blends:
        members = [recipe.dataset(name) for name in blend.datasets]
        assets.append(build_blend_asset(blend, recipe.nanoset, members, condition))
        checks += blend_checks(blend)
    return assets, checks
