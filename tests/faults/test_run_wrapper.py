"""``tokenmill materialize`` stopped, killed, run twice or given a broken instance.

The wrapper passes SIGTERM on to its child and waits (no orphan keeps writing); a run whose
process was killed is marked failed by the next ``materialize`` and by the schedules (a stale
STARTED run never skips every tick); two ``materialize`` on one instance or one storage root
exclude each other with one line; an instance on a full disk is named in one line.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from _helpers import kill_tree
from dagster import (
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    RunsFilter,
    build_schedule_context,
)

from pipelines.build import build_definitions
from pipelines.instance import ensure_dagster_home
from pipelines.jobs import REFRESH_JOB
from pipelines.runguard import PROCESS_TAG, materialize_locks, process_tag
from tokenmill.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]
WHEN = dt.datetime(2026, 1, 4, 2, 0, tzinfo=dt.UTC)


def start(recipe: Recipe, home: Path) -> subprocess.Popen[str]:
    """``tokenmill materialize`` in a subprocess on the instance at ``home``."""
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tokenmill.cli", "materialize", "--recipe", str(recipe.path)]
    return subprocess.Popen(
        [*command, "--code-location", str(ROOT)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def recipe(make_recipe: Callable[..., Recipe]) -> Recipe:
    """The tiny two-dataset recipe of the pipeline tests."""
    return make_recipe()


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A persistent (SQLite) instance folder."""
    yield ensure_dagster_home(tmp_path / "dagster_home")


def wait_for_run(home: Path, job: str | None, proc: subprocess.Popen[str]) -> DagsterRun:
    """The first STARTED run (of ``job``) on the instance, once the subprocess has made one."""
    deadline = time.monotonic() + 180
    with DagsterInstance.from_config(str(home)) as instance:
        while time.monotonic() < deadline and proc.poll() is None:
            runs = instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED]))
            found = [r for r in runs if job is None or r.job_name == job]
            if found:
                return found[0]
            time.sleep(0.05)
    raise AssertionError(f"no STARTED {job or ''} run; output:\n{proc.communicate()[0]}")


def run_status(home: Path, run_id: str) -> DagsterRunStatus:
    with DagsterInstance.from_config(str(home)) as instance:
        run = instance.get_run_by_id(run_id)
        assert run is not None
        return run.status


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_passed_on_and_the_run_ends_failed(
    recipe: Recipe, home: Path, signum: signal.Signals
) -> None:
    """Sent to the wrapper alone (``kill``, a service manager): the child gets it too, ends its
    run cleanly, and the wrapper waits for it (no orphan, no SIGKILL after 0.25 s)."""
    proc = start(recipe, home)
    run = wait_for_run(home, None, proc)
    [child] = psutil.Process(proc.pid).children()
    assert "pipelines.materialize" in " ".join(child.cmdline())
    proc.send_signal(signum)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out  # the child's own exit, after a clean stop
    assert not psutil.pid_exists(child.pid)  # no orphan writes on
    assert "interrupted" in out and "Traceback" not in out
    assert run_status(home, run.run_id) == DagsterRunStatus.FAILURE


def test_a_killed_materialize_does_not_block_the_schedules(recipe: Recipe, home: Path) -> None:
    """SIGKILL during the refresh run leaves it STARTED; the reprocess schedule still runs (the
    run is marked failed), and so does the next ``materialize``."""
    proc = start(recipe, home)
    run = wait_for_run(home, REFRESH_JOB, proc)
    kill_tree(proc.pid)
    proc.communicate(timeout=60)
    assert run_status(home, run.run_id) == DagsterRunStatus.STARTED
    defs = build_definitions(recipe)
    schedule = defs.resolve_schedule_def("code_reprocess")
    with (
        DagsterInstance.from_config(str(home)) as instance,
        build_schedule_context(instance, WHEN, repository_def=defs.get_repository_def()) as ctx,
    ):
        result = schedule.evaluate_tick(ctx)
        assert result.skip_message is None and len(result.run_requests or []) == 2
    assert run_status(home, run.run_id) == DagsterRunStatus.FAILURE
    again = start(recipe, home)
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out


def test_a_dead_process_run_is_marked_failed_by_the_next_materialize(
    recipe: Recipe, home: Path
) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    tag = process_tag(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    with DagsterInstance.from_config(str(home)) as instance:
        stale = DagsterRun(
            job_name=REFRESH_JOB,
            run_id=str(uuid.uuid4()),
            status=DagsterRunStatus.STARTED,
            tags={PROCESS_TAG: tag},
        )
        instance.add_run(stale)
    proc = start(recipe, home)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    assert f"run {stale.run_id}: its process is gone" in out
    assert run_status(home, stale.run_id) == DagsterRunStatus.FAILURE


def test_a_second_materialize_on_one_instance_or_root_stops_with_one_line(
    recipe: Recipe, home: Path, tmp_path: Path
) -> None:
    with materialize_locks(home, recipe.storage.root):
        proc = start(recipe, home)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 1, out
        assert f"another materialize is running (pid {os.getpid()}) on the Dagster instance" in out
        other_home = ensure_dagster_home(tmp_path / "other_home")
        proc = start(recipe, other_home)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 1, out
        assert f"another materialize is running (pid {os.getpid()}) on the storage root" in out
        assert "Traceback" not in out


@pytest.fixture
def full_home(tmp_path: Path) -> Iterator[Path]:
    """An instance folder (schema and lock already made) on a 2 MiB tmpfs that is full. Skips
    where mounting is not permitted."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]
    mounted = os.geteuid() == 0 and subprocess.run(cmd, capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a tmpfs here")
    try:
        home = ensure_dagster_home(mnt / "home")
        with DagsterInstance.from_config(str(home)) as instance:
            instance.get_runs()
        (home / "materialize.lock").write_text("1\n")
        with pytest.raises(OSError), (mnt / "filler").open("wb") as fh:
            while True:
                fh.write(bytes(1 << 16))
                fh.flush()
        yield home
    finally:
        subprocess.run(["umount", "--lazy", str(mnt)], check=True)


def test_an_instance_on_a_full_disk_is_named_in_one_line(recipe: Recipe, full_home: Path) -> None:
    proc = start(recipe, full_home)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, out
    [error] = [line for line in out.splitlines() if "error" in line.lower()]
    assert error.startswith(f"tokenmill materialize: error: Dagster instance {full_home}: ")
    assert "Traceback" not in out and "sqlalchemy" not in out.lower()
