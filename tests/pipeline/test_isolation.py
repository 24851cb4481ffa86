"""One bad shard never costs its neighbours, and recovers alone (issues 20 and 21).

Driven as the daemons drive it: the shard sensor's ticks (``build_sensor_context``), their runs
executed as launched, and the merge job; nothing is run by hand that the daemon would not run.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    Definitions,
    RunRequest,
    SensorResult,
    build_sensor_context,
)

from assets.support.complete import LEFT_OUT
from assets.support.partitions import partitions_name
from assets.support.sources import list_shards
from assets.support.staleness import current_shards
from pipelines.sensors import RANGE_END, RANGE_START
from tokenmill.recipe import Recipe

pytestmark = pytest.mark.filterwarnings(
    "ignore:Specifying a partitions_def on an AssetCheckSpec:Warning",
    "ignore:Parameter `include_sources`:Warning",
)
BURST = ["bad-00000", "empty-00000", "trunc-00000"]


def tick(defs: Definitions, instance: DagsterInstance, cursor: str | None) -> SensorResult:
    """One tick of the docs shard sensor, its partition requests applied as the daemon does."""
    sensor = defs.resolve_sensor_def("docs_shard_sensor")
    with build_sensor_context(instance=instance, cursor=cursor, definitions=defs) as context:
        result = sensor(context)
    assert isinstance(result, SensorResult)
    for request in result.dynamic_partitions_requests or []:
        if type(request).__name__ == "AddDynamicPartitionsRequest":
            instance.add_dynamic_partitions(request.partitions_def_name, request.partition_keys)
        else:
            for key in request.partition_keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)
    return result


def execute(defs: Definitions, instance: DagsterInstance, request: RunRequest) -> bool:
    """A sensor's run request executed as the launched run would be."""
    result = defs.resolve_job_def(request.job_name).execute_in_process(
        instance=instance,
        partition_key=request.partition_key,
        tags=dict(request.tags),
        raise_on_error=False,
    )
    return bool(result.success)


def shards_of(request: RunRequest, order: list[str]) -> list[str]:
    """The shards a run request covers (one partition, or a range in the partition order)."""
    if request.partition_key is not None:
        return [request.partition_key]
    start, end = order.index(request.tags[RANGE_START]), order.index(request.tags[RANGE_END])
    return order[start : end + 1]


def write_burst(source: Path) -> dict[str, Path]:
    """Issue 21's burst: a shard with 3 bad lines, an empty one, a truncated ``.gz``."""
    template = (source / "part-00000.jsonl").read_bytes()
    bad = source / "bad-00000.jsonl"
    bad.write_bytes(template + b'{"text": "unterminated\n{"title": "no text"}\n{"text": 7}\n')
    empty = source / "empty-00000.jsonl"
    empty.write_bytes(b"")
    trunc = source / "trunc-00000.jsonl.gz"
    whole = gzip.compress(template)
    trunc.write_bytes(whole[: len(whole) // 2])
    return {"bad-00000": bad, "empty-00000": empty, "trunc-00000": trunc}


def latest(instance: DagsterInstance, key: list[str], partition: str | None = None) -> dict:
    """The metadata of an asset's (partition's) latest materialization."""
    found = instance.fetch_materializations(AssetKey(key), limit=100).records
    for record in found:
        if record.partition_key == partition:
            meta = record.asset_materialization.metadata
            return {name: getattr(v, "value", v) for name, v in meta.items()}
    raise AssertionError(f"{key} {partition}: never materialized")


def test_burst_records_the_good_shards_and_the_bad_one_recovers_alone(
    recipe: Recipe, defs: Definitions, instance: DagsterInstance
) -> None:
    ds = recipe.dataset("docs")
    first = tick(defs, instance, None)
    assert all(execute(defs, instance, r) for r in first.run_requests)
    settled = tick(defs, instance, first.cursor)
    assert settled.run_requests == [] and "no new, changed or unrecorded" in str(
        settled.skip_reason
    )

    files = write_burst(Path(ds.source))
    burst = tick(defs, instance, settled.cursor)
    order = instance.get_dynamic_partitions(partitions_name("docs"))
    [run] = burst.run_requests  # one range run over the three new shards
    assert shards_of(run, order) == BURST
    assert not execute(defs, instance, run)  # the truncated .gz fails ...
    # ... alone: its neighbours are recorded with their own numbers
    bad = latest(instance, ["docs", "raw_jsonl"], "bad-00000")
    assert (bad["documents"], bad["quarantined"], bad["empty_shard"]) == (10, 3, False)
    assert bad["path"].endswith("bad-00000.stats.json")
    empty = latest(instance, ["docs", "raw_jsonl"], "empty-00000")
    assert (empty["documents"], empty["empty_shard"]) == (0, True)

    # The next tick requests the two recorded-but-not-tokenized shards, not the failed one,
    # which waits for its file to change (said on the tick).
    again = tick(defs, instance, burst.cursor)
    [retry] = again.run_requests
    assert shards_of(retry, order) == ["bad-00000", "empty-00000"]
    assert execute(defs, instance, retry)
    fingerprints = {k: s.fingerprint for k, s in list_shards(ds).shards.items()}
    done = current_shards(instance, ds, fingerprints)
    assert set(order) - done == {"trunc-00000"}
    waiting = tick(defs, instance, again.cursor)
    assert waiting.run_requests == []
    assert "trunc-00000 failed" in str(waiting.skip_reason)
    assert "runs again once its file changes" in str(waiting.skip_reason)

    # The merge does not wait for it: it builds from the complete shards and names the rest.
    merge = defs.resolve_job_def("docs_merge_job").execute_in_process(
        instance=instance, raise_on_error=False
    )  # its blend fails: code was never built in this test
    merged = latest(instance, ["docs", "merged"])
    assert merged["shards"] == len(order) - 1 and merged["documents"] == 50
    assert list(merged[LEFT_OUT]) == ["trunc-00000"]
    assert merged[LEFT_OUT]["trunc-00000"].startswith("failed: ")
    [left] = [e for e in merge.get_asset_check_evaluations() if e.check_name == "shards_left_out"]
    assert not left.passed and left.severity.value == "WARN"
    assert json.loads(json.dumps(left.metadata["left_out"].value)) == ["trunc-00000"]

    # Fixed: the sensor runs it with no manual step, and it is current.
    whole = (Path(ds.source) / "part-00001.jsonl").read_bytes()
    files["trunc-00000"].write_bytes(gzip.compress(whole))
    os.utime(files["trunc-00000"], ns=(5, 6))
    fixed = tick(defs, instance, waiting.cursor)
    [last] = fixed.run_requests
    assert shards_of(last, order) == ["trunc-00000"]
    assert execute(defs, instance, last)
    fingerprints = {k: s.fingerprint for k, s in list_shards(ds).shards.items()}
    assert current_shards(instance, ds, fingerprints) == set(order)
    assert tick(defs, instance, fixed.cursor).run_requests == []
