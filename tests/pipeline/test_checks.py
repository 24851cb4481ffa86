"""Asset checks pass on good artifacts; a bad artifact fails its check and holds back what
comes after it: inside the run (blocking) and across runs (automation, tokenmill materialize)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dagster import DagsterInstance, Definitions, evaluate_automation_conditions

import assets.raw
import assets.tokenized
from assets.checks import index_problems
from assets.support.complete import complete_shards
from assets.support.partitions import partitions_name
from pipelines.materialize import materialize_recipe
from pipelines.sensors import RANGE_END, RANGE_START
from pipelines.summary import run_failures
from tokenmill.indices.nanoset import NanosetIndex
from tokenmill.recipe import Recipe
from tokenmill.storage import layout

SHARD = "part-00000"


@pytest.fixture
def built(recipe: Recipe, instance: DagsterInstance) -> DagsterInstance:
    """Everything materialized once."""
    assert materialize_recipe(recipe, instance) == 0
    return instance


def run_shard(defs: Definitions, instance: DagsterInstance, ds: str, key: str) -> Any:
    job = defs.resolve_job_def(f"{ds}_shard_job")
    return job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)


def test_every_check_passes_on_good_artifacts(defs: Definitions, built: DagsterInstance) -> None:
    shard = run_shard(defs, built, "docs", "extra-00000")
    refresh = defs.resolve_job_def("refresh_job").execute_in_process(instance=built)
    evaluations = [*shard.get_asset_check_evaluations(), *refresh.get_asset_check_evaluations()]
    assert {e.check_name: e.passed for e in evaluations} == {
        "documents_accounted": True,
        "not_empty": True,
        "rows_match_raw": True,
        "idx_bin_consistent": True,
        "documents_match_export": True,
        "sum_of_shards": True,
        "quarantine_share": True,
        "shards_left_out": True,
        "index_bounds": True,
        "proportions": True,
    }


def test_failed_raw_check_blocks_the_rest_of_the_shard_run(
    defs: Definitions, instance: DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = assets.raw.write_record

    def miscounting(path: Path, record: dict[str, Any]) -> None:
        real(path, {**record, "documents": record["documents"] + 1})

    monkeypatch.setattr(assets.raw, "write_record", miscounting)
    instance.add_dynamic_partitions(partitions_name("code"), [SHARD])
    result = run_shard(defs, instance, "code", SHARD)
    assert not result.success
    evaluations = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert evaluations["documents_accounted"] is False
    done = {e.asset_key.path[-1] for e in result.get_asset_materialization_events()}
    assert done == {"raw_jsonl"}  # hf_dataset and tokens never ran


def test_a_range_run_records_each_shards_check_on_its_partition(
    defs: Definitions, instance: DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 21: a range's check results used to be recorded with no partition, so every
    partition the run planned was listed "Skipped" while the check's latest result said
    "Passed". Each shard now has its own evaluation (the one that failed, failed), beside the
    range's, and ``materialize`` reports the range's one line only."""
    real = assets.raw.write_record

    def miscounting(path: Path, record: dict[str, Any]) -> None:
        bad = "part-00001" in path.name
        real(path, {**record, "documents": record["documents"] + bad})

    monkeypatch.setattr(assets.raw, "write_record", miscounting)
    keys = ["part-00000", "part-00001"]
    instance.add_dynamic_partitions(partitions_name("code"), keys)
    result = defs.resolve_job_def("code_shard_job").execute_in_process(
        instance=instance, tags={RANGE_START: keys[0], RANGE_END: keys[-1]}, raise_on_error=False
    )
    evaluations = [e for e in result.get_asset_check_evaluations() if e.partition]
    by_check: dict[str, dict[str, bool]] = {}
    for e in evaluations:
        by_check.setdefault(e.check_name, {})[str(e.partition)] = e.passed
    assert by_check == {
        "documents_accounted": {"part-00000": True, "part-00001": False},
        "not_empty": {"part-00000": True, "part-00001": True},
    }
    ranges = {e.check_name: e for e in result.get_asset_check_evaluations() if not e.partition}
    assert ranges["not_empty"].passed and not ranges["documents_accounted"].passed
    assert ranges["documents_accounted"].metadata["failed_shards"].value == ["part-00001"]
    [failure] = run_failures(result)
    assert failure.shard == "part-00001" and "documents_accounted" in failure.where


def test_corrupted_shard_fails_its_check_and_holds_back_downstream(
    recipe: Recipe,
    defs: Definitions,
    built: DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cursor = evaluate_automation_conditions(defs=defs, instance=built).cursor
    real = assets.tokenized.tokenize_files

    def corrupting(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        data = bytearray(result.prefix.with_suffix(".bin").read_bytes())
        data[0] ^= 0xFF  # a flipped bit on the way to disk
        result.prefix.with_suffix(".bin").write_bytes(bytes(data))
        return result

    monkeypatch.setattr(assets.tokenized, "tokenize_files", corrupting)
    source = Path(recipe.dataset("code").source)
    (source / "part-00002.jsonl").write_text(json.dumps({"text": "new shard " * 50}) + "\n")
    built.add_dynamic_partitions(partitions_name("code"), ["part-00002"])
    result = run_shard(defs, built, "code", "part-00002")
    failed = {e.check_name for e in result.get_asset_check_evaluations() if not e.passed}
    assert not result.success and failed == {"idx_bin_consistent"}
    evaluation = evaluate_automation_conditions(defs=defs, instance=built, cursor=cursor)
    requested = {r.key.to_user_string() for r in evaluation.results if r.true_subset.size}
    assert requested <= {"code/dataset_info", "code/merged"}  # nothing after the merge ...
    ds = recipe.dataset("code")
    tokens = Path(recipe.storage.root) / layout.tokens_prefix("code", "part-00002", "text")
    complete, left_out = complete_shards(built, ds, {"part-00002": tokens})
    assert "part-00002" not in complete  # ... whose merge leaves the failed shard out
    assert left_out["part-00002"].startswith("tokens not verified")

    assert materialize_recipe(recipe, built) == 1  # the CLI retries the shard: fails again
    out = capsys.readouterr().out
    assert "code/part-00002: FAILED" in out and "downstream: everything up to date" in out

    monkeypatch.setattr(assets.tokenized, "tokenize_files", real)
    assert run_shard(defs, built, "code", "part-00002").success
    evaluation = evaluate_automation_conditions(
        defs=defs,
        instance=built,
        cursor=evaluation.cursor,
        evaluation_time=dt.datetime.now(dt.UTC) + dt.timedelta(minutes=6),  # the next interval
    )
    # the fixed shard landed after the merge was requested, and still counts; then, a tick
    # later each, its indices and the blend
    assert {r.key.to_user_string() for r in evaluation.results if r.true_subset.size} - {
        "code/dataset_info"
    } == {"code/merged"}


def test_index_bounds_finds_out_of_range_values() -> None:
    lengths = np.array([5, 5, 5, 5], dtype=np.int32)

    def index(document: list[int], sample: list[list[int]], shuffle: list[int]) -> NanosetIndex:
        arrays = [np.array(document), np.array(sample), np.array(shuffle)]
        return NanosetIndex("train", "h", {}, *arrays, paths={})

    good = index([0, 1, 2], [[0, 0], [1, 2], [2, 4]], [1, 0])
    assert index_problems(good, lengths, (0, 3)) == []
    bad = index([0, 3, 2], [[0, 0], [1, 9], [3, 0]], [2, 0])
    assert index_problems(bad, lengths, (0, 3)) == [
        "train: document_index outside the split's documents [0, 3)",
        "train: sample_index points outside document_index",
        "train: shuffle_index outside [0, 2)",
    ]
