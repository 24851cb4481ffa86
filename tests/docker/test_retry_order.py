"""Why a killed run's retry could fail to launch, and that ``RetrySafeInstance`` closes it (no
daemon or container needed).

Dagster's retry daemon reads ``RUN_FAILURE`` events past a cursor, then the runs. Here its poll
runs at the worst moment, right after the event is committed (what run monitoring and the
daemon's threads did once under load in tests/docker/test_e2e_docker.py): Dagster's own
instance has not yet marked the run failed, so the retry is skipped for good and the run is left
"waiting to retry"; ``RetrySafeInstance`` has, so the retry is decided.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster import DagsterEvent, DagsterEventType, DagsterInstance, DagsterRunStatus, job, op
from dagster._core.events import JobFailureData, RunFailureReason
from dagster._core.storage.tags import (
    AUTO_RETRY_RUN_ID_TAG,
    MAX_RETRIES_TAG,
    PARENT_RUN_ID_TAG,
    RETRY_NUMBER_TAG,
    RETRY_ON_ASSET_OR_OP_FAILURE_TAG,
    ROOT_RUN_ID_TAG,
    RUN_FAILURE_REASON_TAG,
    WILL_RETRY_TAG,
)
from dagster._daemon.auto_run_reexecution.auto_run_reexecution import filter_runs_to_should_retry
from dagster._daemon.auto_run_reexecution.event_log_consumer import EventLogConsumerDaemon
from docker_daemon import ROOT

RETRY_SAFE = {"module": "pipelines.retry_safe_instance", "class": "RetrySafeInstance"}


@op
def step() -> None:
    """One step (never executed: the runs here are created and failed by hand)."""


@job
def one_step_job() -> None:
    step()


class Poll:
    """The retry daemon's event reader; records, per poll, each run it was handed: (status at
    the read, whether it decided to retry it). For a run it retries it writes what the daemon's
    launch writes to the run group (a child run, tagged as the retry); starting that run would
    need a code server."""

    def __init__(self, instance: DagsterInstance):
        self.instance = instance
        self.seen: list[tuple[DagsterRunStatus, bool]] = []
        outer = self

        class Reader(EventLogConsumerDaemon):
            @property
            def handle_updated_runs_fns(self) -> list[Any]:
                def record(context: Any, records: Any, logger: Any) -> Iterator[None]:
                    runs = [r.dagster_run for r in records]
                    retry = {r.run_id for r in filter_runs_to_should_retry(runs, context.instance)}
                    outer.seen += [(r.status, r.run_id in retry) for r in runs]
                    for run_id in retry:
                        child = context.instance.create_run_for_job(
                            one_step_job,
                            parent_run_id=run_id,
                            root_run_id=run_id,
                            tags={
                                PARENT_RUN_ID_TAG: run_id,
                                ROOT_RUN_ID_TAG: run_id,  # what Dagster's run group goes by
                                RETRY_NUMBER_TAG: "1",
                            },
                        )
                        context.instance.add_run_tags(run_id, {AUTO_RETRY_RUN_ID_TAG: child.run_id})
                    yield

                return [record]

        self.daemon = Reader()

    def __call__(self) -> None:
        for _ in self.daemon.run_iteration(self):  # type: ignore[arg-type]  # only .instance
            pass


def instance_at(home: Path, instance_class: dict[str, str] | None) -> DagsterInstance:
    config: dict[str, Any] = {
        "telemetry": {"enabled": False},
        "run_retries": {"enabled": True, "max_retries": 1},
    }
    if instance_class:
        config["instance_class"] = instance_class
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    return DagsterInstance.from_config(str(home))


def fail_with_poll_after_the_event(
    instance: DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
    tags: dict[str, str],
    reason: RunFailureReason | None = None,
) -> tuple[Poll, Any]:
    """A started run failed from outside (as run monitoring fails a dead worker, with no reason;
    or with ``reason``), one poll of the retry daemon right after the failure event is
    committed; the run as it ends up."""
    run = instance.create_run_for_job(one_step_job, tags=tags)
    start = DagsterEvent(DagsterEventType.RUN_START.value, job_name=run.job_name)
    instance.run_storage.handle_run_event(run.run_id, start)
    poll = Poll(instance)
    poll()  # the daemon's first poll sets its cursor
    storage = type(instance.event_log_storage)
    store = storage.store_event

    def store_then_poll(self: Any, event: Any) -> None:
        store(self, event)
        if event.dagster_event_type == DagsterEventType.RUN_FAILURE:
            poll()

    monkeypatch.setattr(storage, "store_event", store_then_poll)
    failure = JobFailureData(error=None, failure_reason=reason) if reason else None
    instance.report_run_failed(run, "Container status is exited.", failure)
    monkeypatch.undo()
    poll()
    poll()  # later polls never return to the event
    return poll, instance.get_run_by_id(run.run_id)


def test_dagster_alone_skips_a_failure_read_before_its_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cause of the lost retry (if this fails, Dagster now orders its writes and
    ``RetrySafeInstance`` can go)."""
    with instance_at(tmp_path, None) as instance:
        poll, run = fail_with_poll_after_the_event(instance, monkeypatch, {})
    assert poll.seen == [(DagsterRunStatus.STARTED, False)]
    assert run.status == DagsterRunStatus.FAILURE and run.tags[WILL_RETRY_TAG] == "true"
    assert AUTO_RETRY_RUN_ID_TAG not in run.tags
    assert run.is_complete_and_waiting_to_retry  # what a backfill then waits on forever


@pytest.mark.parametrize(
    ("tags", "reason", "retry"),
    [
        ({}, None, True),  # a killed container
        ({MAX_RETRIES_TAG: "0"}, None, False),
        ({RETRY_ON_ASSET_OR_OP_FAILURE_TAG: "false"}, RunFailureReason.STEP_FAILURE, False),
        ({RETRY_ON_ASSET_OR_OP_FAILURE_TAG: "false"}, RunFailureReason.RUN_EXCEPTION, True),
    ],
)
def test_retry_safe_instance_fails_the_run_before_its_event(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tags: dict[str, str],
    reason: RunFailureReason | None,
    retry: bool,
) -> None:
    """The poll sees the run failed with Dagster's retry decision (max retries and the failure
    reason count as Dagster counts them) and retries it if so; the decision stays what it was
    after the event is stored, and the event is stored as usual."""
    with instance_at(tmp_path, RETRY_SAFE) as instance:
        assert type(instance).__name__ == "RetrySafeInstance"
        poll, run = fail_with_poll_after_the_event(instance, monkeypatch, tags, reason)
        [failure] = instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_FAILURE)
    assert poll.seen == [(DagsterRunStatus.FAILURE, retry)]
    assert run.status == DagsterRunStatus.FAILURE
    assert run.tags[WILL_RETRY_TAG] == str(retry).lower()
    assert (AUTO_RETRY_RUN_ID_TAG in run.tags) == retry
    assert run.tags.get(RUN_FAILURE_REASON_TAG) == (reason.value if reason else None)
    assert failure.message == "Container status is exited."


def test_docker_instance_uses_it() -> None:
    config = yaml.safe_load((ROOT / "infra" / "docker" / "dagster.yaml").read_text())
    assert config["instance_class"] == RETRY_SAFE
    # run containers load the instance class too: the image puts the code location on the path
    assert "PYTHONPATH=/opt/tokenmill" in (ROOT / "infra" / "Dockerfile").read_text()
