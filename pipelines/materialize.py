"""Headless runs: register the shards in the sources, materialize every stale asset, summarize.

``python -m pipelines.materialize [--recipe R]`` (what ``tokenmill materialize`` runs, from the
repo root) executes in process on the configured instance (``$DAGSTER_HOME``; SQLite by default):

1. Per dataset, the source listing is synced into the partition set (new shards added, vanished
   shards removed and reported).
2. A shard is current when the Dagster instance records its tokens as made from the source
   fingerprint listed now, with the current tokenizer and settings, by a successful run
   (``assets/support/staleness.py``: the model the sensors and the UI read too); the other
   shards run through ``<ds>_shard_job`` (with its blocking checks) over ranges of up to
   ``MATERIALIZE_SHARDS_PER_RUN`` shards consecutive in the partition set, as sensor and
   backfill runs do with 16 (theirs run side by side; these run one after another, so a longer
   range only saves each run's fixed cost). A failing shard
   fails its whole range (none of its shards is recorded): the failing shard is named, and
   the next call runs that range again.
3. The unpartitioned assets whose recorded data version differs from the one their inputs'
   records give now, and everything after them, are rebuilt together in one run of
   ``refresh_job``. Datasets with a failed shard are left out of step 3 (and reported).

The comparisons and the summary read the instance's records, not the storage root, so an
``s3://`` root costs no listing or download: its buckets get one HEAD each first, before any
run, and each merged pointer and blend manifest one HEAD (a removed one is rebuilt). The
summary has one line per failure with its cause; the full errors go to ``$DAGSTER_HOME/logs/``
(``--verbose``: to the console too). The guards of ``pipelines/runguard.py`` hold: one
materialize per instance and storage root, interrupted runs marked failed, SIGTERM handled as
Ctrl-C.
"""

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dagster import AssetKey, DagsterInstance, Definitions

from assets.support.partitions import partitions_name, shard_keys
from assets.support.resources import StorageResource, TokenizerResource
from assets.support.sources import Listing, list_shards
from assets.support.staleness import (
    current_shards,
    expected_versions,
    recorded_version,
    tokens_settings,
)
from assets.support.takedowns import TAKEDOWNS, list_recorded, read_storage_ledger
from pipelines.build import build_definitions
from pipelines.instance import ensure_dagster_home, ensure_pool_limits
from pipelines.jobs import DOWNSTREAM_STAGES, REFRESH_JOB, shard_job_name
from pipelines.runguard import (
    fail_interrupted_runs,
    instance_errors,
    materialize_locks,
    run_lease,
    stop_if_interrupted,
)
from pipelines.sensors import range_tags, shard_ranges
from pipelines.summary import (
    DatasetOutcome,
    RunReport,
    print_summary,
    run_failures,
    write_failure_log,
)
from tokenmill.cli import run_command
from tokenmill.formats.merge import natural_key
from tokenmill.recipe import DatasetConfig, Recipe, load_recipe, recipe_path
from tokenmill.storage import layout
from tokenmill.storage.s3 import s3_errors, shared_client, split_uri

# Shards per in-process run: a run costs ≈ 1.3 CPU-s however many shards it holds (the run's
# records, resources, one step per stage and check; bench/bench_orchestration.py), so 64 cut
# the orchestration of 128 small new shards from ≈ 0.25 to ≈ 0.19 CPU-s per shard.
MATERIALIZE_SHARDS_PER_RUN = 64


def sync_partitions(instance: DagsterInstance, ds: DatasetConfig, listing: Listing) -> list[str]:
    """Make the partition set equal the source listing; the keys removed (vanished shards)."""
    name = partitions_name(ds.name)
    registered = set(instance.get_dynamic_partitions(name))
    new = sorted(set(listing.shards) - registered, key=natural_key)
    if new:
        instance.add_dynamic_partitions(name, new)
    gone = sorted(registered - set(listing.shards), key=natural_key)
    for key in gone:
        instance.delete_dynamic_partition(name, key)
    return gone


def process_shards(
    defs: Definitions, instance: DagsterInstance, ds: DatasetConfig, *, verbose: bool = False
) -> DatasetOutcome:
    """Sync the partitions of one dataset and run the shard job for every stale shard; each
    failure is kept with its cause (``DatasetOutcome.failures``)."""
    storage, tokenizer = _resources(defs)
    listing = list_shards(ds, storage.s3_endpoint_url)
    outcome = DatasetOutcome(ds.name, sorted(listing.shards, key=natural_key))
    outcome.rejected = list(listing.rejected)
    outcome.removed = sync_partitions(instance, ds, listing)
    settings = tokens_settings(tokenizer.info().fingerprint, tokenizer.append_eod, ds)
    job = defs.resolve_job_def(shard_job_name(ds.name))
    sources = {key: listing.shards[key].fingerprint for key in outcome.shards}
    done = current_shards(instance, ds, sources, settings)
    stale = [key for key in outcome.shards if key not in done]
    order = instance.get_dynamic_partitions(partitions_name(ds.name))
    for shards in shard_ranges(list(order), stale, MATERIALIZE_SHARDS_PER_RUN):
        start = time.perf_counter()
        tags = range_tags(ds.name, {key: sources[key] for key in shards})
        with run_lease(instance) as lease:
            result = job.execute_in_process(
                run_config=run_config(verbose),
                instance=instance,
                partition_key=shards[0] if len(shards) == 1 else None,
                tags={**tags, **lease},
                raise_on_error=False,
            )
        stop_if_interrupted(result)
        name = f"{ds.name}/{shards[0]}"
        if len(shards) > 1:
            name += f"..{shards[-1]} ({len(shards)} shards)"
        if result.success:
            print(f"  {name}: ok in {time.perf_counter() - start:.1f} s", flush=True)
            outcome.processed.extend(shards)
            continue
        failures = run_failures(result)
        named = sorted(
            {s.strip() for f in failures if f.shard for s in f.shard.split(",")} & set(shards),
            key=natural_key,
        )
        at = f" at {', '.join(named)}" if named else ""
        rest = len(shards) - len(named) if named else 0
        others = (
            f"; the other {rest} shards were recorded at the stages they reached (the next run "
            "finishes them)"
            if rest
            else ""
        )
        print(f"  {name}: FAILED{at}{others}", flush=True)
        outcome.failed.extend(named or shards)
        outcome.failures.extend(failures)
    return outcome


def run_config(verbose: bool) -> dict[str, Any]:
    """Dagster's console log: warnings and errors with tracebacks with ``verbose``, else
    nothing (the summary names each failure in one line and the log file has the rest)."""
    level = "WARNING" if verbose else "CRITICAL"
    return {"loggers": {"console": {"config": {"log_level": level}}}}


def _resources(defs: Definitions) -> tuple[StorageResource, TokenizerResource]:
    resources = defs.resources or {}
    return resources["storage"], resources["tokenizer"]  # type: ignore[return-value]


def stale_downstream(
    instance: DagsterInstance,
    recipe: Recipe,
    skip: set[str],
    storage: StorageResource | None = None,
) -> list[AssetKey]:
    """Unpartitioned assets whose recorded data version differs from the one their inputs'
    records and the takedown ledger on ``storage`` give now, plus what follows them (a changed
    merge rebuilds its dataset's stages; a takedown list not in the ledger yet, everything).

    Datasets in ``skip`` (a shard failed) and blends using them are left as they are.
    """
    keys = {ds.name: shard_keys(instance, ds) for ds in recipe.datasets}
    ledger = read_storage_ledger(storage) if storage is not None else []
    expected = expected_versions(instance, recipe, keys, ledger)
    gone = _gone(storage, recipe)
    stale: list[AssetKey] = []
    if recipe.takedown.list is not None and not list_recorded(ledger, recipe.takedown.list):
        stale.append(TAKEDOWNS)
        expected = {}  # the new record may change every merge: rebuild them all
    for ds in recipe.datasets:
        if ds.name in skip:
            continue
        merged_key, nanoset_key = AssetKey([ds.name, "merged"]), AssetKey([ds.name, "nanoset"])
        if (
            not expected
            or merged_key in gone
            or recorded_version(instance, merged_key) != expected[merged_key]
        ):
            stale += [AssetKey([ds.name, stage]) for stage in DOWNSTREAM_STAGES]
        elif recorded_version(instance, nanoset_key) != expected[nanoset_key]:
            stale.append(nanoset_key)
    for blend in recipe.blends:
        key = AssetKey(["blend", blend.name])
        if skip & set(blend.datasets):
            continue
        if not expected or key in gone or recorded_version(instance, key) != expected[key]:
            stale.append(key)
    return stale


def _gone(storage: StorageResource | None, recipe: Recipe) -> set[AssetKey]:
    """Merged datasets and blends whose pointer or manifest is missing from the root (removed
    while the instance kept its records; one HEAD each on S3): rebuilt, not "up to date"."""
    if storage is None:
        return set()
    files = {AssetKey([d.name, "merged"]): layout.merged_pointer(d.name) for d in recipe.datasets}
    files |= {AssetKey(["blend", b.name]): layout.blend_manifest(b.name) for b in recipe.blends}
    return {key for key, rel in files.items() if not storage.exists(rel)}


def materialize_recipe(
    recipe: Recipe, instance: DagsterInstance, *, verbose: bool = False, home: Path | None = None
) -> int:
    """Steps 1–3 for every dataset and blend of ``recipe``; prints progress and a summary, and
    the full errors to a log file under ``home`` (default: the system temp folder)."""
    defs = build_definitions(recipe)
    preflight(recipe)
    outcomes = []
    for ds in recipe.datasets:
        print(f"{ds.name}: scanning {ds.source}", flush=True)
        outcomes.append(process_shards(defs, instance, ds, verbose=verbose))
    failed = {o.name for o in outcomes if o.failed}
    storage = _resources(defs)[0]
    stale = stale_downstream(instance, recipe, failed, storage)
    report = run_downstream(defs, instance, stale, verbose=verbose)
    left = [
        k for k in stale_downstream(instance, recipe, set(), storage) if k not in report.rebuilt
    ]
    report.not_rebuilt = left
    failures = [f for o in outcomes for f in o.failures] + list(report.failures)
    if failures:
        report.log = write_failure_log(home or Path(tempfile.gettempdir()) / "tokenmill", failures)
    print_summary(recipe, outcomes, report, instance)
    return 1 if failures or failed or left else 0


def preflight(recipe: Recipe) -> None:
    """For ``s3://`` roots and sources: each bucket exists and the credentials reach it (one
    HEAD per bucket), before any run starts; an InputError naming the bucket otherwise."""
    uris = [recipe.storage.root] + [ds.source for ds in recipe.datasets]
    buckets = sorted({split_uri(uri)[0] for uri in uris if uri.startswith("s3://")})
    if not buckets:
        return
    client = shared_client(recipe.storage.s3_endpoint_url)
    for bucket in buckets:
        with s3_errors(f"s3://{bucket} (storage or a source of the recipe)"):
            client.head_bucket(Bucket=bucket)


def run_downstream(
    defs: Definitions, instance: DagsterInstance, stale: list[AssetKey], *, verbose: bool = False
) -> RunReport:
    """Rebuild the stale unpartitioned assets in one run of ``refresh_job``: what it rebuilt
    (all of ``stale`` when it succeeded) and its failures."""
    if not stale:
        print("downstream: everything up to date")
        return RunReport()
    names = ", ".join(k.to_user_string() for k in stale)
    print(f"downstream: rebuilding {names} in one run", flush=True)
    with run_lease(instance) as lease:
        result = defs.resolve_job_def(REFRESH_JOB).execute_in_process(
            run_config=run_config(verbose),
            instance=instance,
            asset_selection=stale,
            tags=lease,
            raise_on_error=False,
        )
    stop_if_interrupted(result)
    if result.success:
        print("downstream: ok")
        return RunReport(rebuilt=stale)
    done = {e.asset_key for e in result.get_asset_materialization_events()}
    print("downstream: FAILED; what depends on the failed step was not rebuilt")
    return RunReport(rebuilt=[k for k in stale if k in done], failures=run_failures(result))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m pipelines.materialize``."""
    parser = argparse.ArgumentParser(prog="tokenmill materialize", description=__doc__)
    parser.add_argument(
        "--recipe", help="recipe YAML (default $TOKENMILL_RECIPE or recipes/demo.yaml)"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print Dagster's warnings and tracebacks"
    )
    args = parser.parse_args(argv)

    def body() -> int:
        recipe = load_recipe(recipe_path(args.recipe))
        home = ensure_dagster_home()
        os.environ.setdefault("DAGSTER_HOME", str(home))
        print(f"recipe {recipe.path}; storage {recipe.storage.root}; Dagster instance {home}")
        # SIGTERM ends the run as Ctrl-C does (Dagster marks the run failed, as it does itself
        # while a step runs), so a stopped wrapper leaves no run STARTED.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        with (
            instance_errors(home),
            materialize_locks(home, recipe.storage.root),
            DagsterInstance.get() as instance,
        ):
            for run_id in fail_interrupted_runs(instance):
                print(f"run {run_id}: its process is gone (killed or stopped); marked failed")
            ensure_pool_limits(instance)
            return materialize_recipe(recipe, instance, verbose=args.verbose, home=home)

    return run_command("materialize", body, "interrupted; the run in progress is marked failed")


if __name__ == "__main__":
    sys.exit(main())
