"""One writer per pointer on the Dagster side: every unpartitioned asset runs in a pool whose
limit the instance setup makes 1, and a step whose pointer write was refused runs again."""

from __future__ import annotations

import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    DataVersion,
    Failure,
    MaterializeResult,
    build_asset_context,
)

from assets.factory import build_assets
from assets.support.pointers import CONFLICT_TRIES, SINGLE_WRITER_POOLS, rerun_superseded
from pipelines.instance import ensure_pool_limits
from tokenmill.errors import ConflictError
from tokenmill.recipe import Recipe


def test_every_unpartitioned_asset_has_a_single_writer_pool(recipe: Recipe) -> None:
    pools = {a.key: a.op.pool for a in build_assets(recipe)[0]}
    partitioned = {a.key for a in build_assets(recipe)[0] if a.partitions_def is not None}
    assert {k: p for k, p in pools.items() if k not in partitioned} == {
        AssetKey([ds, stage]): f"tokenmill_{stage}"
        for ds in ("docs", "code")
        for stage in ("merged", "pruned", "nanoset", "dataset_info")
    } | {AssetKey(["blend", "mix"]): "tokenmill_blend"}
    assert not {pools[k] for k in partitioned} & set(SINGLE_WRITER_POOLS)


def test_instance_setup_gives_each_pool_one_slot_and_frees_ended_runs_slots() -> None:
    with DagsterInstance.ephemeral() as instance:
        assert ensure_pool_limits(instance) == list(SINGLE_WRITER_POOLS)
        storage = instance.event_log_storage
        assert {p: storage.get_concurrency_info(p).slot_count for p in SINGLE_WRITER_POOLS} == {
            p: 1 for p in SINGLE_WRITER_POOLS
        }
        assert ensure_pool_limits(instance) == []  # already set: nothing changes
        storage.set_concurrency_slots("tokenmill_blend", 3)  # an operator's mistake
        # a slot claimed by a run the instance does not know (it ended, its record is gone)
        claim = storage.claim_concurrency_slot("tokenmill_merged", "gone-run", "merged")
        assert claim.is_claimed
        assert ensure_pool_limits(instance) == ["tokenmill_blend"]
        assert storage.get_concurrency_info("tokenmill_blend").slot_count == 1
        assert storage.get_concurrency_info("tokenmill_merged").claimed_slots == []


def test_a_step_assigned_but_not_claimed_by_a_killed_run_is_freed() -> None:
    """Dagster assigns a pool slot to a waiting step and claims it in two commits; a run killed
    between them leaves an assigned step and no claimed slot, and every later step of the pool
    waited forever (a CI hang after a SIGKILLed ``materialize``)."""
    with DagsterInstance.ephemeral() as instance:
        ensure_pool_limits(instance)
        storage = instance.event_log_storage
        storage.add_pending_step("tokenmill_merged", "killed-run", "merged", should_assign=True)
        assert storage.get_concurrency_info("tokenmill_merged").claimed_slots == []
        assert not storage.claim_concurrency_slot("tokenmill_merged", "next-run", "m").is_claimed
        ensure_pool_limits(instance)  # both runs are unknown to the instance: both are freed
        assert storage.get_concurrency_info("tokenmill_merged").pending_steps == []
        assert storage.claim_concurrency_slot("tokenmill_merged", "next-run", "m").is_claimed


def conflict(n: int) -> ConflictError:
    return ConflictError("merged/docs/current.json", "a" * 64, f"{n}" * 64, "c" * 64)


def test_a_superseded_step_runs_again_and_says_so() -> None:
    calls: list[int] = []

    @rerun_superseded
    def body(context: object) -> MaterializeResult:
        calls.append(1)
        if len(calls) == 1:
            raise conflict(1)
        return MaterializeResult(metadata={"version": "1" * 64}, data_version=DataVersion("v"))

    result = body(build_asset_context())
    assert len(calls) == 2
    assert result.metadata is not None and result.data_version == DataVersion("v")
    assert result.metadata["version"] == "1" * 64
    assert result.metadata["superseded_by"].value == "1" * 64
    assert result.metadata["superseded_version"].value == "c" * 64


def test_a_step_refused_every_time_fails_naming_the_winner() -> None:
    calls: list[int] = []

    @rerun_superseded
    def body(context: object) -> MaterializeResult:
        calls.append(1)
        raise conflict(len(calls))

    with pytest.raises(Failure, match=f"moved {CONFLICT_TRIES} times.*last to {CONFLICT_TRIES}"):
        body(build_asset_context())
    assert len(calls) == CONFLICT_TRIES
