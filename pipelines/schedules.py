"""Schedules (cron from the recipe): re-process every shard of a dataset, refresh everything
downstream. ``build_schedule_from_partitioned_job`` rejects dynamic partitions, so the
reprocess schedule is a plain ``@schedule`` that asks for one run per current shard.
"""

from dagster import (
    DefaultScheduleStatus,
    RunRequest,
    ScheduleDefinition,
    ScheduleEvaluationContext,
    SkipReason,
    schedule,
)

from assets.support.partitions import partitions_name
from assets.support.sources import list_shards
from pipelines.jobs import AssetJob
from pipelines.sensors import shard_tags
from tokenmill.recipe import DatasetConfig


def build_reprocess_schedule(
    ds: DatasetConfig, cron: str, job: AssetJob, endpoint_url: str | None = None
) -> ScheduleDefinition:
    """``<ds>_reprocess``: re-validate and re-tokenize every current shard (e.g. after a
    tokenizer change); the downstream assets then follow through automation. ``endpoint_url``
    is the S3 endpoint of an ``s3://`` source."""

    @schedule(
        name=f"{ds.name}_reprocess",
        cron_schedule=cron,
        job=job,
        default_status=DefaultScheduleStatus.RUNNING,
        description=f"Re-validate and re-tokenize every shard of {ds.name}.",
    )
    def reprocess(context: ScheduleEvaluationContext) -> list[RunRequest] | SkipReason:
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
                    "tokenmill/reprocess": "1",
                },
            )
            for key in keys
        ]

    return reprocess


def build_refresh_schedule(cron: str, job: AssetJob) -> ScheduleDefinition:
    """``nightly_refresh``: rebuild every merged dataset, index and blend in one run."""
    return ScheduleDefinition(
        name="nightly_refresh",
        cron_schedule=cron,
        job=job,
        default_status=DefaultScheduleStatus.RUNNING,
        description="Rebuild merged datasets, Nanoset indices and blends.",
    )
