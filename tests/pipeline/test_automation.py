"""Declarative Automation: downstream assets follow new shards, debounced (at most one refresh
per interval), never waiting for a missing, failing or in-flight shard."""

from __future__ import annotations

import datetime as dt

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


def minutes(start: dt.datetime, n: float) -> dt.datetime:
    return start + dt.timedelta(minutes=n)


def test_trickle_rebuilds_once_per_interval_and_never_waits_for_shards(
    defs: Definitions, instance: DagsterInstance
) -> None:
    """A shard every minute for ten minutes while one shard never gets tokens (missing, as a
    failing or in-flight one is): ``merged`` is rebuilt at the first update, then at most once
    per ``schedules.refresh_interval_minutes`` (5), never held back by the stuck shard; each
    later stage follows on the next tick, in a run of its own."""
    for ds in ("docs", "code"):
        instance.add_dynamic_partitions(partitions_name(ds), ["part-00000"])
        for stage in ("raw_jsonl", "hf_dataset", "tokens"):
            built(instance, [ds, stage], "part-00000")
        for stage in ("dataset_info", "merged", "pruned", "nanoset"):
            built(instance, [ds, stage])
    built(instance, ["blend", "mix"])
    now = dt.datetime.now(dt.UTC).replace(second=30, microsecond=0)
    start = now.replace(minute=now.minute - now.minute % 5) + dt.timedelta(minutes=5)  # hh:m5:30
    result = evaluate_automation_conditions(defs=defs, instance=instance, evaluation_time=start)
    assert result.total_requested == 0
    instance.add_dynamic_partitions(partitions_name("code"), ["stuck"])  # never tokenized

    requests: dict[str, list[int]] = {}
    for minute in range(1, 21):
        if minute <= 10:
            key = f"new-{minute:05d}"
            instance.add_dynamic_partitions(partitions_name("code"), [key])
            built(instance, ["code", "tokens"], key)
        result = evaluate_automation_conditions(
            defs=defs,
            instance=instance,
            cursor=result.cursor,
            evaluation_time=minutes(start, minute),
        )
        for asset in requested(result):  # the run: each asset gets a new data version
            requests.setdefault(asset.to_user_string(), []).append(minute)
            built(instance, list(asset.path), version=f"minute-{minute}")
    # at once, then once after each 5-minute tick (hh:m0, hh:m5), never between; each stage
    # on the tick after the one before it
    assert requests == {
        "code/merged": [1, 5, 10],
        "code/pruned": [2, 6, 11],
        "code/nanoset": [2, 6, 11],
        "blend/mix": [3, 7, 12],
    }

    built(instance, ["code", "tokens"], "part-00000")  # run again to the same tokens:
    result = evaluate_automation_conditions(
        defs=defs, instance=instance, cursor=result.cursor, evaluation_time=minutes(start, 21)
    )
    assert set(requested(result)) == {AssetKey(["code", "merged"])}  # one merge ...
    built(instance, ["code", "merged"], version="minute-10")  # ... which reuses its version
    for minute in (22, 23, 26):
        result = evaluate_automation_conditions(
            defs=defs,
            instance=instance,
            cursor=result.cursor,
            evaluation_time=minutes(start, minute),
        )
        assert result.total_requested == 0  # and nothing after it
