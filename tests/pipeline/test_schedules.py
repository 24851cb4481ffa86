"""Schedules: cron from the recipe; reprocessing asks for one run per current shard; the
weekly reprocess and the nightly refresh skip while the other is queued or running."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable

import pytest
from dagster import (
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    Definitions,
    RunRequest,
    SkipReason,
    build_schedule_context,
    instance_for_test,
)

from assets.support.partitions import partitions_name
from pipelines.build import build_definitions
from pipelines.jobs import REFRESH_JOB
from pipelines.runguard import (
    LEASE_TAG,
    PROCESS_TAG,
    fail_interrupted_runs,
    lease_tags,
    process_tag,
    run_lease,
)
from tokenmill.recipe import Recipe

WHEN = dt.datetime(2026, 1, 4, 2, 0, tzinfo=dt.UTC)


@pytest.fixture
def instance() -> DagsterInstance:
    """Schedule contexts need a persistent instance (they pass it by reference)."""
    with instance_for_test() as inst:
        yield inst


def test_reprocess_one_run_per_current_shard(defs: Definitions, instance: DagsterInstance) -> None:
    schedule = defs.resolve_schedule_def("code_reprocess")
    assert schedule.cron_schedule == "0 2 * * 0" and schedule.job_name == "code_shard_job"
    repository = defs.get_repository_def()
    with build_schedule_context(instance, WHEN, repository_def=repository) as context:
        assert isinstance(schedule.evaluate_tick(context).skip_message, str)
    # A registered shard that is no longer in the source is not asked for.
    instance.add_dynamic_partitions(partitions_name("code"), ["part-00000", "part-00001", "gone"])
    with build_schedule_context(instance, WHEN, repository_def=repository) as context:
        requests = schedule.evaluate_tick(context).run_requests
    assert [r.partition_key for r in requests] == ["part-00000", "part-00001"]
    assert requests[0].run_key == f"reprocess:part-00000:{WHEN.isoformat()}"
    assert requests[0].tags["tokenmill/reprocess"] == "1"


def test_refresh_schedule_and_disabled_schedules(
    defs: Definitions, instance: DagsterInstance, make_recipe: Callable[..., Recipe]
) -> None:
    refresh = defs.resolve_schedule_def("nightly_refresh")
    assert (refresh.cron_schedule, refresh.job_name) == ("0 3 * * *", "refresh_job")
    repository = defs.get_repository_def()
    with build_schedule_context(instance, WHEN, repository_def=repository) as ctx:
        [request] = refresh.evaluate_tick(ctx).run_requests
    assert isinstance(request, RunRequest) and request.partition_key is None
    quiet = build_definitions(make_recipe(schedules={"reprocess": None, "refresh": "15 4 * * *"}))
    names = {s.name for s in quiet.schedules or []}
    assert names == {"nightly_refresh"}


def test_skip_reason_names_the_source(defs: Definitions, instance: DagsterInstance) -> None:
    schedule = defs.resolve_schedule_def("docs_reprocess")
    with build_schedule_context(instance=instance, scheduled_execution_time=WHEN) as context:
        result = schedule(context)
    assert isinstance(result, SkipReason) and "docs: no registered shards" in result.skip_message


def _run(instance: DagsterInstance, job: str, status: DagsterRunStatus, **tags: str) -> None:
    """Record a run of ``job`` in ``status`` (what the daemon would have launched)."""
    instance.add_run(DagsterRun(job_name=job, status=status, tags=tags))


# (A QUEUED run needs a code-location origin to be recorded; QUEUED is in the same filter.)
@pytest.mark.parametrize("status", [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED])
def test_reprocess_and_refresh_never_overlap(
    defs: Definitions, instance: DagsterInstance, status: DagsterRunStatus
) -> None:
    """A queued or running refresh makes the reprocess skip, naming it, and the other way
    round; finished runs of either hold nothing back."""
    repository = defs.get_repository_def()
    reprocess = defs.resolve_schedule_def("code_reprocess")
    refresh = defs.resolve_schedule_def("nightly_refresh")
    instance.add_dynamic_partitions(partitions_name("code"), ["part-00000"])

    def tick(schedule_name: str) -> tuple[int, str | None]:
        schedule = reprocess if schedule_name == "reprocess" else refresh
        with build_schedule_context(instance, WHEN, repository_def=repository) as context:
            result = schedule.evaluate_tick(context)
        return len(result.run_requests or []), result.skip_message

    _run(instance, REFRESH_JOB, DagsterRunStatus.SUCCESS)
    _run(instance, "code_shard_job", DagsterRunStatus.FAILURE, **{"tokenmill/reprocess": "1"})
    assert tick("reprocess") == (1, None) and tick("refresh") == (1, None)

    _run(instance, REFRESH_JOB, status)
    count, reason = tick("reprocess")
    assert count == 0 and reason is not None
    assert f"code: 1 {REFRESH_JOB} run(s) queued or in progress" in reason
    assert tick("refresh") == (1, None)  # a refresh does not hold back another refresh tick

    with instance_for_test() as other:
        _run(other, "docs_shard_job", status, **{"tokenmill/reprocess": "1"})
        _run(other, "docs_shard_job", status)  # a sensor's shard run is no reprocess
        with build_schedule_context(other, WHEN, repository_def=repository) as context:
            result = refresh.evaluate_tick(context)
        assert not result.run_requests
        assert result.skip_message is not None
        assert result.skip_message.startswith("1 reprocess run(s) queued or in progress")


def test_a_run_of_a_vanished_host_is_failed_once_its_lease_expires(
    defs: Definitions, instance: DagsterInstance
) -> None:
    """Issue 21: a ``materialize`` run on another host that died (killed, lost machine) stayed
    STARTED forever, since only this host's pids can be checked; the reprocess schedule then
    skipped every tick. Its lease now expires and the run is marked failed and not counted."""
    repository = defs.get_repository_def()
    schedule = defs.resolve_schedule_def("nightly_refresh")
    elsewhere = {PROCESS_TAG: "other-host/boot/4242/99", "tokenmill/reprocess": "1"}
    now = time.time()
    alive = DagsterRun(
        job_name="code_shard_job",
        status=DagsterRunStatus.STARTED,
        tags={**elsewhere, **lease_tags(60, now)},
    )
    dead = DagsterRun(
        job_name="code_shard_job",
        status=DagsterRunStatus.STARTED,
        tags={**elsewhere, **lease_tags(-1, now)},
    )
    instance.add_run(alive)
    assert fail_interrupted_runs(instance) == []  # another host's live lease: still running
    instance.add_run(dead)
    with build_schedule_context(instance, WHEN, repository_def=repository) as context:
        result = schedule.evaluate_tick(context)
    assert result.skip_message.startswith("1 reprocess run(s) queued or in progress")  # alive
    run = instance.get_run_by_id(dead.run_id)
    assert run is not None and run.status == DagsterRunStatus.FAILURE
    [failure] = [
        r.event_log_entry.dagster_event.message
        for r in instance.get_records_for_run(dead.run_id).records
        if r.event_log_entry.dagster_event and r.event_log_entry.dagster_event.is_run_failure
    ]
    assert "other-host/boot/4242/99) stopped renewing its lease" in str(failure)
    assert fail_interrupted_runs(instance, now=now + 61) == [alive.run_id]  # it lapsed too
    with build_schedule_context(instance, WHEN, repository_def=repository) as context:
        assert len(schedule.evaluate_tick(context).run_requests or []) == 1


def test_the_lease_is_renewed_while_the_block_runs(instance: DagsterInstance) -> None:
    """A run carries the lease ``run_lease`` gives; the process renews it while it runs, and
    stops renewing when the block ends."""
    with run_lease(instance, seconds=0.5) as tags:
        assert tags[PROCESS_TAG] == process_tag()
        run = DagsterRun(job_name=REFRESH_JOB, status=DagsterRunStatus.STARTED, tags=tags)
        instance.add_run(run)
        deadline = time.monotonic() + 30
        while instance.get_run_by_id(run.run_id).tags[LEASE_TAG] == tags[LEASE_TAG]:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
    renewed = instance.get_run_by_id(run.run_id).tags[LEASE_TAG]  # type: ignore[union-attr]
    time.sleep(0.3)
    assert instance.get_run_by_id(run.run_id).tags[LEASE_TAG] == renewed  # type: ignore[union-attr]
    assert fail_interrupted_runs(instance) == []  # this host: its process is alive
