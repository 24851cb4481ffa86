"""Shard sensors: new, changed and vanished shards, through the pure planner and the sensor;
runs over ranges of consecutive shards (one run per up to 16 shards), executed as Dagster
executes a range run, recognized as done by the next tick."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dagster import AssetKey, DagsterInstance, Definitions
from in_process import apply, execute, tick

from assets.shards import PARTITIONS_PER_BACKFILL_RUN
from assets.support.partitions import partitions_name
from assets.support.sources import Listing, ShardFile, diff_listing, find_shard, list_shards
from assets.support.staleness import current_shards
from pipelines.sensors import (
    AUTOMATION_SENSOR,
    RANGE_END,
    RANGE_START,
    plan_recipe,
    plan_tick,
    range_run_key,
    shard_ranges,
)
from tokenmill.errors import InputError
from tokenmill.recipe import Recipe


def listing(**fingerprints: str) -> Listing:
    return Listing({k: ShardFile(k, Path(f"/src/{k}.jsonl"), v) for k, v in fingerprints.items()})


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
    # registered shards with nothing recorded run again (if still listed), with a message
    retry = plan_tick(plan.cursor, listing(b="2", c="1"), {"b", "c"}, unrecorded=["c", "x"])
    assert retry.run == ["c"] and any("requested again: ['c']" in m for m in retry.messages)
    refused = Listing(listing(b="2").shards, rejected=["/src/b.jsonl.gz: shard name 'b' is taken"])
    assert plan_tick(None, refused, set()).messages[0].startswith("refused: /src/b.jsonl.gz")


def test_recipe_plan_rebuilds_what_was_built_with_other_settings() -> None:
    blend, nanoset = AssetKey(["blend", "mix"]), AssetKey(["docs", "nanoset"])
    new = AssetKey(["blend", "hot"])
    loaded = {nanoset: "n1", blend: "b1"}
    plan = plan_recipe(loaded, {nanoset: "n1", blend: "b2"}, {nanoset: "n1", blend: "b1"})
    assert plan.rebuild == [blend]
    assert plan.messages == ["recipe settings changed: rebuilding ['blend/mix']"]
    assert plan.run_key({nanoset: "n1", blend: "b2"}) == plan.run_key({blend: "b2"})
    assert plan_recipe(loaded, loaded, {nanoset: "n1", blend: None}).rebuild == []  # never built
    grown = plan_recipe(loaded, {**loaded, new: "h"}, {nanoset: "n1", blend: "b1"})
    assert grown.rebuild == [] and "adds ['blend/hot']" in grown.messages[0]
    assert "reload the code location" in grown.messages[0]


def test_refused_files_show_on_the_tick(
    recipe: Recipe, defs: Definitions, instance: DagsterInstance
) -> None:
    """``x.jsonl`` beside ``x.jsonl.gz``: refused, and the tick's skip reason says so."""
    first = tick(defs, instance, None)
    apply(instance, first)
    assert execute(defs, instance, first.run_requests[0])
    source = Path(recipe.dataset("docs").source)
    (source / "part-00000.jsonl.gz").write_bytes(b"")
    result = tick(defs, instance, first.cursor)
    assert result.run_requests == []
    assert "refused:" in str(result.skip_reason)
    assert "part-00000.jsonl.gz: shard name 'part-00000' is taken by part-00000.jsonl" in str(
        result.skip_reason
    )


def test_shard_ranges_follow_the_partition_order() -> None:
    order = [f"s{i:03d}" for i in range(40)]
    assert shard_ranges(order, order) == [order[:16], order[16:32], order[32:]]
    assert shard_ranges(order, ["s005", "s001", "s002", "s009"]) == [
        ["s001", "s002"],
        ["s005"],
        ["s009"],
    ]
    # a range spans every partition between its ends, so gaps in the order cut ranges
    assert shard_ranges(["b", "a", "c"], ["a", "b", "c"]) == [["b", "a", "c"]]
    assert shard_ranges(["b", "x", "a"], ["a", "b"]) == [["b"], ["a"]]
    assert shard_ranges(order, order[:5], size=2) == [order[0:2], order[2:4], order[4:5]]
    assert shard_ranges(order, []) == []


def test_range_run_keys_are_deterministic() -> None:
    one = range_run_key({"a": "1"})
    assert one == "a:1"
    key = range_run_key({"a": "1", "b": "2"})
    assert key.startswith("a..b:") and key == range_run_key({"a": "1", "b": "2"})
    assert key != range_run_key({"a": "1", "b": "3"})  # a changed shard is new work


def test_sensor_new_changed_vanished(
    recipe: Recipe, defs: Definitions, instance: DagsterInstance
) -> None:
    first = tick(defs, instance, None)
    shards = ["extra-00000", "part-00000", "part-00001", "part-00002"]
    [add] = first.dynamic_partitions_requests
    assert add.partitions_def_name == partitions_name("docs") and list(add.partition_keys) == shards
    source = list_shards(recipe.dataset("docs")).shards
    fingerprints = {k: source[k].fingerprint for k in shards}
    [run] = first.run_requests  # four new shards: one run over their range
    assert (run.job_name, run.partition_key) == ("docs_shard_job", None)
    assert run.run_key == range_run_key(fingerprints)
    assert (run.tags[RANGE_START], run.tags[RANGE_END]) == (shards[0], shards[-1])
    apply(instance, first)
    # not run yet, so still unrecorded: asked for again with the same run key, which the
    # sensor daemon never launches twice
    [same] = tick(defs, instance, first.cursor).run_requests
    assert same.run_key == run.run_key

    assert execute(defs, instance, run)
    assert current_shards(instance, recipe.dataset("docs"), fingerprints) == set(shards)
    # a lost cursor: every shard looks new, but each is done at its fingerprint
    assert tick(defs, instance, None).run_requests == []

    changed = source["part-00001"].path
    changed.write_bytes(changed.read_bytes() + b'{"text": "one more"}\n')
    os.utime(changed, ns=(1, 2))
    source["part-00002"].path.unlink()
    second = tick(defs, instance, first.cursor)
    runs = {(r.job_name, r.partition_key) for r in second.run_requests}
    assert runs == {("docs_shard_job", "part-00001"), ("docs_merge_job", None)}
    single = next(r for r in second.run_requests if r.job_name == "docs_shard_job")
    new_fp = list_shards(recipe.dataset("docs")).shards["part-00001"].fingerprint
    assert single.run_key == f"part-00001:{new_fp}"
    assert single.tags["tokenmill/source_fingerprint"] == new_fp
    merge = next(r for r in second.run_requests if r.job_name == "docs_merge_job")
    assert merge.run_key == f"vanished:part-00002@{source['part-00002'].fingerprint}"
    [delete] = second.dynamic_partitions_requests
    assert list(delete.partition_keys) == ["part-00002"]
    apply(instance, second)
    assert instance.get_dynamic_partitions(partitions_name("docs")) == shards[:3]
    assert "part-00002" not in json.loads(second.cursor)
    assert execute(defs, instance, single)
    done = current_shards(instance, recipe.dataset("docs"), {"part-00001": new_fp})
    assert done == {"part-00001"}


def test_burst_of_new_shards_runs_in_ranges_of_sixteen(
    recipe: Recipe, defs: Definitions, instance: DagsterInstance
) -> None:
    """40 new shards (4 already registered, 36 added): ceil(40/16) range runs covering every
    shard once, in the partition order the tick leaves behind."""
    source = Path(recipe.dataset("docs").source)
    template = (source / "part-00000.jsonl").read_bytes()
    for i in range(36):
        (source / f"burst-{i:05d}.jsonl").write_bytes(template + f'{{"text": "{i}"}}\n'.encode())
    instance.add_dynamic_partitions(partitions_name("docs"), ["part-00000", "extra-00000"])
    result = tick(defs, instance, None)
    apply(instance, result)
    order = instance.get_dynamic_partitions(partitions_name("docs"))
    assert order[:2] == ["part-00000", "extra-00000"] and len(order) == 40
    covered = []
    for run in result.run_requests:
        start, end = order.index(run.tags[RANGE_START]), order.index(run.tags[RANGE_END])
        assert end - start + 1 <= PARTITIONS_PER_BACKFILL_RUN
        covered += order[start : end + 1]
    assert len(result.run_requests) == 3 and covered == order
    assert len({r.run_key for r in result.run_requests}) == 3
    again = tick(defs, instance, None)  # the same listing: the same run keys
    assert [r.run_key for r in again.run_requests] == [r.run_key for r in result.run_requests]


def test_backfilled_shards_are_current_for_sensors(
    recipe: Recipe, defs: Definitions, instance: DagsterInstance
) -> None:
    """A backfill range run carries no fingerprints: its steps record the source they read, so
    the sensor (and ``materialize``) do not run those shards again."""
    first = tick(defs, instance, None)
    apply(instance, first)
    order = instance.get_dynamic_partitions(partitions_name("docs"))
    backfill = defs.resolve_job_def("docs_shard_job").execute_in_process(
        instance=instance, tags={RANGE_START: order[0], RANGE_END: order[-1]}
    )
    assert backfill.success
    source = list_shards(recipe.dataset("docs")).shards
    fingerprints = {k: s.fingerprint for k, s in source.items()}
    assert current_shards(instance, recipe.dataset("docs"), fingerprints) == set(order)
    assert tick(defs, instance, None).run_requests == []  # even with the cursor lost
    # ... and an edited shard is the one shard that is not current any more
    path = source["part-00001"].path
    path.write_bytes(path.read_bytes() + b'{"text": "edited"}\n')
    os.utime(path, ns=(3, 4))
    [run] = tick(defs, instance, first.cursor).run_requests
    assert run.partition_key == "part-00001"


def test_automation_sensor_starts_running(defs: Definitions) -> None:
    sensor = defs.resolve_sensor_def(AUTOMATION_SENSOR)
    assert sensor.default_status.value == "RUNNING"
    assert defs.resolve_sensor_def("code_shard_sensor").default_status.value == "RUNNING"


def test_a_shard_is_found_without_listing_the_source(
    recipe: Recipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = recipe.dataset("docs")
    listed = list_shards(ds).shards

    def no_listing(self: Path) -> None:
        raise AssertionError(f"{self} listed")

    monkeypatch.setattr(Path, "iterdir", no_listing)
    assert find_shard(ds, "part-00001") == listed["part-00001"]
    with pytest.raises(InputError, match="'part-00009' is not in"):
        find_shard(ds, "part-00009")


def test_a_shard_name_too_long_for_its_temp_names_is_refused_at_listing(recipe: Recipe) -> None:
    """A 240-character shard name is a valid file name, but its derived names (with a temp
    suffix) are not: the listing refuses it beside the other refused names, and lists the rest."""
    ds = recipe.dataset("docs")
    before = set(list_shards(ds).shards)
    long = Path(ds.source) / f"{'x' * 240}.jsonl"
    long.write_bytes(b'{"text": "a"}\n')
    listing = list_shards(ds)
    assert set(listing.shards) == before
    assert [r for r in listing.rejected if "the name is too long" in r] == [
        r for r in listing.rejected if str(long) in r
    ]
    assert any(str(long) in r and "the name is too long" in r for r in listing.rejected)
