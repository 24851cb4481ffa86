"""Headless runs: register the shards in the sources, materialize every stale asset, summarize.

``python -m pipelines.materialize [--recipe R]`` (what ``tokenmill materialize`` runs, from the
repo root) executes in process on the configured instance (``$DAGSTER_HOME``; SQLite by default):

1. Per dataset, the source listing is synced into the partition set (new shards added, vanished
   shards removed and reported).
2. A shard is current when a successful run of its shard job carries its source fingerprint
   (shard sensors tag their runs the same way) and its tokens on disk match the tokenizer and
   settings; every other shard gets one run of ``<ds>_shard_job`` (all its blocking checks).
3. The unpartitioned assets whose inputs changed (each records an ``input_version`` of what it
   read), and everything after them, are rebuilt together in one run of ``refresh_job``.
   Datasets with a failed shard are left out of step 3 (and reported).
"""

import argparse
import os
import sys
import time

from dagster import AssetKey, DagsterInstance, Definitions

from assets import blends, merged, nanoset
from pipelines.build import build_definitions
from pipelines.instance import ensure_dagster_home
from pipelines.jobs import REFRESH_JOB, shard_job_name
from pipelines.partitions import partitions_name
from pipelines.resources import StorageResource, TokenizerResource
from pipelines.sensors import shard_current, shard_tags
from pipelines.sources import Listing, list_shards
from pipelines.summary import DatasetOutcome, print_summary
from tokenmill.errors import ConfigError, TokenmillError
from tokenmill.manifest import check_dataset_files, dataset_manifest_path, read_dataset_manifest
from tokenmill.merge import natural_key
from tokenmill.recipe import DatasetConfig, Recipe, load_recipe, recipe_path

QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


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


def tokens_current(
    storage: StorageResource,
    tokenizer: TokenizerResource,
    fingerprint: str,
    ds: DatasetConfig,
    key: str,
) -> bool:
    """The shard's tokens exist, match their manifest's sizes, and used these settings."""
    prefix = storage.tokens_prefix(ds.name, key, ds.text_key)
    if not dataset_manifest_path(prefix).is_file() or check_dataset_files(prefix):
        return False
    config = read_dataset_manifest(prefix)["config"]
    return (
        config.get("tokenizer_fingerprint") == fingerprint
        and config.get("append_eod") == tokenizer.append_eod
        and config.get("text_key") == ds.text_key
    )


def process_shards(
    defs: Definitions, instance: DagsterInstance, ds: DatasetConfig
) -> DatasetOutcome:
    """Sync the partitions of one dataset and run the shard job for every stale shard."""
    storage, tokenizer = _resources(defs)
    listing = list_shards(ds, storage.s3_endpoint_url)
    outcome = DatasetOutcome(ds.name, sorted(listing.shards, key=natural_key))
    outcome.rejected = list(listing.rejected)
    outcome.removed = sync_partitions(instance, ds, listing)
    fingerprint = tokenizer.info().fingerprint
    job = defs.resolve_job_def(shard_job_name(ds.name))
    for key in outcome.shards:
        shard = listing.shards[key]
        if shard_current(instance, ds, key, shard.fingerprint) and tokens_current(
            storage, tokenizer, fingerprint, ds, key
        ):
            continue
        start = time.perf_counter()
        result = job.execute_in_process(
            run_config=QUIET,
            instance=instance,
            partition_key=key,
            tags=shard_tags(ds.name, key, shard.fingerprint),
            raise_on_error=False,
        )
        status = "ok" if result.success else "FAILED (see the run in the UI)"
        print(f"  {ds.name}/{key}: {status} in {time.perf_counter() - start:.1f} s", flush=True)
        (outcome.processed if result.success else outcome.failed).append(key)
    return outcome


def _resources(defs: Definitions) -> tuple[StorageResource, TokenizerResource]:
    resources = defs.resources or {}
    return resources["storage"], resources["tokenizer"]  # type: ignore[return-value]


def _recorded_version(instance: DagsterInstance, key: AssetKey) -> str | None:
    event = instance.get_latest_materialization_event(key)
    materialization = event.asset_materialization if event else None
    value = materialization.metadata.get("input_version") if materialization else None
    return None if value is None else str(value.value)


def stale_downstream(
    instance: DagsterInstance, recipe: Recipe, storage: StorageResource, skip: set[str]
) -> list[AssetKey]:
    """Unpartitioned assets whose inputs changed since they were built, plus what follows them.

    Datasets in ``skip`` (a shard failed) and blends using them are left as they are.
    """
    stale: list[AssetKey] = []
    remade: set[str] = set()
    for ds in recipe.datasets:
        if ds.name in skip:
            continue
        instance_keys = merged.shard_keys(instance, ds)
        merged_key, nanoset_key = AssetKey([ds.name, "merged"]), AssetKey([ds.name, "nanoset"])
        if _recorded_version(instance, merged_key) != merged.input_version(
            storage, ds, instance_keys
        ):
            stale += [merged_key, nanoset_key]
            remade.add(ds.name)
        elif _recorded_version(instance, nanoset_key) != nanoset.input_version(
            storage, ds, recipe.nanoset
        ):
            stale.append(nanoset_key)
    for blend in recipe.blends:
        if skip & set(blend.datasets):
            continue
        members = [recipe.dataset(n) for n in blend.datasets]
        key = AssetKey(["blend", blend.name])
        expected = blends.input_version(storage, blend, recipe.nanoset, members)
        if remade & set(blend.datasets) or _recorded_version(instance, key) != expected:
            stale.append(key)
    return stale


def materialize_recipe(recipe: Recipe, instance: DagsterInstance) -> int:
    """Steps 1–3 for every dataset and blend of ``recipe``; prints progress and a summary."""
    if recipe.storage.is_s3:
        raise ConfigError(
            f"storage.root {recipe.storage.root}: tokenmill materialize compares artifacts on a "
            "local root; with an S3 root the shard sensors and the automation sensor run the "
            "pipeline (dagster dev / the deployed code location)"
        )
    defs = build_definitions(recipe)
    outcomes = []
    for ds in recipe.datasets:
        print(f"{ds.name}: scanning {ds.source}", flush=True)
        outcomes.append(process_shards(defs, instance, ds))
    failed = {o.name for o in outcomes if o.failed}
    storage, _ = _resources(defs)
    stale = stale_downstream(instance, recipe, storage, failed)
    downstream_ok = True
    if stale:
        names = ", ".join(k.to_user_string() for k in stale)
        print(f"downstream: rebuilding {names} in one run", flush=True)
        result = defs.resolve_job_def(REFRESH_JOB).execute_in_process(
            run_config=QUIET, instance=instance, asset_selection=stale, raise_on_error=False
        )
        downstream_ok = result.success
        print(f"downstream: {'ok' if downstream_ok else 'FAILED (see the run in the UI)'}")
        if not downstream_ok:
            print("downstream: nothing after the failed step was rebuilt; fix it and run again")
    else:
        print("downstream: everything up to date")
    print_summary(recipe, storage, outcomes, stale if downstream_ok else [], instance)
    return 0 if downstream_ok and not failed else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m pipelines.materialize``."""
    parser = argparse.ArgumentParser(prog="tokenmill materialize", description=__doc__)
    parser.add_argument(
        "--recipe", help="recipe YAML (default $TOKENMILL_RECIPE or recipes/demo.yaml)"
    )
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(recipe_path(args.recipe))
        home = ensure_dagster_home()
        os.environ.setdefault("DAGSTER_HOME", str(home))
        print(f"recipe {recipe.path}; Dagster instance {home}", flush=True)
        with DagsterInstance.get() as instance:
            return materialize_recipe(recipe, instance)
    except ConfigError as exc:
        print(f"tokenmill materialize: error: {exc}", file=sys.stderr)
        return 2
    except TokenmillError as exc:
        print(f"tokenmill materialize: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
