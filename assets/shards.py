"""What every shard-partitioned asset shares: its concurrency pool, its backfill policy, and one
result for a step that processed one shard (a sensor run) or several (a backfill run).

A backfill of K shards launches ``ceil(K / PARTITIONS_PER_BACKFILL_RUN)`` runs, each over a
range of shards, instead of K runs: a run's start-up (process, code location, resources,
Postgres bookkeeping) is paid once per range. Sensor and ``tokenmill materialize`` runs use the
same ranges. In a range run each shard asset and each shard check handles every key of
``context.partition_keys``; Dagster records one materialization per shard, all carrying the
step's metadata (totals, and a per-shard table) plus the shard's own recorded entries, and one
check evaluation for the range.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetExecutionContext,
    AssetsDefinition,
    BackfillPolicy,
    BetaWarning,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.support.sources import ShardFile, find_shard
from assets.support.staleness import range_data_version
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
T = TypeVar("T")
R = TypeVar("R")
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


def source_shards(
    ds: DatasetConfig, keys: list[str], endpoint_url: str | None
) -> dict[str, ShardFile]:
    """The source file of each of ``keys``, each looked up alone (work per shard, never a
    listing of the whole source); a key no longer there fails as ``find_shard`` words it."""
    return {key: find_shard(ds, key, endpoint_url) for key in keys}


def per_shard(shards: Mapping[str, T], work: Callable[[T], R]) -> dict[str, R]:
    """``{key: work(shard)}``. In a range step an exception on one shard fails the step as a
    Dagster ``Failure`` naming that shard in its metadata (``shard``) and its cause in its
    description, so ``tokenmill materialize`` and the UI report the shard from structured data;
    a one-shard step raises the exception itself (its partition key names the shard)."""
    if len(shards) == 1:
        return {key: work(shard) for key, shard in shards.items()}
    out = {}
    for key, shard in shards.items():
        try:
            out[key] = work(shard)
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
            raise Failure(description=cause, metadata={"shard": key}) from exc
    return out


def _summable(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def step_result(
    context: AssetExecutionContext,
    per_shard: Mapping[str, Mapping[str, Any]],
    *,
    recorded: Sequence[str] = (),
    data_versions: Mapping[str, str] | None = None,
) -> MaterializeResult:
    """One shard: its metadata as is. Several: the ``ADDITIVE`` counts summed and a ``shards``
    table of every shard's numeric entries (per-file entries such as paths are left out), and
    each shard's own ``recorded`` entries on its own materialization (what the staleness model,
    ``assets/support/staleness.py``, reads back). ``data_versions`` (shard -> content hash)
    gives the step its ``DataVersion``."""
    version = range_data_version(data_versions) if data_versions else None
    first = next(iter(per_shard.values()))
    if len(per_shard) == 1:
        return MaterializeResult(metadata=dict(first), data_version=version)
    for key, meta in per_shard.items():
        own = {name: meta[name] for name in recorded if name in meta}
        if own:
            context.add_asset_metadata(own, partition_key=key)
    names = [n for n, v in first.items() if _summable(v)]
    totals = {n: sum(meta[n] for meta in per_shard.values()) for n in names if n in ADDITIVE}
    rows = [f"| shard | {' | '.join(names)} |", "|---|" + "---:|" * len(names)]
    for key, meta in per_shard.items():
        rows.append(f"| {key} | {' | '.join(str(meta[n]) for n in names)} |")
    return MaterializeResult(
        metadata={
            **totals,
            "shards_in_run": len(per_shard),
            "shards": MetadataValue.md("\n".join(rows)),
        },
        data_version=version,
    )


def each_shard(
    context: AssetCheckExecutionContext, check: Callable[[str], AssetCheckResult]
) -> AssetCheckResult:
    """Run a shard check for every shard of the step: one shard gives its own result; a range
    passes when every shard passes, with each failing shard's problems prefixed by its key."""
    keys = context.partition_keys
    if len(keys) == 1:
        return check(keys[0])
    results = {key: check(key) for key in keys}
    problems = [
        f"{key}: {line}"
        for key, result in results.items()
        if not result.passed
        for line in str(result.metadata["problems"].value).splitlines()
    ]
    failed = [key for key, result in results.items() if not result.passed]
    return AssetCheckResult(
        passed=not failed,
        metadata={
            "shards_in_run": len(keys),
            "failed_shards": MetadataValue.json(failed),  # what ``materialize`` reports
            "problems": "\n".join(problems) or "none",
        },
    )
