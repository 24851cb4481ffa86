"""Guards around headless runs: interrupted runs marked failed, one materialize at a time, and
a one-line error for an instance that cannot be written.

- Every run ``materialize`` executes carries ``tokenmill/process`` naming its process (host,
  boot, pid and the pid's start time, so a reused pid or a reboot does not pass for it) and a
  lease, ``tokenmill/lease_until`` (epoch seconds), that the process renews while the run
  executes (``run_lease``). A run killed with its process (SIGKILL, OOM, a closed terminal, a
  lost host) stays STARTED in the instance; the next ``materialize`` and the schedules mark it
  failed (``fail_interrupted_runs``): a run of this host once its process is gone, a run of
  another host once its lease has expired (hosts sharing an instance need clocks that agree
  to well within ``LEASE_SECONDS``). So a stale run never blocks a schedule's tick.
- ``materialize_locks`` takes one exclusive ``flock`` per instance (``DAGSTER_HOME``) and one
  per storage root; a second ``materialize`` stops with "another materialize is running (pid N)"
  instead of racing the first in the instance's tables and the root's files.
- ``instance_errors`` turns a failed write to the instance (a full disk, a read-only folder)
  into one ``InstanceError`` line naming the instance and the reason the database or OS gave.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter
from sqlalchemy.exc import SQLAlchemyError

from assets.support.dagster_private import mark_run_failed, set_run_tags
from tokenmill.atomic import name_os_errors
from tokenmill.errors import TokenmillError

PROCESS_TAG = "tokenmill/process"
LEASE_TAG = "tokenmill/lease_until"
# How long a run of another host counts as alive without a renewal; renewed 5 times as often.
LEASE_SECONDS = 300.0
# A run in one of these states with a dead process will never finish on its own.
UNFINISHED = [
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
]
LOCK_NAME = "materialize.lock"


class BusyError(TokenmillError):
    """Another ``materialize`` holds the instance or the storage root."""


class InstanceError(TokenmillError):
    """The Dagster instance's database could not be written (or read)."""


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name (state first), [] where unknown."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return []


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), "" where unknown."""
    stat = _stat(pid)
    return stat[19] if len(stat) > 19 else ""


def process_tag(pid: int | None = None) -> str:
    """``host/boot/pid/start`` of ``pid`` (default this process)."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}/{_boot_id()}/{pid}/{_start_time(pid)}"


def process_gone(tag: str) -> bool:
    """True when the process a ``process_tag`` names is known to have ended: it ran on this host
    and the host rebooted since, the pid is free, or the pid now belongs to a later process.
    A process on another host cannot be checked and counts as alive."""
    host, boot, pid_text, start = [*tag.split("/"), "", "", ""][:4]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    if boot and boot != _boot_id():
        return True
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's live process
    stat = _stat(pid)
    if stat and stat[0] in ("Z", "X"):  # exited, not yet reaped by its parent
        return True
    return bool(start) and _start_time(pid) != start


def _here(tag: str) -> bool:
    return tag.split("/", 1)[0] == socket.gethostname()


def lease_tags(seconds: float = LEASE_SECONDS, now: float | None = None) -> dict[str, str]:
    """The lease tag of a run this process keeps alive for ``seconds`` from ``now``."""
    return {LEASE_TAG: f"{(time.time() if now is None else now) + seconds:.0f}"}


def lease_expired(run: DagsterRun, now: float | None = None) -> bool:
    """The run carries a lease and nobody renewed it in time (an unreadable lease never
    expires: it cannot prove the run dead)."""
    lease = run.tags.get(LEASE_TAG, "")
    try:
        return float(lease) < (time.time() if now is None else now)
    except ValueError:
        return False


def interrupted(run: DagsterRun, now: float | None = None) -> bool:
    """An unfinished run whose ``materialize`` process has ended (this host: the process is
    gone; another host: its lease expired): it will never finish."""
    tag = run.tags.get(PROCESS_TAG)
    if run.status not in UNFINISHED or tag is None:
        return False
    return process_gone(tag) if _here(tag) else lease_expired(run, now)


def why_interrupted(run: DagsterRun) -> str:
    """The failure reason recorded for an interrupted run."""
    tag = run.tags[PROCESS_TAG]
    if _here(tag):
        return (
            f"interrupted: the process that ran it ({tag}) is gone (killed, out of memory or "
            "stopped); marked failed by tokenmill"
        )
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(run.tags[LEASE_TAG])))
    return (
        f"interrupted: the process that ran it ({tag}) stopped renewing its lease, which "
        f"expired at {until} (killed, out of memory, or its host is gone); marked failed by "
        f"tokenmill on {socket.gethostname()}"
    )


def fail_interrupted_runs(instance: DagsterInstance, now: float | None = None) -> list[str]:
    """Mark every interrupted run failed, with the reason; the ids of the runs marked."""
    marked = []
    for record in instance.get_run_records(RunsFilter(statuses=UNFINISHED)):
        run = record.dagster_run
        if interrupted(run, now):
            mark_run_failed(instance, run, why_interrupted(run))
            marked.append(run.run_id)
    return marked


@contextlib.contextmanager
def run_lease(
    instance: DagsterInstance, seconds: float = LEASE_SECONDS
) -> Iterator[dict[str, str]]:
    """The tags of a run this process executes inside the block (its process tag and lease);
    a thread renews the lease of this process's unfinished runs every ``seconds / 5`` until the
    block ends, so another host can tell a live run from one whose host vanished."""
    tag = process_tag()
    stop = threading.Event()

    def renew() -> None:
        mine = RunsFilter(tags={PROCESS_TAG: tag}, statuses=UNFINISHED)
        while not stop.wait(seconds / 5):
            try:
                for record in instance.get_run_records(mine):
                    set_run_tags(instance, record.dagster_run.run_id, lease_tags(seconds))
            except Exception as exc:  # a busy database: said, and tried again at the next turn
                print(f"tokenmill: could not renew the run lease: {exc}", file=sys.stderr)

    thread = threading.Thread(target=renew, name="tokenmill-run-lease", daemon=True)
    thread.start()
    try:
        yield {PROCESS_TAG: tag, **lease_tags(seconds)}
    finally:
        stop.set()
        thread.join()


def stop_if_interrupted(result: Any) -> None:
    """Raise ``KeyboardInterrupt`` when Ctrl-C or SIGTERM ended the run behind ``result``:
    Dagster then fails the run and returns, but the whole ``materialize`` must stop too."""
    if result.success:
        return
    failure = result.get_run_failure_event()
    reason = getattr(failure.event_specific_data, "failure_reason", None) if failure else None
    if getattr(reason, "value", None) == "UNEXPECTED_TERMINATION":
        raise KeyboardInterrupt


def _root_lock_path(root: str) -> Path:
    """The lock of a storage root: in the system temp folder, named after the root (a local
    root's resolved path or an ``s3://`` URI), so the root itself holds no extra file."""
    ident = root if root.startswith("s3://") else str(Path(root).resolve())
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"tokenmill-materialize-{digest}.lock"


@contextlib.contextmanager
def _flock(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (its content: our pid) or raise ``BusyError``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise BusyError(
                f"another materialize is running (pid {holder}) on {what}; wait for it to "
                f"finish (lock {path})"
            ) from None
        with name_os_errors(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def materialize_locks(home: Path, root: str) -> Iterator[None]:
    """One ``materialize`` per instance ``home`` and per storage ``root`` at a time."""
    with (
        _flock(home / LOCK_NAME, f"the Dagster instance {home}"),
        _flock(_root_lock_path(root), f"the storage root {root}"),
    ):
        yield


@contextlib.contextmanager
def instance_errors(home: Path) -> Iterator[None]:
    """Re-raise a database error of the instance at ``home`` as one ``InstanceError`` line."""
    try:
        yield
    except SQLAlchemyError as exc:
        raise _instance_error(home, getattr(exc, "orig", None) or exc) from exc
    except OSError as exc:
        if exc.filename is None or home not in Path(exc.filename).resolve().parents:
            raise
        raise _instance_error(home, exc) from exc


def _instance_error(home: Path, reason: object) -> InstanceError:
    return InstanceError(
        f"Dagster instance {home}: could not be written or read: {reason} (a full disk or a "
        "read-only folder? free space or fix DAGSTER_HOME, then run again)"
    )
