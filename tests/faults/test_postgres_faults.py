"""Postgres restarted under a running Dagster run: a dedicated throwaway cluster (so the session
one is not disturbed) holds run, event and schedule storage through the storage section of
``infra/dagster.yaml``, and a step restarts or stops the server while the run goes on.

Outcomes: dagster-postgres opens a connection per write and retries failed connections with
exponential backoff (about 12 s in all), so a restart is ridden out and the run succeeds with
every event stored. An outage longer than that window makes the run's next event write raise
``DagsterPostgresException`` out of the run; nothing after the outage is recorded (no
materialization vouches for unfinished steps; the run row stays STARTED until run monitoring,
enabled in ``infra/dagster.yaml``, fails it), and a re-run once the server is back succeeds.

(No ``from __future__ import annotations`` here: Dagster checks the ``context`` annotation of
the assets below at definition time and refuses a string.)
"""

import getpass
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg2
import pytest
import yaml
from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    DagsterInstance,
    asset,
    materialize,
)
from dagster_postgres.utils import DagsterPostgresException, retry_pg_connection_fn
from prod_servers import Postgres
from servers import _pg_bin, free_port

INFRA = Path(__file__).resolve().parents[2] / "infra"


@dataclass
class Cluster:
    """A throwaway Postgres cluster that tests may stop, start and restart."""

    data: Path
    port: int
    user: str
    as_user: list[str]  # runuser prefix: the server refuses to run as root

    def run(self, *cmd: str) -> None:
        """A Postgres client or server command, in the cluster's folder."""
        subprocess.run([*self.as_user, *cmd], check=True, capture_output=True, cwd=self.data.parent)

    def ctl(self, *args: str) -> None:
        """``pg_ctl ARGS`` on the cluster (loopback only, its own socket folder, no fsync)."""
        base = self.data.parent
        options = f"-p {self.port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(base / "server.log")
        self.run(_pg_bin("pg_ctl"), "-D", str(self.data), "-o", options, "-l", log, *args)

    def server(self) -> Postgres:
        """Connection settings of its ``dagster`` database."""
        return Postgres("127.0.0.1", self.port, self.user, "dagster")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """``initdb`` + start on a free loopback port (as in ``servers.postgres``, but this one is
    the module's own); stopped and removed at the end."""
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    base = Path(tempfile.mkdtemp(prefix="tokenmill-pgfault-"))
    if as_user:
        shutil.chown(base, "postgres", "postgres")
    user = "postgres" if as_user else getpass.getuser()
    made = Cluster(base / "data", free_port(), user, as_user)
    made.run(_pg_bin("initdb"), "-D", str(made.data), "-A", "trust", "-U", user, "--no-sync")
    made.ctl("-w", "start")
    try:
        made.run(
            _pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(made.port), "-U", user, "dagster"
        )
        yield made
    finally:
        made.ctl("-m", "immediate", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_instance(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[DagsterInstance]:
    """An instance whose storage section is ``infra/dagster.yaml``'s, on the cluster."""
    for name, value in cluster.server().env().items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "dagster_home"
    home.mkdir()
    storage = yaml.safe_load((INFRA / "dagster.yaml").read_text())["storage"]
    (home / "dagster.yaml").write_text(yaml.safe_dump({"storage": storage}))
    with DagsterInstance.from_config(str(home)) as instance:
        yield instance


def query(cluster: Cluster, sql: str, *params: object) -> list[tuple[object, ...]]:
    """Rows of ``sql`` on the cluster's ``dagster`` database (a direct psycopg2 connection)."""
    server = cluster.server()
    dsn = f"host={server.host} port={server.port} user={server.user} dbname={server.db}"
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def stored(cluster: Cluster, run_id: str) -> tuple[str | None, list[str]]:
    """The run's status and its materialized asset keys, as Postgres holds them."""
    status = query(cluster, "SELECT status FROM runs WHERE run_id = %s", run_id)
    keys = query(
        cluster,
        "SELECT asset_key FROM event_logs WHERE run_id = %s AND dagster_event_type = %s "
        "ORDER BY id",
        run_id,
        "ASSET_MATERIALIZATION",
    )
    return (str(status[0][0]) if status else None), [str(k[0]) for k in keys]


def graph(during_step: Callable[[], None]) -> list[AssetsDefinition]:
    """``first`` → ``middle`` → ``last``; ``middle`` calls ``during_step()`` between two log
    lines (each an event written to Postgres)."""

    @asset
    def first() -> int:
        return 1

    @asset
    def middle(context: AssetExecutionContext, first: int) -> int:
        context.log.info("before the fault")
        during_step()
        context.log.info("after the fault")
        return first + 1

    @asset
    def last(middle: int) -> int:
        return middle + 1

    return [first, middle, last]


KEYS = [AssetKey(name).to_string() for name in ("first", "middle", "last")]


def test_run_rides_out_a_postgres_restart(cluster: Cluster, pg_instance: DagsterInstance) -> None:
    started: list[object] = []

    def restart() -> None:
        started.append(query(cluster, "SELECT pg_postmaster_start_time()")[0][0])
        cluster.ctl("-m", "fast", "-w", "restart")  # every open connection is cut
        started.append(query(cluster, "SELECT pg_postmaster_start_time()")[0][0])

    result = materialize(graph(restart), instance=pg_instance, raise_on_error=False)
    assert started[0] != started[1]  # the server really went away mid-step
    assert result.success
    assert stored(cluster, result.run_id) == ("SUCCESS", KEYS)
    messages = [record.user_message for record in pg_instance.all_logs(result.run_id)]
    assert "before the fault" in messages and "after the fault" in messages


def test_postgres_outage_beyond_the_retries_fails_the_run_then_a_rerun_succeeds(
    cluster: Cluster, pg_instance: DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    # dagster-postgres's connection retries shrunk from 5 over ~12 s to 3 over ~0.5 s (the
    # defaults of its retry function), so a short outage outlasts them.
    monkeypatch.setattr(retry_pg_connection_fn, "__defaults__", (3, 0.05))
    with pytest.raises(DagsterPostgresException, match="too many retries for DB connection"):
        materialize(
            graph(lambda: cluster.ctl("-m", "fast", "-w", "stop")),
            instance=pg_instance,
            raise_on_error=False,
        )
    cluster.ctl("-w", "start")
    [failed] = pg_instance.get_runs(limit=1)  # the newest run
    assert stored(cluster, failed.run_id) == ("STARTED", [KEYS[0]])
    assert "after the fault" not in [r.user_message for r in pg_instance.all_logs(failed.run_id)]

    again = materialize(graph(lambda: None), instance=pg_instance, raise_on_error=False)
    assert again.success
    assert stored(cluster, again.run_id) == ("SUCCESS", KEYS)
