"""Schedules: cron from the recipe; reprocessing asks for one run per current shard; the
weekly reprocess and the nightly refresh skip while the other is queued or running."""

from __future__ import annotations

import datetime as dt
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
