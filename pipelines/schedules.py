"""Schedules (cron from the recipe): re-process every shard of a dataset, refresh everything
downstream. ``build_schedule_from_partitioned_job`` rejects dynamic partitions, so the
reprocess schedule is a plain ``@schedule`` that asks for one run per current shard.

The weekly reprocess and the nightly refresh never overlap: each skips its tick, with a reason
naming the other, while a run of the other is queued or in progress (a tag concurrency limit
cannot say "not beside the other kind" without also serializing the per-shard reprocess runs).
A run whose ``materialize`` process is gone (killed, out of memory) is marked failed first and
never counts (``pipelines/runguard.py``): a stale run must not skip every tick.
"""

import functools

from dagster import (
    DagsterInstance,
    DagsterRunStatus,
    DefaultScheduleStatus,
    RunRequest,
    RunsFilter,
    ScheduleDefinition,
    ScheduleEvaluationContext,
    SkipReason,
    schedule,
)

from assets.support.partitions import partitions_name
from assets.support.sources import list_shards
from pipelines.jobs import REFRESH_JOB, AssetJob
from pipelines.runguard import fail_interrupted_runs
from pipelines.sensors import shard_tags
from tokenmill.recipe import DatasetConfig

REPROCESS_TAG = "tokenmill/reprocess"
running_schedule = functools.partial(schedule, default_status=DefaultScheduleStatus.RUNNING)
# Runs that hold their slot: waiting in the queue, being launched, or executing.
ACTIVE = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
]
REPROCESS_RUNS = RunsFilter(tags={REPROCESS_TAG: "1"}, statuses=ACTIVE)
REFRESH_RUNS = RunsFilter(job_name=REFRESH_JOB, statuses=ACTIVE)


def busy_runs(instance: DagsterInstance, runs: RunsFilter) -> int:
    """How many ``runs`` are queued or in progress, once the interrupted ones (their process is
    gone) are marked failed."""
    fail_interrupted_runs(instance)
    return len(instance.get_run_records(runs))


def build_reprocess_schedule(
    ds: DatasetConfig, cron: str, job: AssetJob, endpoint_url: str | None = None
) -> ScheduleDefinition:
    """``<ds>_reprocess``: re-validate and re-tokenize every current shard (e.g. after a
    tokenizer change); the downstream assets then follow through automation. ``endpoint_url``
    is the S3 endpoint of an ``s3://`` source."""

    @running_schedule(
        name=f"{ds.name}_reprocess",
        cron_schedule=cron,
        job=job,
        description=f"Re-validate and re-tokenize every shard of {ds.name}.",
    )
    def reprocess(context: ScheduleEvaluationContext) -> list[RunRequest] | SkipReason:
        busy = busy_runs(context.instance, REFRESH_RUNS)
        if busy:
            return SkipReason(
                f"{ds.name}: {busy} {REFRESH_JOB} run(s) queued or in progress; the reprocess "
                "waits for its next tick so the two never overlap"
            )
        registered = set(context.instance.get_dynamic_partitions(partitions_name(ds.name)))
        shards = list_shards(ds, endpoint_url).shards
        keys = sorted(registered & set(shards))
        if not keys:
            return SkipReason(f"{ds.name}: no registered shards present in {ds.source}")
        stamp = context.scheduled_execution_time.isoformat()
        return [
            RunRequest(
                run_key=f"reprocess:{key}:{stamp}",
                partition_key=key,
                tags={
                    **shard_tags(ds.name, key, shards[key].fingerprint),
                    REPROCESS_TAG: "1",
                },
            )
            for key in keys
        ]

    return reprocess


def build_refresh_schedule(cron: str, job: AssetJob) -> ScheduleDefinition:
    """``nightly_refresh``: rebuild every merged dataset, index and blend in one run, unless
    a reprocess run is queued or in progress (its shards would change under the refresh)."""

    @running_schedule(
        name="nightly_refresh",
        cron_schedule=cron,
        job=job,
        description="Rebuild merged datasets, Nanoset indices and blends.",
    )
    def refresh(context: ScheduleEvaluationContext) -> RunRequest | SkipReason:
        busy = busy_runs(context.instance, REPROCESS_RUNS)
        if busy:
            return SkipReason(
                f"{busy} reprocess run(s) queued or in progress; the refresh waits for its next "
                "tick so the two never overlap"
            )
        return RunRequest(run_key=f"refresh:{context.scheduled_execution_time.isoformat()}")

    return refresh
