"""Shard sensors: new, changed and vanished shards, through the pure planner and the sensor."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dagster import DagsterInstance, Definitions, SensorResult, build_sensor_context

from pipelines.partitions import partitions_name
from pipelines.sensors import AUTOMATION_SENSOR, plan_tick
from pipelines.sources import Listing, ShardFile, diff_listing, list_shards
from tokenmill.recipe import Recipe


def listing(**fingerprints: str) -> Listing:
    return Listing({k: ShardFile(k, Path(f"/src/{k}.jsonl"), v) for k, v in fingerprints.items()})


def tick(defs: Definitions, instance: DagsterInstance, cursor: str | None) -> SensorResult:
    sensor = defs.resolve_sensor_def("docs_shard_sensor")
    with build_sensor_context(instance=instance, cursor=cursor, definitions=defs) as context:
        result = sensor(context)
    assert isinstance(result, SensorResult)
    return result


def apply(instance: DagsterInstance, result: SensorResult) -> None:
    """What the sensor daemon does with the partition requests."""
    for request in result.dynamic_partitions_requests or []:
        if type(request).__name__ == "AddDynamicPartitionsRequest":
            instance.add_dynamic_partitions(request.partitions_def_name, request.partition_keys)
        else:
            for key in request.partition_keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)


def test_diff_and_plan() -> None:
    assert diff_listing({"a": "1", "b": "1"}, {"b": "2", "c": "1"}).__dict__ == {
        "new": ["c"],
        "changed": ["b"],
        "vanished": ["a"],
    }
    plan = plan_tick('{"a": "1", "b": "1"}', listing(b="2", c="1"), registered={"a", "b"})
    assert (plan.add, plan.run, plan.delete, plan.vanished) == (["c"], ["b", "c"], ["a"], ["a"])
    assert json.loads(plan.cursor) == {"b": "2", "c": "1"}
    assert any("vanished" in m and "'a'" in m for m in plan.messages)
    assert plan.vanished_run_key({"a": "1"}) == "vanished:a@1"
    again = plan_tick(plan.cursor, listing(b="2", c="1"), registered={"b", "c"})
    assert (again.add, again.run, again.delete) == ([], [], [])
    broken = plan_tick("{not json", listing(b="2"), registered=set())
    assert broken.run == ["b"] and "unreadable cursor" in broken.messages[0]


def test_sensor_new_changed_vanished(
    recipe: Recipe, defs: Definitions, instance: DagsterInstance
) -> None:
    first = tick(defs, instance, None)
    shards = ["extra-00000", "part-00000", "part-00001", "part-00002"]
    [add] = first.dynamic_partitions_requests
    assert add.partitions_def_name == partitions_name("docs") and list(add.partition_keys) == shards
    source = list_shards(recipe.dataset("docs")).shards
    assert [(r.partition_key, r.run_key, r.job_name) for r in first.run_requests] == [
        (k, f"{k}:{source[k].fingerprint}", "docs_shard_job") for k in shards
    ]
    assert (
        first.run_requests[0].tags["tokenmill/source_fingerprint"] == source[shards[0]].fingerprint
    )
    apply(instance, first)
    assert tick(defs, instance, first.cursor).run_requests == []

    changed = source["part-00001"].path
    changed.write_bytes(changed.read_bytes() + b'{"text": "one more"}\n')
    os.utime(changed, ns=(1, 2))
    source["part-00002"].path.unlink()
    second = tick(defs, instance, first.cursor)
    runs = {(r.job_name, r.partition_key) for r in second.run_requests}
    assert runs == {("docs_shard_job", "part-00001"), ("docs_merge_job", None)}
    merge = next(r for r in second.run_requests if r.job_name == "docs_merge_job")
    assert merge.run_key == f"vanished:part-00002@{source['part-00002'].fingerprint}"
    [delete] = second.dynamic_partitions_requests
    assert list(delete.partition_keys) == ["part-00002"]
    apply(instance, second)
    assert instance.get_dynamic_partitions(partitions_name("docs")) == shards[:3]
    assert "part-00002" not in json.loads(second.cursor)


def test_automation_sensor_starts_running(defs: Definitions) -> None:
    sensor = defs.resolve_sensor_def(AUTOMATION_SENSOR)
    assert sensor.default_status.value == "RUNNING"
    assert defs.resolve_sensor_def("code_shard_sensor").default_status.value == "RUNNING"
