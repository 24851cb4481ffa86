"""Headless runs: register the shards in the sources, materialize every stale asset, summarize.

``python -m pipelines.materialize [--recipe R]`` (what ``tokenmill materialize`` runs, from the
repo root) executes in process on the configured instance (``$DAGSTER_HOME``; SQLite by default):

1. Per dataset, the source listing is synced into the partition set (new shards added, vanished
   shards removed and reported).
2. A shard is current when a successful run of its shard job carries its source fingerprint
   (shard sensors tag their runs the same way) and its tokens in the storage root match the
   tokenizer and settings; the other shards run through ``<ds>_shard_job`` (with its blocking
   checks) over ranges of up to 16 shards consecutive in the partition set, as sensor and
   backfill runs do. A failing shard fails its whole range (none of its shards is recorded):
   the failing shard is named, and the next call runs that range again.
3. The unpartitioned assets whose inputs changed (each records an ``input_version`` of what it
   read), and everything after them, are rebuilt together in one run of ``refresh_job``.
   Datasets with a failed shard are left out of step 3 (and reported).

The comparisons read manifests and stats files. For an ``s3://`` storage root they read a
:class:`RootView`: a temporary local mirror of the root's bookkeeping, refreshed from S3
listings before each step (only objects whose ETag changed are fetched again).
"""

import argparse
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dagster import AssetKey, DagsterInstance, Definitions

from assets import blends, merged, nanoset
from assets.support import s3
from assets.support.partitions import partitions_name, shard_keys
from assets.support.resources import StorageResource, TokenizerResource
from assets.support.sources import Listing, list_shards
from pipelines.build import build_definitions
from pipelines.instance import ensure_dagster_home
from pipelines.jobs import DOWNSTREAM_STAGES as DATASET_STAGES
from pipelines.jobs import REFRESH_JOB, shard_job_name
from pipelines.sensors import current_shards, range_tags, shard_ranges
from pipelines.summary import DatasetOutcome, print_summary, shown
from tokenmill import layout
from tokenmill._atomic import TMP_MARK
from tokenmill.errors import ConfigError, TokenmillError
from tokenmill.manifest import check_dataset_files, dataset_manifest_path, read_dataset_manifest
from tokenmill.merge import natural_key
from tokenmill.recipe import DatasetConfig, Recipe, load_recipe, recipe_path
from tokenmill.s3 import split_uri

QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
MIRROR_JOBS = 8  # parallel GETs when mirroring an S3 root's manifests and stats


class RootView:
    """The storage root as ``materialize`` reads it: a local root as it is; an S3 root as a
    mirror under ``local`` of the prefixes the comparisons read, where every ``.json`` object
    (stats, manifests) is copied and every other object is a sparse placeholder of its listed
    size, so a manifest's size check compares against S3 without downloading data."""

    def __init__(self, storage: StorageResource, recipe: Recipe, local: Path) -> None:
        self.storage = storage
        self.local = local
        self.prefixes = [
            f"{folder(ds.name)}/"
            for ds in recipe.datasets
            for folder in (layout.raw_dir, layout.tokens_dir)
        ]
        self.prefixes += [f"{layout.MERGED}/"]
        self.prefixes += [f"{layout.blend_dir(b.name)}/" for b in recipe.blends]
        self.etags: dict[str, str] = {}

    def sync(self) -> StorageResource:
        """Bring the mirror up to date with the root; a storage rooted where paths resolve.
        A key that would land outside the mirror is refused (InputError) before any change."""
        if not self.storage.is_s3:
            return self.storage
        bucket, prefix = split_uri(self.storage.root)
        base = f"{prefix}/" if prefix else ""
        client = s3.s3_client(self.storage.s3_endpoint_url)
        listed: dict[str, s3.S3Object] = {}
        for rel in self.prefixes:
            for obj in s3.list_objects(client, bucket, base + rel, recursive=True):
                if TMP_MARK not in obj.key:
                    listed[s3.local_name(bucket, obj.key, base)] = obj
        for name in set(self.etags) - set(listed):
            (self.local / name).unlink(missing_ok=True)

        def copy(name: str) -> None:
            path, obj = self.local / name, listed[name]
            if name.endswith(".json"):
                s3.download(client, bucket, obj.key, path)
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as placeholder:
                placeholder.truncate(obj.size)

        changed = sorted(n for n, obj in listed.items() if self.etags.get(n) != obj.etag)
        with ThreadPoolExecutor(MIRROR_JOBS) as pool:
            list(pool.map(copy, changed))
        self.etags = {name: obj.etag for name, obj in listed.items()}
        return StorageResource(root=str(self.local), s3_endpoint_url=self.storage.s3_endpoint_url)

    def where(self, path: Path) -> str:
        """Where a path of the view really is: its ``s3://`` URI, or the path for the user."""
        if not self.storage.is_s3:
            return shown(path)
        return f"{self.storage.root.rstrip('/')}/{path.relative_to(self.local).as_posix()}"


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
    defs: Definitions, instance: DagsterInstance, ds: DatasetConfig, view: StorageResource
) -> DatasetOutcome:
    """Sync the partitions of one dataset and run the shard job for every stale shard;
    ``view`` is the storage root as :meth:`RootView.sync` returns it."""
    storage, tokenizer = _resources(defs)
    listing = list_shards(ds, storage.s3_endpoint_url)
    outcome = DatasetOutcome(ds.name, sorted(listing.shards, key=natural_key))
    outcome.rejected = list(listing.rejected)
    outcome.removed = sync_partitions(instance, ds, listing)
    fingerprint = tokenizer.info().fingerprint
    job = defs.resolve_job_def(shard_job_name(ds.name))
    sources = {key: listing.shards[key].fingerprint for key in outcome.shards}
    done = current_shards(instance, ds, sources)
    stale = [
        key
        for key in outcome.shards
        if key not in done or not tokens_current(view, tokenizer, fingerprint, ds, key)
    ]
    order = instance.get_dynamic_partitions(partitions_name(ds.name))
    for shards in shard_ranges(list(order), stale):
        start = time.perf_counter()
        tags = range_tags(ds.name, {key: sources[key] for key in shards})
        result = job.execute_in_process(
            run_config=QUIET,
            instance=instance,
            partition_key=shards[0] if len(shards) == 1 else None,
            tags=tags,
            raise_on_error=False,
        )
        name = f"{ds.name}/{shards[0]}"
        if len(shards) > 1:
            name += f"..{shards[-1]} ({len(shards)} shards)"
        status = "ok"
        if not result.success:
            named = failing_shards(result, shards)
            status = f"FAILED at {', '.join(named)}" if named else "FAILED"
            status += " (see the run in the UI)"
            if len(shards) > 1:
                status += "; no shard of this range was recorded, the next run redoes the range"
        print(f"  {name}: {status} in {time.perf_counter() - start:.1f} s", flush=True)
        (outcome.processed if result.success else outcome.failed).extend(shards)
    return outcome


def failing_shards(result: Any, shards: list[str]) -> list[str]:
    """The shards a failed run's errors name (step failures carry the failing shard's file
    name; range checks prefix each problem with its shard)."""
    text = "\n".join(
        event.event_specific_data.error.to_string()
        for event in result.all_events
        if event.is_step_failure and event.event_specific_data.error is not None
    )
    text += "\n".join(
        str(evaluation.metadata.get("problems").value)
        for evaluation in result.get_asset_check_evaluations()
        if not evaluation.passed and evaluation.metadata.get("problems") is not None
    )
    return [key for key in shards if re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", text)]


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
        instance_keys = shard_keys(instance, ds)
        merged_key, nanoset_key = AssetKey([ds.name, "merged"]), AssetKey([ds.name, "nanoset"])
        if _recorded_version(instance, merged_key) != merged.input_version(
            storage, ds, instance_keys
        ):
            stale += [AssetKey([ds.name, stage]) for stage in DATASET_STAGES]
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
    defs = build_definitions(recipe)
    storage, _ = _resources(defs)
    with tempfile.TemporaryDirectory(prefix="tokenmill-view-") as scratch:
        view = RootView(storage, recipe, Path(scratch))
        before = view.sync()
        outcomes = []
        for ds in recipe.datasets:
            print(f"{ds.name}: scanning {ds.source}", flush=True)
            outcomes.append(process_shards(defs, instance, ds, before))
        failed = {o.name for o in outcomes if o.failed}
        stale = stale_downstream(instance, recipe, view.sync(), failed)
        downstream_ok = run_downstream(defs, instance, stale)
        rebuilt = stale if downstream_ok else []
        print_summary(recipe, view.sync(), outcomes, rebuilt, instance, view.where)
    return 0 if downstream_ok and not failed else 1


def run_downstream(defs: Definitions, instance: DagsterInstance, stale: list[AssetKey]) -> bool:
    """Rebuild the stale unpartitioned assets in one run of ``refresh_job``; True when it
    succeeded (or nothing was stale)."""
    if not stale:
        print("downstream: everything up to date")
        return True
    names = ", ".join(k.to_user_string() for k in stale)
    print(f"downstream: rebuilding {names} in one run", flush=True)
    result = defs.resolve_job_def(REFRESH_JOB).execute_in_process(
        run_config=QUIET, instance=instance, asset_selection=stale, raise_on_error=False
    )
    print(f"downstream: {'ok' if result.success else 'FAILED (see the run in the UI)'}")
    if not result.success:
        print("downstream: nothing after the failed step was rebuilt; fix it and run again")
    return bool(result.success)


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
        print(f"recipe {recipe.path}; storage {recipe.storage.root}; Dagster instance {home}")
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
