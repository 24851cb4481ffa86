"""Sensors: one per dataset watching its source for shards, the recipe sensor (indices and
blends follow recipe edits, read from the file at each tick), the takedown sensor (the recipe's
takedown list file: a changed list reruns the refresh), and the automation sensor.

The shard sensor is a plain function (:func:`plan_tick`) diffing the source listing against a
JSON cursor ``{shard: fingerprint}``, wrapped in a sensor returning one ``SensorResult``:

- new shards: added to the partition set and run over ranges of up to
  ``PARTITIONS_PER_BACKFILL_RUN`` consecutive partitions (:func:`shard_ranges`), the same range
  execution as a backfill (tags ``dagster/asset_partition_range_start``/``_end``); a range of
  one shard is a plain single-partition run. ``run_key`` = the range and its shards'
  fingerprints, so a tick never requests the same work twice;
- changed shards (new size/mtime): run again, in ranges of consecutive partitions likewise;
- unrecorded shards (registered, no tokens recorded: never run, or left behind by a range whose
  neighbour failed): run again, unless in progress, or failed at the file listed now (a failed
  shard waits until its file is fixed, replaced or removed, then runs with no manual step);
- vanished shards: removed from the partition set, reported in the log, and one merge run so
  the merged dataset (and what follows it) drops them; never silently.

Refused files (e.g. ``x.jsonl`` beside ``x.jsonl.gz``) and failed shards waiting for a change
are logged on the tick and, on a tick without runs, are its skip reason: both show in the UI.

Dagster's automation sensor starts stopped; ours starts running so that ``merged``, ``nanoset``
and ``blend/*`` follow new shards without a click.
"""

import functools
import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dagster import (
    AddDynamicPartitionsRequest,
    AssetKey,
    AssetSelection,
    AutomationConditionSensorDefinition,
    DagsterInstance,
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
from assets.support.staleness import (
    current_shards,
    failed_shards,
    recipe_code_versions,
    recorded_code_version,
    token_status,
)
from pipelines.jobs import AssetJob, merge_job_name, shard_job_name, shard_stages
from tokenmill.errors import ConfigError
from tokenmill.formats.takedown_records import list_sha256
from tokenmill.recipe import DatasetConfig, Recipe, load_recipe

SENSOR_INTERVAL_SECONDS = 30
# Every sensor here starts running and ticks at most every SENSOR_INTERVAL_SECONDS.
running_sensor = functools.partial(
    sensor,
    minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
    default_status=DefaultSensorStatus.RUNNING,
)
AUTOMATION_SENSOR = "tokenmill_automation"
# A sensor run (and a ``tokenmill materialize`` run) covers at most this many shards, as a
# backfill run does: start-up is paid once per range instead of once per shard.
RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


def shard_tags(dataset: str, key: str, fingerprint: str) -> dict[str, str]:
    """Tags of a single-shard run: labels to find runs by in the UI. Nothing reads them back;
    whether a shard is current is the staleness model's answer (``assets/support/staleness``)."""
    return {
        "tokenmill/dataset": dataset,
        "tokenmill/shard": key,
        "tokenmill/source_fingerprint": fingerprint,
    }


def range_tags(dataset: str, fingerprints: Mapping[str, str]) -> dict[str, str]:
    """Tags of a run over ``fingerprints`` (shard -> source fingerprint, in partition order):
    one shard gets :func:`shard_tags`; several get Dagster's partition range tags."""
    keys = list(fingerprints)
    if len(keys) == 1:
        return shard_tags(dataset, keys[0], fingerprints[keys[0]])
    return {"tokenmill/dataset": dataset, RANGE_START: keys[0], RANGE_END: keys[-1]}


def range_run_key(fingerprints: Mapping[str, str]) -> str:
    """``shard:fingerprint`` for one shard; ``first..last:<hash of every shard:fingerprint>``
    for a range: the same work always gets the same key."""
    keys = list(fingerprints)
    if len(keys) == 1:
        return f"{keys[0]}:{fingerprints[keys[0]]}"
    digest = hashlib.sha256(json.dumps(list(fingerprints.items())).encode()).hexdigest()[:16]
    return f"{keys[0]}..{keys[-1]}:{digest}"


def shard_ranges(
    order: list[str], keys: list[str], size: int = PARTITIONS_PER_BACKFILL_RUN
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
    at most ``PARTITIONS_PER_BACKFILL_RUN`` each), leaving out shards the staleness model finds
    current at this fingerprint (made by any run: sensor, backfill, ``tokenmill materialize``, UI);
    ``run_key`` carries the shards' fingerprints."""
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


def plan_tick(
    cursor: str | None,
    listing: Listing,
    registered: set[str],
    unrecorded: Collection[str] = (),
) -> TickPlan:
    """Diff the listing against the cursor and the registered partitions; ``unrecorded``
    (registered shards with no tokens recorded, neither in progress nor failed at the file
    listed now: see :func:`unrecorded_shards`) run again too."""
    messages = [f"refused: {reason}" for reason in listing.rejected]
    previous = _previous(cursor)
    if cursor and not previous and cursor.strip() != "{}":
        messages.append(f"unreadable cursor {cursor[:80]!r}; treating every shard as new")
    current = listing.fingerprints()
    diff = diff_listing(previous, current)
    add = sorted(set(current) - registered)
    retry = sorted((set(unrecorded) & set(current)) - set(diff.new) - set(diff.changed))
    run = sorted(set(diff.new) | set(diff.changed) | set(add) | set(retry))
    if retry:
        messages.append(f"shards not recorded yet, requested again: {retry}")
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


def unrecorded_shards(
    instance: DagsterInstance, ds: DatasetConfig, listing: Listing, registered: set[str]
) -> tuple[list[str], list[str]]:
    """``(unrecorded, waiting messages)``: the registered shards of the listing that have no
    tokens recorded (never run, or lost with a failed range) and are neither in progress nor
    failed at the file listed now; and one line per shard that failed at that file, which
    waits for the file to change (fixed, replaced or removed)."""
    keys = sorted(registered & set(listing.shards))
    status = token_status(instance, ds, keys)
    pending = [k for k in keys if status[k] not in ("MATERIALIZED", "IN_PROGRESS")]
    failures = failed_shards(instance, ds, pending, shard_stages(ds))
    unrecorded, waiting = [], []
    for key in pending:
        failure = failures.get(key)
        if failure is not None and failure.fingerprint == listing.shards[key].fingerprint:
            waiting.append(f"{key} failed ({failure.error}); runs again once its file changes")
        else:
            unrecorded.append(key)
    return unrecorded, waiting


def build_shard_sensor(
    ds: DatasetConfig, jobs: list[AssetJob], endpoint_url: str | None = None
) -> SensorDefinition:
    """The ``<ds>_shard_sensor`` of one dataset (default running); ``jobs`` are the dataset's
    shard and merge jobs; ``endpoint_url`` the S3 endpoint of an ``s3://`` source."""
    partitions = shard_partitions(ds.name)

    @running_sensor(
        name=f"{ds.name}_shard_sensor",
        jobs=jobs,
        description=f"Watches {ds.source} for new, changed and vanished shards of {ds.name}.",
    )
    def shard_sensor(context: SensorEvaluationContext) -> SensorResult:
        listing = list_shards(ds, endpoint_url)
        order = list(context.instance.get_dynamic_partitions(partitions_name(ds.name)))
        unrecorded, waiting = unrecorded_shards(context.instance, ds, listing, set(order))
        plan = plan_tick(context.cursor, listing, set(order), unrecorded)
        messages = [f"{ds.name}: {m}" for m in [*plan.messages, *waiting]]
        for message in messages:
            context.log.warning(message)
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
        # A tick without runs says why on the tick itself (the UI's tick list), refusals and
        # failures waiting for a change included; a tick with runs has them in its log.
        skip = None
        if not requests:
            skip = "; ".join(messages) or f"{ds.name}: no new, changed or unrecorded shards"
        return SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=changes,
            cursor=plan.cursor,
            skip_reason=skip,
        )

    return shard_sensor


RECIPE_SENSOR = "recipe_sensor"


@dataclass(frozen=True)
class RecipePlan:
    """What one recipe-sensor tick does: the assets to rebuild with the recipe as it is now
    (in dependency order), and what it cannot do until the code location reloads."""

    rebuild: list[AssetKey]
    messages: list[str]

    def run_key(self, versions: Mapping[AssetKey, str]) -> str:
        """The same edit always gets the same key (a tick never asks for it twice)."""
        settings = sorted((k.to_user_string(), versions[k]) for k in self.rebuild)
        return "recipe:" + hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]


def plan_recipe(
    loaded: Mapping[AssetKey, str],
    now: Mapping[AssetKey, str],
    recorded: Mapping[AssetKey, str | None],
) -> RecipePlan:
    """Compare the recipe settings' code versions as loaded, as in the file now, and as the
    assets' latest materializations recorded: an asset built with other settings than the
    file's is rebuilt (never-built ones are automation's); assets the file adds or drops need a
    reload of the code location, and are named."""
    rebuild = [k for k in loaded if k in now and recorded.get(k) not in (None, now[k])]
    messages = []
    added = sorted(k.to_user_string() for k in set(now) - set(loaded))
    dropped = sorted(k.to_user_string() for k in set(loaded) - set(now))
    if added or dropped:
        messages.append(
            f"the recipe adds {added or 'nothing'} and drops {dropped or 'nothing'}: "
            "reload the code location to apply that"
        )
    if rebuild:
        shown = [k.to_user_string() for k in rebuild]
        messages.append(f"recipe settings changed: rebuilding {shown}")
    return RecipePlan(rebuild, messages)


def build_recipe_sensor(recipe: Recipe, job: AssetJob) -> SensorDefinition:
    """``recipe_sensor`` (default running): reads the recipe file at every tick and rebuilds,
    through ``job`` (the refresh job), every index and blend whose recorded settings differ
    from the file's; the run loads the code location afresh, so it builds with the file as it
    is. A recipe that does not load is reported on the tick and changes nothing."""
    loaded = recipe_code_versions(recipe)

    @running_sensor(
        name=RECIPE_SENSOR,
        job=job,
        description=f"Rebuilds indices and blends whose settings in {recipe.path} changed.",
    )
    def recipe_sensor(context: SensorEvaluationContext) -> SensorResult:
        try:
            now = recipe_code_versions(load_recipe(recipe.path))
        except ConfigError as exc:
            return SensorResult(skip_reason=f"recipe not applied: {exc}")
        recorded = {key: recorded_code_version(context.instance, key) for key in loaded}
        plan = plan_recipe(loaded, now, recorded)
        for message in plan.messages:
            context.log.warning(message)
        if not plan.rebuild:
            skip = "; ".join(plan.messages) or "every index and blend matches the recipe"
            return SensorResult(skip_reason=skip)
        request = RunRequest(run_key=plan.run_key(now), asset_selection=plan.rebuild)
        return SensorResult(run_requests=[request])

    return recipe_sensor


TAKEDOWN_SENSOR = "takedown_sensor"


def build_takedown_sensor(recipe: Recipe, job: AssetJob) -> SensorDefinition:
    """``takedown_sensor`` (default running): its cursor is the sha256 of the recipe's
    takedown list file; a new or changed list requests ``job`` (the refresh: the ``takedowns``
    asset records the list, every merge masks what it names, indices and blends follow), with
    the digest as run key. A missing list is the tick's skip reason."""
    path = Path(str(recipe.takedown.list))

    @running_sensor(
        name=TAKEDOWN_SENSOR,
        job=job,
        description=f"Applies the takedown list {path} when it changes.",
    )
    def takedown_sensor(context: SensorEvaluationContext) -> SensorResult:
        if not path.is_file():
            return SensorResult(skip_reason=f"takedown list {path}: not there")
        digest = list_sha256(path)
        if digest == context.cursor:
            return SensorResult(skip_reason=f"takedown list {path}: unchanged")
        request = RunRequest(run_key=f"takedown:{digest}")
        return SensorResult(run_requests=[request], cursor=digest)

    return takedown_sensor


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
