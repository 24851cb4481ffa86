"""Schedules: cron from the recipe; reprocessing asks for one run per current shard."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import pytest
from dagster import (
    DagsterInstance,
    Definitions,
    RunRequest,
    SkipReason,
    build_schedule_context,
    instance_for_test,
)

from assets.support.partitions import partitions_name
from pipelines.build import build_definitions
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
    defs: Definitions, make_recipe: Callable[..., Recipe]
) -> None:
    refresh = defs.resolve_schedule_def("nightly_refresh")
    assert (refresh.cron_schedule, refresh.job_name) == ("0 3 * * *", "refresh_job")
    repository = defs.get_repository_def()
    with build_schedule_context(scheduled_execution_time=WHEN, repository_def=repository) as ctx:
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
