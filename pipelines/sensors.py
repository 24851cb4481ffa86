"""Sensors: one per dataset watching its source for shards, and the automation sensor.

The shard sensor is a plain function (:func:`plan_tick`) diffing the source listing against a
JSON cursor ``{shard: fingerprint}``, wrapped in a sensor returning one ``SensorResult``:

- new shards: added to the partition set and run over ranges of up to
  ``MAX_SHARDS_PER_RUN`` consecutive partitions (:func:`shard_ranges`), the same range execution
  as a backfill (tags ``dagster/asset_partition_range_start``/``_end``); a range of one shard is
  a plain single-partition run. ``run_key`` = the range and its shards' fingerprints, so a tick
  never requests the same work twice;
- changed shards (new size/mtime): run again, in ranges of consecutive partitions likewise;
- vanished shards: removed from the partition set, reported in the log, and one merge run so
  the merged dataset (and what follows it) drops them; never silently.

Dagster's automation sensor starts stopped; ours starts running so that ``merged``, ``nanoset``
and ``blend/*`` follow new shards without a click.
"""

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from dagster import (
    AddDynamicPartitionsRequest,
    AssetKey,
    AssetRecordsFilter,
    AssetSelection,
    AutomationConditionSensorDefinition,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    DeleteDynamicPartitionsRequest,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from assets.shards import PARTITIONS_PER_BACKFILL_RUN
from assets.support.partitions import partitions_name, shard_partitions
from assets.support.sources import Listing, diff_listing, list_shards
from pipelines.jobs import AssetJob, merge_job_name, shard_job_name
from tokenmill.recipe import DatasetConfig

SENSOR_INTERVAL_SECONDS = 30
AUTOMATION_SENSOR = "tokenmill_automation"
# A sensor run (and a ``tokenmill materialize`` run) covers at most this many shards, as a
# backfill run does: start-up is paid once per range instead of once per shard.
MAX_SHARDS_PER_RUN = PARTITIONS_PER_BACKFILL_RUN
RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"
FINGERPRINTS_TAG = "tokenmill/source_fingerprints"
# The last stage of every shard job (an ``hf`` dataset has no ``raw_jsonl``, all have tokens).
LAST_SHARD_STAGE = "tokens"


def shard_tags(dataset: str, key: str, fingerprint: str) -> dict[str, str]:
    """Tags of a single-shard run; ``tokenmill materialize`` and the sensors read them back."""
    return {
        "tokenmill/dataset": dataset,
        "tokenmill/shard": key,
        "tokenmill/source_fingerprint": fingerprint,
    }


def range_tags(dataset: str, fingerprints: Mapping[str, str]) -> dict[str, str]:
    """Tags of a run over ``fingerprints`` (shard -> source fingerprint, in partition order):
    one shard gets :func:`shard_tags`; several get Dagster's partition range tags and the
    fingerprints of every shard as one JSON tag."""
    keys = list(fingerprints)
    if len(keys) == 1:
        return shard_tags(dataset, keys[0], fingerprints[keys[0]])
    return {
        "tokenmill/dataset": dataset,
        RANGE_START: keys[0],
        RANGE_END: keys[-1],
        FINGERPRINTS_TAG: json.dumps(dict(fingerprints), separators=(",", ":")),
    }


def range_run_key(fingerprints: Mapping[str, str]) -> str:
    """``shard:fingerprint`` for one shard; ``first..last:<hash of every shard:fingerprint>``
    for a range: the same work always gets the same key."""
    keys = list(fingerprints)
    if len(keys) == 1:
        return f"{keys[0]}:{fingerprints[keys[0]]}"
    digest = hashlib.sha256(json.dumps(list(fingerprints.items())).encode()).hexdigest()[:16]
    return f"{keys[0]}..{keys[-1]}:{digest}"


def run_fingerprint(tags: Mapping[str, str], key: str) -> str | None:
    """The source fingerprint a run recorded for shard ``key`` (single or range run)."""
    if FINGERPRINTS_TAG in tags:
        try:
            value = json.loads(tags[FINGERPRINTS_TAG]).get(key)
        except (json.JSONDecodeError, AttributeError):
            return None
        return value if isinstance(value, str) else None
    return tags.get("tokenmill/source_fingerprint") if tags.get("tokenmill/shard") == key else None


def current_shards(
    instance: DagsterInstance, ds: DatasetConfig, fingerprints: Mapping[str, str]
) -> set[str]:
    """The shards of ``fingerprints`` whose last shard stage was materialized by a successful
    run that recorded this source fingerprint (a sensor run, a ``materialize`` run, or their
    retry). One query finds the shards ever materialized, so a burst of new shards costs one
    query; each materialized shard costs two more (its latest record, its run)."""
    asset_key = AssetKey([ds.name, LAST_SHARD_STAGE])
    seen = instance.get_latest_storage_id_by_partition(
        asset_key, DagsterEventType.ASSET_MATERIALIZATION, set(fingerprints)
    )
    current = set()
    for key in sorted(set(seen) & set(fingerprints)):  # storages may answer for more
        records = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=asset_key, asset_partitions=[key]), limit=1
        ).records
        run = instance.get_run_by_id(records[0].run_id) if records else None
        if (
            run is not None
            and run.status == DagsterRunStatus.SUCCESS
            and run_fingerprint(run.tags, key) == fingerprints[key]
        ):
            current.add(key)
    return current


def shard_current(instance: DagsterInstance, ds: DatasetConfig, key: str, source_fp: str) -> bool:
    """A successful shard-job run (single or range) produced this shard at this fingerprint."""
    return key in current_shards(instance, ds, {key: source_fp})


def shard_ranges(
    order: list[str], keys: list[str], size: int = MAX_SHARDS_PER_RUN
) -> list[list[str]]:
    """``keys`` cut into runs of partitions that are consecutive in ``order`` (the partition
    set's order: a Dagster range over dynamic partitions spans every key between its ends in
    that order), each of at most ``size`` keys."""
    position = {key: i for i, key in enumerate(order)}
    ranges: list[list[str]] = []
    for key in sorted(keys, key=position.__getitem__):
        last = ranges[-1] if ranges else None
        if last and position[last[-1]] + 1 == position[key] and len(last) < size:
            last.append(key)
        else:
            ranges.append([key])
    return ranges


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
    instance: DagsterInstance,
    ds: DatasetConfig,
    listing: Listing,
    keys: list[str],
    order: list[str],
) -> list[RunRequest]:
    """Shard-job runs over ranges of ``keys`` (consecutive in the partition order ``order``,
    at most ``MAX_SHARDS_PER_RUN`` each), leaving out shards already done at this fingerprint
    (e.g. by ``tokenmill materialize``); ``run_key`` and tags carry the shards' fingerprints."""
    wanted = {key: listing.shards[key].fingerprint for key in keys}
    done = current_shards(instance, ds, wanted)
    requests = []
    for shards in shard_ranges(order, [k for k in keys if k not in done]):
        fingerprints = {key: wanted[key] for key in shards}
        requests.append(
            RunRequest(
                run_key=range_run_key(fingerprints),
                partition_key=shards[0] if len(shards) == 1 else None,
                job_name=shard_job_name(ds.name),
                tags=range_tags(ds.name, fingerprints),
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
        order = list(context.instance.get_dynamic_partitions(partitions_name(ds.name)))
        plan = plan_tick(context.cursor, listing, set(order))
        for message in plan.messages:
            context.log.warning(f"{ds.name}: {message}")
        # The partition order once this tick's additions are applied (the daemon adds them
        # before it creates the runs): ranges are cut from it.
        order = [k for k in order if k not in set(plan.delete)] + plan.add
        requests = shard_run_requests(context.instance, ds, listing, plan.run, order)
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
