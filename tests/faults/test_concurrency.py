"""Concurrency: two runs materializing the same partition at once, shard-sensor ticks during a
running backfill, and 16 loader processes opening a cold index cache.

Runs execute in spawned worker processes (real concurrency) on one SQLite ``DAGSTER_HOME`` and
one storage root. Interleavings are forced with barriers and events, not sleeps: ``together``
runs start at a barrier; a ``paused`` run stops just before renaming one artifact into place
(its temp file written) while an ``intruder`` run of the same partition goes from start to
finish, then the paused run completes (see ``concurrency_tasks.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from concurrency_tasks import (
    TIMEOUT,
    RankReport,
    RunOutcome,
    RunSpec,
    Workers,
    blend_digests,
    blend_from,
    blend_settings,
    gated_commits,
    make_dataset,
    open_rank,
    run_job,
    start_pool,
)
from pipeline_project import make_project
from tiny_pairs import index_of

from tokenmill.atomic import TMP_DIR, TMP_MARK, remove_stale_temps, writer_alive
from tokenmill.formats.dataset_manifest import check_dataset_files, read_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.recipe import Recipe
from tokenmill.storage.versions import pointer_target, pointer_version

PIPELINE = ("dagster", "pipelines.build", "tokenmill.tokenize.run", "tokenmill.formats.merge")
LOADER = ("tokenmill.loader", "tokenmill.indices.nanoset", "tokenmill.indices.blend_build")
RANKS = 16
SHARD = "extra-00000"  # the shard with bad lines: stats, quarantine, Parquet and tokens
MERGED = (("docs", "merged"), ("docs", "nanoset"))


@pytest.fixture(scope="module")
def runners() -> Iterator[Workers]:
    """Two workers with the pipeline imported."""
    workers = start_pool(2, PIPELINE)
    workers.start(2)
    yield workers
    workers.pool.shutdown()


@dataclass(frozen=True)
class Project:
    """A recipe project, its SQLite Dagster home and its storage root."""

    recipe: Recipe
    home: Path
    root: Path

    def spec(self, job: str, **kwargs: Any) -> RunSpec:
        return RunSpec(str(self.recipe.path), str(self.home), job, **kwargs)


def new_project(recipe: Recipe, home: Path, keep: list[str]) -> Project:
    """Cut the docs source to ``keep`` shards; create the instance (here, before any worker
    opens it) with those shards registered."""
    from dagster import DagsterInstance

    from assets.support.partitions import partitions_name
    from pipelines.instance import ensure_dagster_home

    source = Path(recipe.dataset("docs").source)
    for path in source.iterdir():
        if path.is_file() and path.name.split(".")[0] not in keep:  # .tmp/: the writer's
            path.unlink()
    ensure_dagster_home(home)
    with DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions(partitions_name("docs"), keep)
    return Project(recipe, home, Path(recipe.storage.root))


@dataclass(frozen=True)
class Clean:
    """A project whose docs shards and merged dataset were built once, one run at a time."""

    project: Project
    files: dict[str, Any]


@pytest.fixture(scope="module")
def clean(
    runners: Workers,
    tmp_path_factory: pytest.TempPathFactory,
    gpt2_dir: Path,
    documents: dict[str, list[dict[str, str]]],
) -> Clean:
    base = tmp_path_factory.mktemp("clean")
    project = new_project(
        make_project(base, gpt2_dir, documents), base / "dagster_home", [SHARD, "part-00000"]
    )
    shards = runners.one(project.spec("docs_shard_job", partitions=(SHARD, "part-00000")))
    merged = runners.one(project.spec("refresh_job", assets=MERGED))
    assert (shards.success, merged.success) == ([True, True], [True])
    assert shards.errors + merged.errors == []
    return Clean(project, snapshot(project.root))


def _stable(value: Any) -> Any:
    """A JSON record without what depends on the moment of the run (timings)."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def snapshot(root: Path) -> dict[str, Any]:
    """Every file under ``root`` by relative path: its bytes, or a JSON record made stable."""
    files: dict[str, Any] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel.endswith((".stats.json", ".manifest.json")):
            files[rel] = _stable(json.loads(path.read_text()))
        else:
            files[rel] = path.read_bytes()
    return files


def temps(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(f"*{TMP_MARK}*")]


def roles(spec: RunSpec, gate: str | None) -> tuple[RunSpec, RunSpec]:
    """Both runs start together, or the first pauses at ``gate`` while the second intrudes."""
    if gate is None:
        return replace(spec, role="together"), replace(spec, role="together")
    return replace(spec, role="paused", gate=gate), replace(spec, role="intruder")


def assert_outcomes(outcomes: list[RunOutcome], gate: str | None, root: Path) -> None:
    """A paused run and its intruder never overlap in a write, so both succeed. Runs started
    together do overlap: the last writer wins, and a run that reads the files (its blocking
    checks, its manifest) while the other is replacing them may fail, cleanly: a failed check
    or an error naming the file, never bad bytes."""
    assert [o.gated for o in outcomes] == [gate is not None, False]
    if gate is not None:
        assert [(o.success, o.errors) for o in outcomes] == [([True], [])] * 2
        return
    assert [True] in [o.success for o in outcomes]
    for outcome in outcomes:
        assert (outcome.success == [True]) == (outcome.errors == [])
        for error in outcome.errors:
            assert "DagsterAssetCheckFailedError" in error or str(root) in error, error


# -- 1. two runs of one partition -----------------------------------------------------------
def test_a_second_writer_leaves_a_live_writers_temp_alone(tmp_path: Path) -> None:
    """What two runs of one partition do to a file: the second writer's cleanup of temps left
    by killed writers must not take the first one's file in progress; both commit."""
    prefix = tmp_path / "x_text_document"
    first = IndexedDatasetWriter(prefix, np.uint16)
    first.add_document(np.arange(10))
    with IndexedDatasetWriter(prefix, np.uint16) as second:
        second.add_document(np.arange(10))
    first.finalize()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        TMP_DIR,
        f"{prefix.name}.bin",
        f"{prefix.name}.idx",
    ]


def test_only_temps_of_dead_writers_are_stale(tmp_path: Path) -> None:
    """A temp is left over when no process runs under its pid (a zombie counts as dead)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    final = tmp_path / "x.bin"
    names = {
        "mine": f"{os.getpid()}-0a0a",
        "zombie": f"{child.pid}-0b0b",
        "impossible": f"{2**22 + 1}-0c0c",  # above any pid_max
        "garbage": "x-0d0d",
    }
    tdir = tmp_path / TMP_DIR
    tdir.mkdir()
    for suffix in names.values():
        (tdir / f"x.bin{TMP_MARK}{suffix}").write_bytes(b"partial")
    assert {k: writer_alive(v) for k, v in names.items()} == {
        "mine": True, "zombie": False, "impossible": False, "garbage": False
    }  # fmt: skip
    remove_stale_temps(final)
    assert [p.name for p in tdir.iterdir()] == [f"x.bin{TMP_MARK}{names['mine']}"]
    child.wait()


@pytest.mark.parametrize("gate", [None, f"{SHARD}.parquet", f"{SHARD}_text_document.idx"])
def test_two_runs_of_one_shard_partition(runners: Workers, clean: Clean, gate: str | None) -> None:
    """Two shard-job runs of one partition, started together or one paused just before renaming
    ``gate`` while the other runs start to finish: both succeed, or one fails cleanly, and the
    clean build's bytes are left, with valid manifests and no temp file."""
    project = clean.project
    for path in sorted(project.root.rglob(f"{SHARD}*")):
        path.unlink()
    outcomes = runners.pair(*roles(project.spec("docs_shard_job", partitions=(SHARD,)), gate))
    assert_outcomes(outcomes, gate, project.root)
    prefix = project.root / "tokens" / "docs" / f"{SHARD}_text_document"
    assert check_dataset_files(prefix, full=True) == []
    assert temps(project.root) == []
    assert snapshot(project.root) == clean.files


@pytest.mark.parametrize("gate", [None, "/docs_text_document.manifest.json"])
def test_two_runs_of_the_merged_asset(runners: Workers, clean: Clean, gate: str | None) -> None:
    """``docs/merged`` and its Nanoset indices (shared cache under a flock) built by two runs at
    once, the same way: both succeed (or one fails cleanly), the result is the clean build's
    bytes."""
    project = clean.project
    shutil.rmtree(project.root / "merged")
    shutil.rmtree(project.root / "nanoset")
    outcomes = runners.pair(*roles(project.spec("refresh_job", assets=MERGED), gate))
    assert_outcomes(outcomes, gate, project.root)
    merged = pointer_target(project.root / "merged" / "docs" / "current.json")
    assert merged is not None and check_dataset_files(merged, full=True) == []
    assert temps(project.root) == []
    assert snapshot(project.root) == clean.files


def test_a_refresh_that_read_older_inputs_never_moves_the_pointer_back(
    runners: Workers, make_recipe: Callable[..., Recipe], tmp_path: Path
) -> None:
    """Refresh A of ``docs/merged`` reads two shards and pauses while writing its version; a
    third shard arrives and refresh B moves the pointer to the three-shard version. A then
    finishes its (complete, immutable) version, its compare-and-swap is refused, and its step
    runs again against B's pointer: its inputs are now B's, so it moves nothing and reports
    ``superseded_by``. The pointer never goes back to the two-shard version."""
    from dagster import AssetKey, DagsterInstance

    from assets.support.partitions import partitions_name

    project = new_project(make_recipe(), tmp_path / "dagster_home", ["part-00000", "part-00001"])
    first = runners.one(project.spec("docs_shard_job", partitions=("part-00000", "part-00001")))
    assert (first.success, first.errors) == ([True, True], [])
    pointer = project.root / "merged" / "docs" / "current.json"
    merged = project.spec("refresh_job", assets=(("docs", "merged"),))
    runners.reset()
    slow = runners.pool.submit(
        run_job, replace(merged, role="paused", gate="/docs_text_document.manifest.json")
    )
    assert runners.arrive.wait(TIMEOUT)  # A's version is written, not yet renamed into place
    source = Path(project.recipe.dataset("docs").source)
    shutil.copy(source / "part-00000.jsonl", source / "part-00003.jsonl")
    with DagsterInstance.from_config(str(project.home)) as instance:
        instance.add_dynamic_partitions(partitions_name("docs"), ["part-00003"])
    shard = runners.one(project.spec("docs_shard_job", partitions=("part-00003",)))
    fast = runners.one(merged)
    newer = pointer_version(pointer)
    runners.release.set()
    outcome = slow.result(TIMEOUT)
    assert (shard.success, fast.success) == ([True], [True])
    assert (outcome.success, outcome.errors, outcome.gated) == ([True], [], True)
    assert pointer_version(pointer) == newer
    assert read_dataset_manifest(pointer_target(pointer))["counts"]["sequences"] > 0
    with DagsterInstance.from_config(str(project.home)) as instance:
        event = instance.get_latest_materialization_event(AssetKey(["docs", "merged"]))
    assert event is not None and event.asset_materialization is not None
    metadata = event.asset_materialization.metadata
    assert metadata["superseded_by"].value == newer
    older = str(metadata["superseded_version"].value)
    assert older != newer
    # A's own version is complete and stays for pinned readers until gc
    older_prefix = project.root / "merged" / "docs" / older[:16] / "docs_text_document"
    assert check_dataset_files(older_prefix, full=True) == []
    assert temps(project.root) == []


# -- 2. sensor ticks during a backfill ------------------------------------------------------
class Ticker:
    """Evaluates the docs shard sensor as the daemon does: each tick from the last cursor, its
    partition requests applied; ``ticks`` holds the run keys each tick requested. After every
    tick the cursor must be the source's listing."""

    def __init__(self, project: Project, instance: Any) -> None:
        from pipelines.build import build_definitions

        self.project = project
        self.defs = build_definitions(project.recipe)
        self.instance = instance
        self.cursor: str | None = None
        self.ticks: list[list[str]] = []

    def tick(self, *, reset: bool = False) -> list[str]:
        from dagster import build_sensor_context

        sensor = self.defs.resolve_sensor_def("docs_shard_sensor")
        cursor = None if reset else self.cursor
        with build_sensor_context(
            instance=self.instance, cursor=cursor, definitions=self.defs
        ) as context:
            result = sensor(context)
        for request in result.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(
                request.partitions_def_name, list(request.partition_keys)
            )
        self.ticks.append([r.run_key for r in result.run_requests])
        self.cursor = result.cursor
        assert json.loads(result.cursor) == fingerprints(self.project)
        return self.ticks[-1]


def fingerprints(project: Project) -> dict[str, str]:
    """``{shard: fingerprint}`` of the docs source now."""
    from assets.support.sources import list_shards

    return list_shards(project.recipe.dataset("docs")).fingerprints()


def run_keys(project: Project, *keys: str) -> list[str]:
    """The run keys of ``keys`` at their content now (``shard:fingerprint``)."""
    now = fingerprints(project)
    return [f"{k}:{now[k]}" for k in keys]


def test_sensor_ticks_during_a_backfill(
    runners: Workers, clean: Clean, make_recipe: Callable[..., Recipe], tmp_path: Path
) -> None:
    """A backfill of two shards pauses in the second (its tokens written, not renamed); the
    sensor ticks meanwhile, a shard is added and the finished one changes. Each (shard,
    content) gets one run key, the cursor follows the source, the backfill is unaffected."""
    from dagster import DagsterInstance

    from assets.support.partitions import partitions_name
    from pipelines.sensors import range_run_key

    shards = [SHARD, "part-00000"]
    project = new_project(make_recipe(), tmp_path / "dagster_home", shards)
    source = Path(project.recipe.dataset("docs").source)
    with DagsterInstance.from_config(str(project.home)) as instance:
        ticker = Ticker(project, instance)
        now = fingerprints(project)
        first = [range_run_key({k: now[k] for k in shards})]  # two new shards: one range run
        assert ticker.tick() == first
        runners.reset()
        spec = project.spec("docs_shard_job", partitions=tuple(shards), role="paused")
        backfill = runners.pool.submit(run_job, replace(spec, gate="part-00000_text_document.bin"))
        assert runners.arrive.wait(TIMEOUT)  # the first shard is done, the second in flight
        assert ticker.tick() == []
        shutil.copy(source / "part-00000.jsonl", source / "part-00003.jsonl")
        with open(source / f"{SHARD}.jsonl", "ab") as fh:
            fh.write(b'{"text": "one more document"}\n')
        changed = run_keys(project, SHARD, "part-00003")
        assert ticker.tick() == changed
        # part-00003's run was requested, never launched here: still unrecorded, it is asked
        # for again under the same run key (the daemon launches a run key once); the shards
        # the backfill is running are in progress, not asked for
        pending = run_keys(project, "part-00003")
        assert ticker.tick() == pending
        runners.release.set()
        outcome = backfill.result(TIMEOUT)
        assert ticker.tick() == pending
        # With its cursor lost, the sensor asks only for what no successful run covers: the
        # two requests still pending (the same run keys, which the daemon does not launch
        # twice), not the shards the backfill finished.
        assert ticker.tick(reset=True) == changed
        partitions = instance.get_dynamic_partitions(partitions_name("docs"))

    assert (outcome.success, outcome.errors, outcome.gated) == ([True, True], [], True)
    requested = [key for tick in ticker.ticks[:-1] for key in tick]
    assert list(dict.fromkeys(requested)) == first + changed  # each run key, in order
    assert len(set(first + changed)) == 3  # the changed shard's new content has its own key
    assert sorted(partitions) == [*shards, "part-00003"]
    for key in shards:  # the backfill's work equals the clean build of the same shards
        prefix = project.root / "tokens" / "docs" / f"{key}_text_document"
        assert check_dataset_files(prefix, full=True) == []
        for rel in (f"tokens/docs/{key}_text_document.bin", f"hf/docs/data/{key}.parquet"):
            assert (project.root / rel).read_bytes() == clean.files[rel]
    assert temps(project.root) == []


# -- 3. 16 loader processes on a cold index cache -------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """Sixteen workers forked from this process once it has opened a blend elsewhere, so each
    starts with the loader imported and numba's kernels loaded (as ranks after their first
    step); the caches the tests open are cold all the same."""
    warm = tmp_path_factory.mktemp("warm")
    manifest = warm / "blends" / "mix" / "manifest.json"
    blend_digests(str(manifest), str(warm / "nanoset"), blend_settings(warm), wait=False)
    workers = start_pool(RANKS, LOADER, "fork")
    workers.start(RANKS)
    yield workers
    workers.pool.shutdown()


def open_everywhere(workers: Workers, *args: Any) -> list[RankReport]:
    workers.reset()
    futures = [workers.pool.submit(open_rank, *args) for _ in range(RANKS)]
    return [f.result(TIMEOUT) for f in futures]


def test_sixteen_ranks_open_one_cold_nanoset(ranks: Workers, tmp_path: Path) -> None:
    """``open_nanoset`` in 16 processes at once on an empty cache: one build, the reference
    arrays, read identically everywhere."""
    from tokenmill.indices.nanoset import build_nanoset_indices, split_ranges
    from tokenmill.loader import open_nanoset

    prefix = make_dataset(tmp_path / "data" / "docs_text_document", seed=1)
    cache = tmp_path / "cache"
    settings = {"split": "train", "sequence_length": 16, "num_samples": 3000, "seed": 5}
    reports = open_everywhere(ranks, "nanoset", str(prefix), str(cache), settings)

    assert len({r.pid for r in reports}) == RANKS
    assert sum(len(r.builds) for r in reports) == 1
    assert len(list(cache.glob("*-description.json"))) == 1
    assert all(r.digests == reports[0].digests for r in reports)
    mine = open_nanoset(prefix, index_of(prefix, cache, **settings))  # what ranks built
    want = build_nanoset_indices(
        np.asarray(mine.data.sequence_lengths),
        split_ranges("949,50,1", 300, "megatron")[0],
        sequence_length=16,
        seed=5,
        num_samples=3000,
    )
    for array, expected in zip(
        (mine.document_index, mine.sample_index, mine.shuffle_index), want, strict=True
    ):
        np.testing.assert_array_equal(array, expected)
    assert temps(tmp_path) == []


def test_sixteen_ranks_build_and_open_one_cold_blend(ranks: Workers, tmp_path: Path) -> None:
    """``build_blend`` then ``open_blend`` in 16 processes at once on an empty cache: each
    dataset split's index is built once, and every rank reads what one process alone builds."""
    from tokenmill.verify import verify_blend

    manifest = tmp_path / "blends" / "mix" / "manifest.json"
    cache = tmp_path / "nanoset"
    settings = blend_settings(tmp_path)
    reports = open_everywhere(ranks, "blend", str(manifest), str(cache), settings)

    assert len({r.pid for r in reports}) == RANKS
    entries = list(cache.glob("*-description.json"))
    assert len(entries) == 4  # two datasets x (train, valid), each built exactly once
    assert sum(len(r.builds) for r in reports) == len(entries)
    assert all(r.digests == reports[0].digests for r in reports)
    alone = tmp_path / "alone" / "manifest.json"
    assert blend_digests(str(alone), str(tmp_path / "alone-cache"), settings, wait=False) == (
        reports[0].digests
    )
    assert verify_blend(manifest, full=True) == []
    assert temps(tmp_path) == []


def test_opening_a_blend_while_it_is_refreshed_gives_the_previous_version(
    tmp_path: Path,
) -> None:
    """A refresh writes its new version first and moves the pointer last: a reader meanwhile
    opens the previous version whole (its batches, its version), never a mix; afterwards the
    new one, and the previous one still opens by its version."""
    from tokenmill.loader import open_blend

    settings = blend_settings(tmp_path)
    out, cache = tmp_path / "blends" / "mix", tmp_path / "nanoset"
    blend_from(out, cache, settings)
    old = open_blend(out / "manifest.json")
    before = old.get_batch(np.arange(50))
    arrive, release = threading.Event(), threading.Event()

    def refresh() -> None:
        with gated_commits("mix/manifest.json", lambda: (arrive.set(), release.wait(TIMEOUT))):
            blend_from(out, cache, {**settings, "seed": 99})

    builder = threading.Thread(target=refresh)
    builder.start()
    try:
        assert arrive.wait(TIMEOUT)  # the new version is complete, the pointer not yet moved
        assert len([p for p in (out / "versions").iterdir() if p.name != TMP_DIR]) == 2
        meanwhile = open_blend(out / "manifest.json")
        assert meanwhile.version == old.version
        np.testing.assert_array_equal(meanwhile.get_batch(np.arange(50)), before)
    finally:
        release.set()
        builder.join(TIMEOUT)
    new = open_blend(out / "manifest.json")
    assert new.version != old.version
    assert not np.array_equal(new.get_batch(np.arange(50)), before)
    np.testing.assert_array_equal(
        open_blend(out / "manifest.json", version=old.version).get_batch(np.arange(50)), before
    )
