"""One bad shard never costs its neighbours, and recovers alone (issues 20 and 21).

Driven as the daemons drive it: the shard sensor's ticks (``build_sensor_context``), their runs
executed as launched, and the merge job; nothing is run by hand that the daemon would not run.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
from collections.abc import Callable
from pathlib import Path

from dagster import (
    AssetKey,
    DagsterInstance,
    Definitions,
    RunRequest,
    SensorResult,
    build_sensor_context,
    evaluate_automation_conditions,
)
from in_process import apply, execute
from in_process import tick as sensor_tick

from assets.support.complete import LEFT_OUT
from assets.support.partitions import partitions_name
from assets.support.sources import list_shards
from assets.support.staleness import current_shards, recorded_version
from pipelines.build import build_definitions
from pipelines.sensors import RANGE_END, RANGE_START, RECIPE_SENSOR
from tokenmill.recipe import Recipe

BURST = ["bad-00000", "empty-00000", "trunc-00000"]


def tick(
    defs: Definitions, instance: DagsterInstance, cursor: str | None, name: str = "docs"
) -> SensorResult:
    """One tick of a shard sensor, its partition requests applied as the daemon does."""
    result = sensor_tick(defs, instance, cursor, name)
    apply(instance, result)
    return result


class Automation:
    """The automation sensor's ticks, a minute apart, and what each requests executed as one
    run (as the daemon launches it); each call starts at the next 5-minute interval (the
    default ``refresh_interval_minutes``) and ticks until a tick requests nothing."""

    def __init__(self, defs: Definitions, instance: DagsterInstance) -> None:
        self.defs, self.instance, self.cursor = defs, instance, None
        now = dt.datetime.now(dt.UTC).replace(second=30, microsecond=0)
        self.time = now.replace(minute=now.minute - now.minute % 5)

    def __call__(self) -> set[AssetKey]:
        self.time = self.time.replace(minute=self.time.minute - self.time.minute % 5)
        self.time += dt.timedelta(minutes=5)
        seen: set[AssetKey] = set()
        for _ in range(8):
            result = evaluate_automation_conditions(
                defs=self.defs,
                instance=self.instance,
                cursor=self.cursor,
                evaluation_time=self.time,
            )
            self.cursor = result.cursor
            self.time += dt.timedelta(minutes=1)
            keys = {r.key for r in result.results if r.true_subset.size}
            if not keys:
                return seen
            seen |= keys
            job = self.defs.resolve_implicit_global_asset_job_def()
            job.execute_in_process(
                instance=self.instance, asset_selection=sorted(keys), raise_on_error=False
            )
        raise AssertionError("automation never settled")


def settle(defs: Definitions, instance: DagsterInstance, cursors: dict[str, str | None]) -> None:
    """Tick both shard sensors and run what they ask, until they ask for nothing."""
    for _ in range(4):
        ran = False
        for name in ("docs", "code"):
            result = tick(defs, instance, cursors.get(name), name)
            cursors[name] = result.cursor
            for request in result.run_requests:
                execute(defs, instance, request)
                ran = True
        if not ran:
            return
    raise AssertionError("the shard sensors never settled")


def shards_of(request: RunRequest, order: list[str]) -> list[str]:
    """The shards a run request covers (one partition, or a range in the partition order)."""
    if request.partition_key is not None:
        return [request.partition_key]
    start, end = order.index(request.tags[RANGE_START]), order.index(request.tags[RANGE_END])
    return order[start : end + 1]


def truncated_gzip(source: Path, name: str = "trunc-00000", cut: int = 2) -> Path:
    """A ``.jsonl.gz`` shard cut short (``1/cut`` of its bytes): unreadable, so it fails."""
    whole = gzip.compress((source / "part-00000.jsonl").read_bytes())
    path = source / f"{name}.jsonl.gz"
    path.write_bytes(whole[: len(whole) // cut])
    return path


def write_burst(source: Path) -> dict[str, Path]:
    """Issue 21's burst: a shard with 3 bad lines, an empty one, a truncated ``.gz``."""
    template = (source / "part-00000.jsonl").read_bytes()
    bad = source / "bad-00000.jsonl"
    bad.write_bytes(template + b'{"text": "unterminated\n{"title": "no text"}\n{"text": 7}\n')
    empty = source / "empty-00000.jsonl"
    empty.write_bytes(b"")
    return {"bad-00000": bad, "empty-00000": empty, "trunc-00000": truncated_gzip(source)}


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
    cursors: dict[str, str | None] = {}
    settle(defs, instance, cursors)
    automation = Automation(defs, instance)
    assert AssetKey(["blend", "mix"]) in automation()
    settled = tick(defs, instance, cursors["docs"])
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

    # The nightly refresh does not wait for it: the merge builds from the complete shards and
    # names the rest, and everything after it is built.
    merge = defs.resolve_job_def("refresh_job").execute_in_process(instance=instance)
    assert merge.success
    merged = latest(instance, ["docs", "merged"])
    assert merged["shards"] == len(order) - 1 and merged["documents"] == 50
    assert list(merged[LEFT_OUT]) == ["trunc-00000"]
    assert merged[LEFT_OUT]["trunc-00000"].startswith("failed: ")
    [left] = [
        e
        for e in merge.get_asset_check_evaluations()
        if e.check_name == "shards_left_out" and e.asset_key == AssetKey(["docs", "merged"])
    ]
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
    # ... and automation brings it into the merge and the blend
    assert AssetKey(["blend", "mix"]) in automation()
    assert latest(instance, ["docs", "merged"])[LEFT_OUT] == {}


def test_trickle_keeps_the_blend_advancing_while_one_shard_keeps_failing(
    recipe: Recipe, defs: Definitions, instance: DagsterInstance
) -> None:
    """A new docs shard every automation interval, and the broken shard rewritten (still
    broken) each time: the blend gets a new data version at every interval, each from the
    complete shards, the failing one named as left out."""
    source = Path(recipe.dataset("docs").source)
    truncated_gzip(source)
    cursors: dict[str, str | None] = {}
    settle(defs, instance, cursors)
    automation = Automation(defs, instance)
    assert AssetKey(["blend", "mix"]) in automation()
    versions = [recorded_version(instance, AssetKey(["blend", "mix"]))]
    assert versions[0] is not None
    template = (source / "part-00001.jsonl").read_bytes()
    for i in range(3):
        more = source / f"more-{i:05d}.jsonl"
        more.write_bytes(template + json.dumps({"text": f"shard {i}"}).encode() + b"\n")
        truncated_gzip(source, cut=3 + i)  # a new file, still broken: tried again, fails again
        settle(defs, instance, cursors)
        assert AssetKey(["blend", "mix"]) in automation()
        versions.append(recorded_version(instance, AssetKey(["blend", "mix"])))
        merged = latest(instance, ["docs", "merged"])
        assert list(merged[LEFT_OUT]) == ["trunc-00000"]
        assert merged["shards"] == 5 + i  # extra, part-0..2 and the new ones
    assert len(set(versions)) == 4  # the blend advanced at every interval
    assert automation() == set()  # nothing new: nothing to do


def test_recipe_weight_edit_rebuilds_the_blend_through_automation_alone(
    make_recipe: Callable[..., Recipe], instance: DagsterInstance
) -> None:
    """The running definitions keep the recipe they loaded; the recipe sensor reads the file
    at each tick, sees the blend's weights changed, and asks for the blend alone; the run
    (which loads the code location afresh, here: definitions of the edited file) rebuilds it."""
    recipe = make_recipe()
    running = build_definitions(recipe)
    cursors: dict[str, str | None] = {}
    settle(running, instance, cursors)
    Automation(running, instance)()
    blend = AssetKey(["blend", "mix"])
    before = latest(instance, ["blend", "mix"])
    assert before["weights"]["weights"] == {"docs": 0.7, "code": 0.3}

    def recipe_tick() -> SensorResult:
        sensor = running.resolve_sensor_def(RECIPE_SENSOR)
        with build_sensor_context(instance=instance, definitions=running) as context:
            result = sensor(context)
        assert isinstance(result, SensorResult)
        return result

    assert "matches the recipe" in str(recipe_tick().skip_reason)
    edited = make_recipe(blends={"mix": {"weights": {"docs": 0.6, "code": 0.4}}})
    [request] = recipe_tick().run_requests
    assert list(request.asset_selection or []) == [blend]  # the indices did not change
    assert execute(build_definitions(edited), instance, request)
    after = latest(instance, ["blend", "mix"])
    assert after["weights"]["weights"] == {"docs": 0.6, "code": 0.4}
    assert after["version"] != before["version"]
    assert "matches the recipe" in str(recipe_tick().skip_reason)  # done: not asked again

    Path(edited.path).write_text(Path(edited.path).read_text() + "bogus: 1\n")
    assert "recipe not applied" in str(recipe_tick().skip_reason)
