"""Every use of Dagster's private API (``dagster._…`` modules, non-``@public`` methods) in the
code location, in one place, behind a version guard.

Each helper says why no public API does its work. Importing this module on a Dagster version
other than the ones tested (``TESTED_DAGSTER``) fails at once with a message naming the
installed and the tested versions: private behaviour may change in any release, and a silent
change here (a renamed tag, a reordered write) would corrupt run bookkeeping, not crash.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import dagster
from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
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
from dagster._core.instance.ref import InstanceRef  # noqa: E402
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, WILL_RETRY_TAG  # noqa: E402

FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}


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
    # log_event records an AssetCheckEvaluation too; its annotation leaves the type out.
    context.op_execution_context.log_event(evaluation)  # type: ignore[arg-type]


def set_run_tags(instance: DagsterInstance, run_id: str, tags: dict[str, str]) -> None:
    """Add or overwrite tags of an existing run (a run lease's renewal). ``add_run_tags`` is the
    instance method Dagster's own daemons use; it is not marked ``@public``."""
    instance.add_run_tags(run_id, tags)


def mark_run_failed(instance: DagsterInstance, run: DagsterRun, reason: str) -> None:
    """Fail an unfinished run whose process is gone, with ``reason`` as its failure message,
    the way Dagster's run monitoring does (``report_run_failed``, not ``@public``): the run's
    status and a ``RUN_FAILURE`` event in one call."""
    instance.report_run_failed(run, reason)


def latest_storage_ids(
    instance: DagsterInstance, key: AssetKey, kind: DagsterEventType, partitions: Iterable[str]
) -> dict[str, int]:
    """The storage id of the latest event of ``kind`` for each of ``partitions``, in one query
    (the public ``fetch_materializations`` needs one query per partition: 10k shards, 10k
    queries). Not ``@public``; storages may answer for more partitions than asked."""
    wanted = set(partitions)
    found = instance.get_latest_storage_id_by_partition(key, kind, wanted)
    return {p: i for p, i in found.items() if p in wanted}


def pool_slots(instance: DagsterInstance, pool: str) -> tuple[int, bool, set[str]]:
    """``(slot count, whether it is the default limit, run ids holding or queued for a slot)``
    of a pool. A queued step counts: Dagster assigns a slot and claims it in two commits, so a
    run killed between them holds the slot through its assigned step alone. Per-pool limits can
    only be read and set on the event log storage (``dagster instance concurrency`` does the
    same); ``dagster.yaml`` cannot name them."""
    info = instance.event_log_storage.get_concurrency_info(pool)
    runs = {s.run_id for s in info.claimed_slots} | {s.run_id for s in info.pending_steps}
    return info.slot_count, info.using_default_limit, runs


def set_pool_slots(instance: DagsterInstance, pool: str, slots: int) -> None:
    """Set a pool's limit (see :func:`pool_slots`)."""
    instance.event_log_storage.set_concurrency_slots(pool, slots)


def free_pool_slots(instance: DagsterInstance, run_id: str) -> None:
    """Free the slots a run that ended still claims or was assigned (see :func:`pool_slots`)."""
    instance.event_log_storage.free_concurrency_slots_for_run(run_id)


class RetrySafeInstance(DagsterInstance):
    """``DagsterInstance`` that marks a run failed (retry decision first) before storing its
    ``RUN_FAILURE`` event; everything else is Dagster's own handling.

    Dagster 1.13 stores a ``RUN_FAILURE`` event first and only then sets the run's status and
    its ``dagster/will_retry`` tag, in separate commits. The retry daemon
    (``EventLogConsumerDaemon``) reads new failure events past a cursor every 5 s and then the
    runs they belong to: a read that falls between those commits finds the run still
    ``STARTED``, retries nothing, and moves its cursor past the event for good. The run then
    ends ``FAILURE`` with ``will_retry=true`` and no retry, and a backfill holding it waits
    forever ("retries have not been launched"). This writes the retry decision and then the
    failed status before the event, so whoever sees the event sees a failed run with its
    decision; Dagster's second decision, made after the event is stored, keeps "true" for a
    run whose retry the daemon has already created. Private: the retry tag names, the
    instance's ``handle_new_event``/``_should_retry_run``/``run_storage``;
    ``tests/docker/test_retry_order.py`` reproduces the race against the installed version and
    fails once Dagster fixes the ordering. ``pipelines.retry_safe_instance`` is the name the
    ``infra/`` configs load it by.
    """

    @classmethod
    def config_schema(cls) -> dict[str, Any]:
        """No settings of its own (an ``instance_class`` must declare them)."""
        return {}

    @classmethod
    def config_defaults(cls, base_dir: str) -> Any:
        """Dagster's defaults for everything dagster.yaml leaves out."""
        return InstanceRef.config_defaults(base_dir)

    def handle_new_event(self, event: Any, *, batch_metadata: Any = None) -> None:
        """Fail the run in run storage ahead of a ``RUN_FAILURE`` event, then store the event."""
        dagster_event = event.dagster_event if event.is_dagster_event else None
        if dagster_event is not None and dagster_event.is_run_failure and event.run_id:
            self._fail_before_event(event.run_id, dagster_event, event.timestamp)
        super().handle_new_event(event, batch_metadata=batch_metadata)

    def _should_retry_run(self, run: Any, run_failure_reason: Any) -> bool:
        """Dagster's decision, but "true" once a retry exists: counted after the retry joined the
        run group, Dagster's rule would say no more retries."""
        if run.tags.get(AUTO_RETRY_RUN_ID_TAG):
            return True
        return bool(super()._should_retry_run(run, run_failure_reason))

    def _fail_before_event(self, run_id: str, dagster_event: Any, timestamp: float) -> None:
        """``will_retry`` (decided as Dagster would for the failed run), then the status."""
        run = self.get_run_by_id(run_id)
        if run is None or run.status in FINISHED:
            return
        if self.run_retries_enabled:
            reason = getattr(dagster_event.event_specific_data, "failure_reason", None)
            will_retry = self._should_retry_run(run.with_status(DagsterRunStatus.FAILURE), reason)
            self.add_run_tags(run_id, {WILL_RETRY_TAG: str(bool(will_retry)).lower()})
        self.run_storage.handle_run_event(
            run_id, dagster_event, datetime.fromtimestamp(timestamp, tz=UTC)
        )
