"""What every shard-partitioned asset shares: its concurrency pool, its backfill policy, and one
result for a step that processed one shard (a sensor run) or several (a backfill run).

A backfill of K shards launches ``ceil(K / PARTITIONS_PER_BACKFILL_RUN)`` runs, each over a
range of shards, instead of K runs: a run's start-up (process, code location, resources,
Postgres bookkeeping) is paid once per range. Sensor and ``tokenmill materialize`` runs use the
same ranges. In a range run each shard asset and each shard check handles every key of
``context.partition_keys``; Dagster records one materialization per shard with that shard's
own metadata (the range's totals go to the run's log), and a check records one evaluation per
shard plus one for the range.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetMaterialization,
    AssetObservation,
    AssetsDefinition,
    BackfillPolicy,
    BetaWarning,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.support.dagster_private import log_partition_check
from assets.support.sources import find_shard
from assets.support.staleness import (
    DATA_VERSION_TAG,
    DATA_VERSION_USER_TAG,
    FAILED,
    RECORDED_ALONE,
    range_data_version,
)
from tokenmill.errors import TokenmillError
from tokenmill.recipe import DatasetConfig

# Pools bound how many steps of a kind run at once across all runs. Reading and validating a
# source shard and writing its Parquet (I/O against the source store) is one kind; tokenizing
# (CPU) the other. Their limit is ``concurrency.pools.default_limit`` of the instance
# (infra/dagster.yaml, infra/ecs/dagster.yaml, infra/helm/values.yaml) unless set per pool with
# ``dagster instance concurrency set <pool> <limit>``.
INGEST_POOL = "tokenmill_ingest"
TOKENIZE_POOL = "tokenmill_tokenize"
POOLS = {"raw_jsonl": INGEST_POOL, "hf_dataset": INGEST_POOL, "tokens": TOKENIZE_POOL}
PARTITIONS_PER_BACKFILL_RUN = 16
# Metadata entries that add up over shards (rates, hashes and paths do not).
ADDITIVE = (
    "lines",
    "documents",
    "blank",
    "quarantined",
    "empty_documents",
    "sequences",
    "tokens",
    "bytes",
)


def backfill_policy() -> BackfillPolicy:
    """The shard assets' policy: backfills batch up to ``PARTITIONS_PER_BACKFILL_RUN`` shards
    per run."""
    return BackfillPolicy.multi_run(max_partitions_per_run=PARTITIONS_PER_BACKFILL_RUN)


def shard_asset(stage: str, **kwargs: Any) -> Callable[[Callable[..., Any]], AssetsDefinition]:
    """``@asset(**kwargs)`` for a shard stage, with its pool and the backfill policy. Dagster
    1.13 labels ``backfill_policy`` beta; we rely on it deliberately, so its warning is not news.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*backfill_policy.*", category=BetaWarning)
        return asset(**kwargs, pool=POOLS[stage], backfill_policy=backfill_policy())


def source_fingerprint(ds: DatasetConfig, key: str, endpoint_url: str | None) -> str | None:
    """The fingerprint of a shard's source file now (None if it cannot be found): what a
    failed shard is recorded against, so the sensor runs it again once the file changes."""
    try:
        return find_shard(ds, key, endpoint_url).fingerprint
    except TokenmillError:
        return None


def _summable(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def range_table(per_shard: Mapping[str, Mapping[str, Any]]) -> str:
    """The ``ADDITIVE`` totals of a range and a markdown table of every shard's numeric
    entries: what the run's log says about a range step (each shard's page has its own)."""
    first = next(iter(per_shard.values()))
    names = [n for n, v in first.items() if _summable(v)]
    totals = {n: sum(meta[n] for meta in per_shard.values()) for n in names if n in ADDITIVE}
    rows = [f"| shard | {' | '.join(names)} |", "|---|" + "---:|" * len(names)]
    for key, meta in per_shard.items():
        rows.append(f"| {key} | {' | '.join(str(meta.get(n, '')) for n in names)} |")
    head = ", ".join(f"{n} {v:,}" for n, v in totals.items())
    return f"{len(per_shard)} shards in this run: {head}\n" + "\n".join(rows)


def shard_step(
    context: AssetExecutionContext,
    work: Callable[[str], Mapping[str, Any]],
    *,
    fingerprint: Callable[[str], str | None],
) -> MaterializeResult:
    """:func:`process_shards` then :func:`shard_result`: for a step whose shards each stage
    their own workspace."""
    done, failed = process_shards(context, work, fingerprint=fingerprint)
    return shard_result(context, done, failed)


def process_shards(
    context: AssetExecutionContext,
    work: Callable[[str], Mapping[str, Any]],
    *,
    fingerprint: Callable[[str], str | None],
) -> tuple[dict[str, Mapping[str, Any]], dict[str, Exception]]:
    """Run ``work`` (one shard's processing; its metadata) for every shard of the step, each
    on its own: ``(metadata of the good shards, error of the failed ones)``. A failed shard is
    recorded at once by an observation on its partition (:data:`FAILED`: the source
    fingerprint it read, and the error), which the shard sensor reads to wait for its file to
    change; a step of one shard raises that shard's own error. A step whose shards share a
    workspace calls this inside it and :func:`shard_result` after it, so that the good
    shards' files are uploaded before the step fails."""
    done: dict[str, Mapping[str, Any]] = {}
    failed: dict[str, Exception] = {}
    ranged = len(context.partition_keys) > 1
    for key in context.partition_keys:
        try:
            done[key] = work(key)
        except Exception as exc:  # recorded, then raised again (alone, or in the Failure)
            metadata = {FAILED: fingerprint(key) or "unknown", "error": _error(exc)}
            context.log_event(AssetObservation(context.asset_key, partition=key, metadata=metadata))
            if not ranged:
                raise
            context.log.exception(f"{key}: {exc}")  # each failure's traceback once
            failed[key] = exc
    return done, failed


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def shard_result(
    context: AssetExecutionContext,
    done: Mapping[str, Mapping[str, Any]],
    failed: Mapping[str, Exception],
    *,
    version: str | None = None,
) -> MaterializeResult:
    """The step's result over :func:`process_shards`' outcome. Every shard's materialization
    carries its own metadata (counts, path, histogram, ...); the range's totals go to the run's
    log. ``version`` names the metadata entry that is a shard's data version (one hash over the
    range for a range step: Dagster gives a step's output one data version). When a shard
    failed, each good shard is recorded by a materialization of its own (its own data version),
    and the step fails with the failed keys in its structured metadata (``failed_shards``,
    ``errors``, ``recorded_shards``)."""
    versions = {k: str(meta[version]) for k, meta in done.items()} if version else {}
    if not failed:
        if len(done) == 1:
            [(key, meta)] = done.items()
            data_version = DataVersion(versions[key]) if versions else None
            return MaterializeResult(metadata=dict(meta), data_version=data_version)
        for key, meta in done.items():
            context.add_asset_metadata(dict(meta), partition_key=key)
        context.log.info(range_table(done))
        data_version = range_data_version(versions) if versions else None
        return MaterializeResult(data_version=data_version)
    for key, meta in done.items():
        tags = {RECORDED_ALONE: "true"}
        if versions:
            tags.update({DATA_VERSION_TAG: versions[key], DATA_VERSION_USER_TAG: "true"})
        context.log_event(
            AssetMaterialization(context.asset_key, partition=key, metadata=dict(meta), tags=tags)
        )
    if done:
        context.log.info(range_table(done))
    errors = {key: _error(exc) for key, exc in failed.items()}
    # The cause alone for one failed shard (the summary prefixes shard and step); each shard's
    # cause for several.
    causes = list(errors.values()) if len(errors) == 1 else [f"{k}: {e}" for k, e in errors.items()]
    raise Failure(
        description="; ".join(causes),
        metadata={
            "shard": next(iter(failed)),  # the first failed one (what runs of one shard name)
            "failed_shards": MetadataValue.json(list(failed)),
            "errors": MetadataValue.json(errors),
            "recorded_shards": MetadataValue.json(list(done)),
        },
    ) from next(iter(failed.values()))


def each_shard(
    context: AssetCheckExecutionContext, check: Callable[[str], AssetCheckResult]
) -> AssetCheckResult:
    """Run a shard check for every shard of the step: one shard gives its own result; a range
    passes when every shard passes, with each failing shard's problems prefixed by its key, at
    the worst severity among them (a WARN check stays a warning). Each shard's own result is
    recorded on its partition too, so the check's partition list and its latest evaluation agree.
    """
    keys = context.partition_keys
    if len(keys) == 1:
        return check(keys[0])
    results = {key: check(key) for key in keys}
    for key, result in results.items():  # each partition's own status (the UI's check list)
        log_partition_check(context, key, result)
    failing = {key: r for key, r in results.items() if not r.passed}
    problems = [
        f"{key}: {line}"
        for key, result in failing.items()
        for line in str(result.metadata["problems"].value).splitlines()
    ]
    warn = all(r.severity == AssetCheckSeverity.WARN for r in failing.values())
    return AssetCheckResult(
        passed=not failing,
        severity=AssetCheckSeverity.WARN if failing and warn else AssetCheckSeverity.ERROR,
        metadata={
            "shards_in_run": len(keys),
            "failed_shards": MetadataValue.json(list(failing)),  # what ``materialize`` reports
            "problems": "\n".join(problems) or "none",
        },
    )
