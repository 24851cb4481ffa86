"""Entry points of the concurrency tests' worker processes (module-level, so spawned workers
can import them): Dagster runs on a shared SQLite instance, with a gate that can stop a run just
before it renames one artifact into place, and training ranks opening a cold index cache.

A pool (:func:`start_pool`, driven through :class:`Workers`) starts each worker with
:func:`start_worker`, which keeps the synchronization objects the tasks use: ``barrier`` (runs
or ranks start together), ``arrive``/``release`` (a paused run has its temp file written and
waits; the other party acts meanwhile, then lets it go).
"""

from __future__ import annotations

import hashlib
import importlib
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import numpy as np
from tiny_pairs import blend_values, index_of, random_dataset

WAIT_SECONDS = 120.0  # far above any run here: a timeout means a deadlock, reported as such
TIMEOUT = 2 * WAIT_SECONDS  # for the test process waiting on a worker's result
CODE_LOCATION = Path(__file__).resolve().parents[2]

_sync: dict[str, Any] = {}


def start_worker(
    barrier: Barrier, arrive: Event, release: Event, code_location: str, warm: tuple[str, ...]
) -> None:
    """Pool initializer: keep the shared events, put the code location (``assets``,
    ``pipelines``) on the path, and import ``warm`` once instead of in every task."""
    _sync.update(barrier=barrier, arrive=arrive, release=release)
    if code_location not in sys.path:
        sys.path.insert(0, code_location)
    for name in warm:
        importlib.import_module(name)


def ready() -> int:
    """Meet the other workers at the barrier (so the pool starts them all now); this pid."""
    _sync["barrier"].wait(WAIT_SECONDS)
    return os.getpid()


@dataclass(frozen=True)
class RunSpec:
    """Runs of ``job``, one per partition in ``partitions`` (a single run when empty) or of the
    ``assets`` it selects, and how they meet the other party. ``role``: ``alone``, ``together``
    (start at the barrier), ``paused`` (stop before renaming the first file whose path ends with
    ``gate`` until released) or ``intruder`` (start once the paused run waits, release it when
    done). Shard runs carry the tags a shard sensor gives them (source fingerprint)."""

    recipe: str
    home: str
    job: str
    partitions: tuple[str, ...] = ()
    assets: tuple[tuple[str, ...], ...] = ()
    role: str = "alone"
    gate: str = ""


@dataclass
class RunOutcome:
    """What a worker reports: one success flag per run, the step errors, whether it paused."""

    success: list[bool] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    gated: bool = False


@contextmanager
def gated_commits(suffix: str, on_gate: Callable[[], None]) -> Iterator[list[bool]]:
    """Within the block, the first ``commit`` of a path ending in ``suffix`` calls ``on_gate``
    before renaming; the yielded list gets True once that happened."""
    from tokenmill import atomic as _atomic

    real = _atomic.commit
    hit: list[bool] = []

    def gated(tmp: Any, final: Any) -> None:
        if not hit and os.fspath(final).endswith(suffix):
            hit.append(True)
            on_gate()
        real(tmp, final)

    patched = [m for m in list(sys.modules.values()) if getattr(m, "commit", None) is real]
    for module in patched:
        module.commit = gated
    try:
        yield hit
    finally:
        for module in patched:
            module.commit = real


def _wait(event: Event, what: str) -> None:
    if not event.wait(WAIT_SECONDS):
        raise TimeoutError(f"gave up after {WAIT_SECONDS} s waiting for {what}")


def _pause() -> None:
    _sync["arrive"].set()
    _wait(_sync["release"], "the release of the paused run")


def run_job(spec: RunSpec) -> RunOutcome:
    """Execute the runs of ``spec`` on the instance at ``spec.home``. A failed run does not
    raise: its step errors are reported, so the caller sees what both parties did."""
    gate: AbstractContextManager[list[bool]] = nullcontext([])
    if spec.role == "paused":
        gate = gated_commits(spec.gate, _pause)
    try:
        with gate as hit:
            outcome = _execute(spec)
        outcome.gated = bool(hit)
        return outcome
    finally:
        if spec.role == "intruder":
            _sync["release"].set()
        if spec.role == "paused":  # the gate never shut (or a run failed first): don't block
            _sync["arrive"].set()


def _meet(role: str) -> None:
    """Where the runs of ``role`` wait for the other party, just before their first run."""
    if role == "together":
        _sync["barrier"].wait(WAIT_SECONDS)
    if role == "intruder":
        _wait(_sync["arrive"], "the paused run to reach its gate")


def _execute(spec: RunSpec) -> RunOutcome:
    from dagster import AssetKey, DagsterInstance, DagsterRunStatus

    from assets.support.sources import list_shards
    from pipelines.build import build_definitions
    from pipelines.sensors import shard_tags
    from tokenmill.recipe import load_recipe

    recipe = load_recipe(Path(spec.recipe))
    job = build_definitions(recipe).resolve_job_def(spec.job)
    selection = [AssetKey(list(k)) for k in spec.assets] or None
    dataset = spec.job.removesuffix("_shard_job")
    listing = list_shards(recipe.dataset(dataset)).shards if spec.partitions else {}
    outcome = RunOutcome()
    with DagsterInstance.from_config(spec.home) as instance:
        _meet(spec.role)
        for key in spec.partitions or (None,):
            tags = {} if key is None else shard_tags(dataset, key, listing[key].fingerprint)
            result = job.execute_in_process(
                instance=instance,
                partition_key=key,
                asset_selection=selection,
                tags=tags,
                raise_on_error=False,
                run_config={"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}},
            )
            record = instance.get_run_by_id(result.run_id)
            ok = record is not None and record.status == DagsterRunStatus.SUCCESS
            outcome.success.append(result.success and ok)
            outcome.errors += [_step_error(e) for e in result.all_events if e.is_step_failure]
    return outcome


def _step_error(event: Any) -> str:
    """The innermost error message of a step failure (Dagster wraps the asset's exception)."""
    error = event.event_specific_data.error
    while error.cause is not None:
        error = error.cause
    return f"{event.step_key}: {error.cls_name}: {error.message.strip()}"


@dataclass(frozen=True)
class RankReport:
    """A rank's pid, the index computations it ran (their number of sequences), and the sha256
    of everything it read."""

    pid: int
    builds: list[int]
    digests: dict[str, str]


def open_rank(kind: str, target: str, cache_dir: str, settings: dict[str, Any]) -> RankReport:
    """One training rank: wait for every rank, then open ``target`` through the loader, building
    the cold cache if it gets there first. ``kind`` is ``nanoset`` (``open_nanoset``) or
    ``blend`` (``build_blend`` of the blend manifest ``target``, then ``open_blend``)."""
    from tokenmill.indices import nanoset

    real = nanoset.compute_indices
    builds: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        builds.append(len(args[0]))
        return real(*args, **kwargs)

    nanoset.compute_indices = counting
    _sync["barrier"].wait(WAIT_SECONDS)
    try:
        if kind == "nanoset":
            return RankReport(os.getpid(), builds, _nanoset_digests(target, cache_dir, settings))
        return RankReport(os.getpid(), builds, blend_digests(target, cache_dir, settings))
    finally:
        nanoset.compute_indices = real


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _nanoset_digests(prefix: str, cache_dir: str, settings: dict[str, Any]) -> dict[str, str]:
    from tokenmill.loader import open_nanoset

    ds = open_nanoset(prefix, index_of(prefix, cache_dir, **settings), verify="full")
    return {
        "document_index": _digest(ds.document_index),
        "sample_index": _digest(ds.sample_index),
        "shuffle_index": _digest(ds.shuffle_index),
        "samples": _digest(ds.get_batch(np.arange(len(ds)))),
    }


def blend_digests(
    manifest: str, cache_dir: str, settings: dict[str, Any], *, wait: bool = True
) -> dict[str, str]:
    """Every rank builds the blend (index caches built once, under their locks), waits for all
    (``wait``), then opens it: a rebuild hides the manifest, so nobody opens during one."""
    from tokenmill.loader import open_blend

    blend_from(Path(manifest).parent, cache_dir, settings)
    if wait:
        _sync["barrier"].wait(WAIT_SECONDS)
    digests = {}
    for split in ("train", "valid"):
        ds = open_blend(manifest, split=split, verify="full")
        digests[f"{split}/dataset_index"] = _digest(ds.dataset_index)
        digests[f"{split}/dataset_sample_index"] = _digest(ds.dataset_sample_index)
        digests[f"{split}/samples"] = _digest(ds.get_batch(np.arange(len(ds))))
    return digests


# -- the pool, as the tests drive it ------------------------------------------------------
@dataclass
class Workers:
    """Warm worker processes and the objects that order what they do."""

    pool: ProcessPoolExecutor
    barrier: Barrier
    arrive: Event
    release: Event

    def reset(self) -> None:
        self.barrier.reset()
        self.arrive.clear()
        self.release.clear()

    def start(self, size: int) -> None:
        """Start all ``size`` workers now, side by side, instead of one per first task."""
        self.reset()
        pids = [f.result(TIMEOUT) for f in [self.pool.submit(ready) for _ in range(size)]]
        assert len(set(pids)) == size

    def one(self, spec: RunSpec) -> RunOutcome:
        return self.pool.submit(run_job, spec).result(TIMEOUT)

    def pair(self, first: RunSpec, second: RunSpec) -> list[RunOutcome]:
        """Both at once, in different workers (each blocks until the other has started)."""
        self.reset()
        futures = [self.pool.submit(run_job, first), self.pool.submit(run_job, second)]
        return [f.result(TIMEOUT) for f in futures]


def start_pool(size: int, warm: tuple[str, ...], method: str = "spawn") -> Workers:
    """``size`` worker processes sharing a barrier of ``size`` and one arrive/release pair,
    started with ``method`` (``spawn``: fresh interpreters; ``fork``: copies of this process)."""
    ctx = multiprocessing.get_context(method)
    barrier, arrive, release = ctx.Barrier(size), ctx.Event(), ctx.Event()
    args = (barrier, arrive, release, str(CODE_LOCATION), warm)
    pool = ProcessPoolExecutor(size, ctx, initializer=start_worker, initargs=args)
    return Workers(pool, barrier, arrive, release)


# -- data for the ranks ---------------------------------------------------------------------
def make_dataset(prefix: Path, seed: int) -> Path:
    """A random token dataset of 300 documents with its manifest (as tokenize leaves it)."""
    return random_dataset(
        prefix, 300, seed, kind="tokens", lengths=(1, 80), vocab=50000, counted=True
    )


def blend_from(output_dir: Path, cache_dir: str | Path, settings: dict[str, Any]) -> Any:
    """``build_blend`` of a :func:`blend_settings` dict (plain values: they cross processes)."""
    from tokenmill.indices.blend_build import build_blend

    kw = dict(settings)
    name, datasets = kw.pop("name"), kw.pop("datasets")
    return build_blend(name, datasets, output_dir, cache_dir, blend_values(**kw))


def blend_settings(root: Path) -> dict[str, Any]:
    """``build_blend`` arguments for a 70/30 blend of two datasets made under ``root``."""
    datasets = {
        name: str(make_dataset(root / "merged" / f"{name}_text_document", seed=i))
        for i, name in enumerate(("docs", "code"), start=2)
    }
    return {
        "name": "mix",
        "datasets": datasets,
        "weights": {"docs": 0.7, "code": 0.3},
        "sequence_length": 16,
        "split_spec": "90,10,0",
        "train_samples": 2000,
        "valid_samples": 100,
    }
