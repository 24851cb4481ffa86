"""Every use of Dagster's private API (``dagster._…`` modules, non-``@public`` methods) in the
code location, in one place, behind a version guard.

Each helper says why no public API does its work. Importing this module on a Dagster version
other than the ones tested (``TESTED_DAGSTER``) fails at once with a message naming the
installed and the tested versions: private behaviour may change in any release, and a silent
change here (a renamed tag, a reordered write) would corrupt run bookkeeping, not crash.
"""

from __future__ import annotations

import dagster
from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetKey,
    AssetRecordsFilter,
    DagsterInstance,
    DagsterRun,
)

# The Dagster releases this module was checked against (pyproject pins the first).
TESTED_DAGSTER = ("1.13.27",)


class UntestedDagsterError(ImportError):
    """The installed Dagster is not one this module's private uses were tested with."""


def check_dagster_version(version: str = dagster.__version__) -> None:
    """Refuse a Dagster release the private uses below were not tested with."""
    if version not in TESTED_DAGSTER:
        raise UntestedDagsterError(
            f"tokenmill's Dagster code location was tested with dagster "
            f"{', '.join(TESTED_DAGSTER)}, found {version}: assets/support/dagster_private.py "
            "relies on Dagster internals that may have changed; install a tested version "
            "(pip install 'dagster==" + TESTED_DAGSTER[0] + "') or re-check that module and "
            "add the version to TESTED_DAGSTER"
        )


check_dagster_version()

# Private imports come after the guard, so that an untested version fails with its message
# rather than with an ImportError from a module Dagster moved.
from dagster._core.definitions.asset_checks.asset_check_evaluation import (  # noqa: E402
    AssetCheckEvaluationTargetMaterializationData,
)


def log_partition_check(
    context: AssetCheckExecutionContext, key: str, result: AssetCheckResult
) -> None:
    """Record ``result`` as the evaluation of the step's check for partition ``key``.

    A check step over a range of partitions returns one ``AssetCheckResult``, which Dagster
    1.13 records with no partition; the partitions it planned stay unevaluated and the UI lists
    them as "Skipped" while the check's detail says "Passed". No public API records a
    per-partition evaluation from a range step: the step context (``op_execution_context``) and
    the evaluation's target-materialization record (what makes the partition's status current
    against its latest materialization) are private.
    """
    [spec] = context.check_specs
    latest = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=spec.asset_key, asset_partitions=[key]), limit=1
    ).records
    target = (
        AssetCheckEvaluationTargetMaterializationData(
            storage_id=latest[0].storage_id,
            run_id=latest[0].run_id,
            timestamp=latest[0].timestamp,
        )
        if latest
        else None
    )
    evaluation = AssetCheckEvaluation(
        asset_key=AssetKey(spec.asset_key.path),
        check_name=spec.name,
        passed=result.passed,
        metadata=dict(result.metadata),
        target_materialization_data=target,
        severity=result.severity,
        description=result.description,
        blocking=spec.blocking,
        partition=key,
    )
    context.op_execution_context.log_event(evaluation)


def set_run_tags(instance: DagsterInstance, run_id: str, tags: dict[str, str]) -> None:
    """Add or overwrite tags of an existing run (a run lease's renewal). ``add_run_tags`` is the
    instance method Dagster's own daemons use; it is not marked ``@public``."""
    instance.add_run_tags(run_id, tags)


def mark_run_failed(instance: DagsterInstance, run: DagsterRun, reason: str) -> None:
    """Fail an unfinished run whose process is gone, with ``reason`` as its failure message,
    the way Dagster's run monitoring does (``report_run_failed``, not ``@public``): the run's
    status and a ``RUN_FAILURE`` event in one call."""
    instance.report_run_failed(run, reason)
