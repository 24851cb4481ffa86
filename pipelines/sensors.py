"""Sensors: one per dataset watching its source for shards, and the automation sensor.

The shard sensor is a plain function (:func:`plan_tick`) diffing the source listing against a
JSON cursor ``{shard: fingerprint}``, wrapped in a sensor returning one ``SensorResult``:

- new shards: added to the partition set, one run each (``run_key`` = shard + fingerprint);
- changed shards (new size/mtime): run again;
- vanished shards: removed from the partition set, reported in the log, and one merge run so
  the merged dataset (and what follows it) drops them; never silently.

Dagster's automation sensor starts stopped; ours starts running so that ``merged``, ``nanoset``
and ``blend/*`` follow new shards without a click.
"""

import json
from dataclasses import dataclass, field

from dagster import (
    AddDynamicPartitionsRequest,
    AssetSelection,
    AutomationConditionSensorDefinition,
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    DeleteDynamicPartitionsRequest,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from pipelines.jobs import AssetJob, merge_job_name, shard_job_name
from pipelines.partitions import partitions_name, shard_partitions
from pipelines.sources import Listing, diff_listing, list_shards
from tokenmill.recipe import DatasetConfig

SENSOR_INTERVAL_SECONDS = 30
AUTOMATION_SENSOR = "tokenmill_automation"


def shard_tags(dataset: str, key: str, fingerprint: str) -> dict[str, str]:
    """Tags of a shard run; ``tokenmill materialize`` looks for successful runs by them."""
    return {
        "tokenmill/dataset": dataset,
        "tokenmill/shard": key,
        "tokenmill/source_fingerprint": fingerprint,
    }


def shard_current(instance: DagsterInstance, ds: DatasetConfig, key: str, source_fp: str) -> bool:
    """A successful shard-job run exists for this shard at this source fingerprint."""
    runs = instance.get_runs(
        RunsFilter(
            job_name=shard_job_name(ds.name),
            statuses=[DagsterRunStatus.SUCCESS],
            tags=shard_tags(ds.name, key, source_fp),
        ),
        limit=1,
    )
    return bool(runs)


@dataclass(frozen=True)
class TickPlan:
    """What one sensor tick does."""

    add: list[str]
    delete: list[str]
    run: list[str]
    vanished: list[str]
    cursor: str
    messages: list[str] = field(default_factory=list)

    def vanished_run_key(self, previous: dict[str, str]) -> str:
        """Deterministic run key of the merge run for this set of vanished shards."""
        return "vanished:" + ",".join(f"{k}@{previous.get(k, '-')}" for k in self.vanished)


def shard_run_requests(
    instance: DagsterInstance, ds: DatasetConfig, listing: Listing, keys: list[str]
) -> list[RunRequest]:
    """One shard-job run per key, except shards already done at this fingerprint (e.g. by
    ``tokenmill materialize``): ``run_key`` and tags carry the shard and its fingerprint."""
    requests = []
    for key in keys:
        fp = listing.shards[key].fingerprint
        if not shard_current(instance, ds, key, fp):
            requests.append(
                RunRequest(
                    run_key=f"{key}:{fp}",
                    partition_key=key,
                    job_name=shard_job_name(ds.name),
                    tags=shard_tags(ds.name, key, fp),
                )
            )
    return requests


def _previous(cursor: str | None) -> dict[str, str]:
    try:
        value = json.loads(cursor) if cursor else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def plan_tick(cursor: str | None, listing: Listing, registered: set[str]) -> TickPlan:
    """Diff the listing against the cursor and the registered partitions."""
    messages = list(listing.rejected)
    previous = _previous(cursor)
    if cursor and not previous and cursor.strip() != "{}":
        messages.append(f"unreadable cursor {cursor[:80]!r}; treating every shard as new")
    current = listing.fingerprints()
    diff = diff_listing(previous, current)
    add = sorted(set(current) - registered)
    run = sorted(set(diff.new) | set(diff.changed) | set(add))
    vanished = sorted((set(diff.vanished) | registered) - set(current))
    if diff.changed:
        messages.append(f"changed shards, running again: {diff.changed}")
    if vanished:
        messages.append(f"vanished shards, removed from the partitions and the merge: {vanished}")
    return TickPlan(
        add=add,
        delete=sorted(set(vanished) & registered),
        run=run,
        vanished=vanished,
        cursor=json.dumps(current, sort_keys=True),
        messages=messages,
    )


def build_shard_sensor(
    ds: DatasetConfig, jobs: list[AssetJob], endpoint_url: str | None = None
) -> SensorDefinition:
    """The ``<ds>_shard_sensor`` of one dataset (default running); ``jobs`` are the dataset's
    shard and merge jobs; ``endpoint_url`` the S3 endpoint of an ``s3://`` source."""
    partitions = shard_partitions(ds.name)

    @sensor(
        name=f"{ds.name}_shard_sensor",
        jobs=jobs,
        minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Watches {ds.source} for new, changed and vanished shards of {ds.name}.",
    )
    def shard_sensor(context: SensorEvaluationContext) -> SensorResult:
        listing = list_shards(ds, endpoint_url)
        registered = set(context.instance.get_dynamic_partitions(partitions_name(ds.name)))
        plan = plan_tick(context.cursor, listing, registered)
        for message in plan.messages:
            context.log.warning(f"{ds.name}: {message}")
        requests = shard_run_requests(context.instance, ds, listing, plan.run)
        if plan.vanished:
            run_key = plan.vanished_run_key(_previous(context.cursor))
            requests.append(RunRequest(run_key=run_key, job_name=merge_job_name(ds.name)))
        changes: list[AddDynamicPartitionsRequest | DeleteDynamicPartitionsRequest] = []
        if plan.add:
            changes.append(partitions.build_add_request(plan.add))
        if plan.delete:
            changes.append(partitions.build_delete_request(plan.delete))
        return SensorResult(
            run_requests=requests, dynamic_partitions_requests=changes, cursor=plan.cursor
        )

    return shard_sensor


def automation_sensor() -> AutomationConditionSensorDefinition:
    """Evaluates the automation conditions of every asset; starts running (Dagster's default
    automation sensor starts stopped)."""
    return AutomationConditionSensorDefinition(
        AUTOMATION_SENSOR,
        target=AssetSelection.all(),
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
        description="Rebuilds merged datasets, indices and blends after their upstreams change.",
    )
