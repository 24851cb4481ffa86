"""Declarative Automation: downstream assets follow new shards, once per burst, not per shard."""

from __future__ import annotations

from dagster import (
    AssetKey,
    AssetMaterialization,
    DagsterInstance,
    Definitions,
    evaluate_automation_conditions,
)

from assets.support.partitions import partitions_name
from assets.support.staleness import DATA_VERSION_TAG

DOWNSTREAM = {
    AssetKey(["code", "merged"]),
    AssetKey(["code", "pruned"]),
    AssetKey(["code", "nanoset"]),
    AssetKey(["blend", "mix"]),
}


def built(
    instance: DagsterInstance, key: list[str], partition: str | None = None, version: str = "v1"
) -> None:
    """Record a materialization with a data version, as a finished run would."""
    instance.report_runless_asset_event(
        AssetMaterialization(
            AssetKey(key), partition=partition, tags={DATA_VERSION_TAG: f"{version}:{partition}"}
        )
    )


def requested(result: object) -> dict[AssetKey, int]:
    return {r.key: r.true_subset.size for r in result.results if r.true_subset.size}  # type: ignore[attr-defined]


def test_burst_of_50_shards_leads_to_one_rebuild(
    defs: Definitions, instance: DagsterInstance
) -> None:
    for ds in ("docs", "code"):
        instance.add_dynamic_partitions(partitions_name(ds), ["part-00000"])
        for stage in ("raw_jsonl", "hf_dataset", "tokens"):
            built(instance, [ds, stage], "part-00000")
        for stage in ("dataset_info", "merged", "pruned", "nanoset"):
            built(instance, [ds, stage])
    built(instance, ["blend", "mix"])
    result = evaluate_automation_conditions(defs=defs, instance=instance)
    assert result.total_requested == 0

    burst = [f"burst-{i:05d}" for i in range(50)]
    instance.add_dynamic_partitions(partitions_name("code"), burst)
    for i, key in enumerate(burst):
        built(instance, ["code", "tokens"], key)
        if i in (0, 25, 48):  # ticks while the burst is still being tokenized: nothing yet
            result = evaluate_automation_conditions(
                defs=defs, instance=instance, cursor=result.cursor
            )
            assert result.total_requested == 0, i
    result = evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert requested(result) == dict.fromkeys(DOWNSTREAM, 1)  # one rebuild, downstream only
    result = evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert result.total_requested == 0  # and not again on the next tick

    for key in DOWNSTREAM:
        built(instance, list(key.path))
    result = evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert result.total_requested == 0  # the rebuild itself triggers nothing
    built(instance, ["code", "tokens"], "part-00000")  # run again to the same tokens: nothing
    result = evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert result.total_requested == 0
    built(instance, ["code", "tokens"], "part-00000", "v2")  # one changed shard: one more
    result = evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert requested(result) == dict.fromkeys(DOWNSTREAM, 1)
