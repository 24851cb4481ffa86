"""A Dagster instance whose failed runs are always seen as failed by the retry daemon.

Dagster 1.13 stores a ``RUN_FAILURE`` event first and only then sets the run's status and its
``dagster/will_retry`` tag, in separate commits. The retry daemon (``EventLogConsumerDaemon``)
reads new failure events past a cursor every 5 s and then the runs they belong to: a read that
falls between those commits finds the run still ``STARTED``, retries nothing, and moves its
cursor past the event for good. The run then ends ``FAILURE`` with ``will_retry=true`` and no
retry, and a backfill holding it waits forever ("retries have not been launched"). Run
monitoring reports a killed container's failure from the daemon process itself, one thread away
from that reader, which is how ``tests/docker/test_e2e_docker.py`` met it.

``RetrySafeInstance`` writes the retry decision and then the failed status before the event, so
whoever sees the event sees a failed run with its decision; Dagster's second decision, made after
the event is stored, keeps "true" for a run whose retry the daemon has already created.
``infra/docker/dagster.yaml``, ``infra/dagster.yaml`` and ``infra/ecs/dagster.yaml`` select it with
``instance_class`` (the Helm chart cannot: docs/operations.md). It reaches into Dagster's retry
bookkeeping (the tag names, ``_should_retry_run``): dagster is pinned, and
``tests/docker/test_retry_order.py`` checks the ordering against the installed version.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from dagster import DagsterInstance, DagsterRunStatus
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, WILL_RETRY_TAG

FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}


class RetrySafeInstance(DagsterInstance):
    """``DagsterInstance`` that marks a run failed (retry decision first) before storing its
    ``RUN_FAILURE`` event; everything else is Dagster's own handling."""

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
