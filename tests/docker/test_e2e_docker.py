"""A multi-host run in real containers (issue 13): a host ``dagster-daemon`` on
``infra/docker/dagster.yaml`` (Postgres storage, run queue, run monitoring and retries) launches
every run in its own container of the project image through ``DockerRunLauncher``; the code
server is a container of the same image. Everything is on the host network, on loopback:
Postgres, moto_server (the only storage: sources and root are ``s3://``) and the code server.
Containers share no directory with the host except the read-only tokenizer and recipe.

One test walks the deployment through (a) sensor runs for 4 new shards, (b) a backfill of 32
shards in ranges, with one run's container killed mid-step and retried, (c) the refresh
(merge, indices, blend), and then checks: outputs equal to a local-root run of the same recipe
(blend batches through ``tokenmill pull`` + ``open_blend``; merged ``.bin``/``.idx`` bytes
through the ``current.json`` pointers); no credential in container logs, the event log or the
step logs; no container, network or dangling image left behind.

It is part of ``make test`` (``make e2e-docker`` runs tests/docker alone); without root, the
Debian packages or a dockerd that starts, it is skipped with its reason (``-rs``; with ``CI``
set, the skip fails the run). Once in six
runs under load, the killed run's retry was never launched: Dagster's retry daemon had read the
failure event before the run's status changed and skipped it for good. The Docker instance now
uses ``pipelines.retry_safe_instance`` (tests/docker/test_retry_order.py shows both), and the
kill phase waits on each step of the chain (failed, retry created, backfill done), failing at
once with the cause if the retry daemon passes over the failure again.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from dagster import AssetKey, DagsterEventType, DagsterInstance, DagsterRunStatus
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG
from docker_daemon import LABEL, ROOT, Docker
from pipeline_project import SPLITS, add_shard_backfill, blend_batches, s3_project, write_shard
from prod_servers import S3, Postgres
from servers import free_port

from assets.support.partitions import partitions_name
from pipelines.materialize import materialize_recipe
from tokenmill.formats.dataset_manifest import read_dataset_manifest
from tokenmill.recipe import Recipe
from tokenmill.storage.layout import dataset_manifest, merged_pointer
from tokenmill.storage.versions import pointer_target

BIN = Path(sys.executable).parent
INFRA = ROOT / "infra"
# Distinctive fake credentials (moto and a trust-auth Postgres accept any): searched for below.
KEY_ID = "AKIATMDOCKERE2E7Q3X9"
SECRET = "tmDockerE2eSecret4f8a2c91ZqXv"
PG_PASSWORD = "tmDockerE2ePgPass7c3e91Wk"
BACKFILL_SHARDS = 32
# Seconds for any one wait: twice the longest phase measured on 2 loaded vCPUs (the backfill,
# 61-120 s; docs/operations.md). A lost retry is not a timeout any more: retry_of names it.
TIMEOUT = 240
# The retry daemon's bookmark in the event log for failure events (Dagster's daemon cursor key).
FAILURE_CURSOR = "EVENT_LOG_CONSUMER_CURSOR-PIPELINE_FAILURE"
DONE = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}


@pytest.fixture
def recipe_dir() -> Iterator[Path]:
    """A folder an unprivileged container user can read (pytest's tmp is 0700), removed after."""
    path = Path(tempfile.mkdtemp(prefix="tm-e2e-recipe-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def backfill_shards(folder: Path, documents: list[dict[str, str]]) -> None:
    """32 more docs shards, each a different slice of the corpus plus a line naming it."""
    for i in range(BACKFILL_SHARDS):
        docs = [documents[(i * 7 + j) % len(documents)] for j in range(24)]
        write_shard(folder / f"more-{i:05d}.jsonl", [*docs, {"text": f"backfill shard {i}"}])


class Deployment:
    """The host side: a DAGSTER_HOME with infra/docker/dagster.yaml, the code server container,
    the host daemon, and the CLI, all with the same environment."""

    def __init__(
        self, docker: Docker, home: Path, env: dict[str, str], mounts: list[tuple[Path, Path]]
    ):
        self.docker, self.home, self.env, self.mounts = docker, home, env, mounts
        self.port = free_port()
        self.daemon: subprocess.Popen[bytes] | None = None
        self.code_server = f"tm-code-{secrets.token_hex(4)}"

    def write_config(self) -> None:
        config = yaml.safe_load((INFRA / "docker" / "dagster.yaml").read_text())
        kwargs = config["run_launcher"]["config"]["container_kwargs"]
        kwargs["volumes"] = [
            f"{src}:{dst}:ro" for src, dst in self.mounts
        ]  # where they are on this host
        (self.home / "dagster.yaml").write_text(yaml.safe_dump(config))
        workspace = yaml.safe_load((INFRA / "docker" / "workspace.yaml").read_text())
        workspace["load_from"][0]["grpc_server"]["port"] = self.port
        (self.home / "workspace.yaml").write_text(yaml.safe_dump(workspace))

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            [str(BIN / "dagster"), *args, "-w", str(self.home / "workspace.yaml")],
            env=self.env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"dagster {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def start_code_server(self) -> None:
        names = [n for n in self.env if n.startswith(("DAGSTER_PG_", "AWS_", "TOKENMILL_"))]
        self.docker.run(
            "run",
            "-d",
            "--name",
            self.code_server,
            "--network",
            "host",
            "--label",
            LABEL,
            "-e",
            f"DAGSTER_CURRENT_IMAGE={self.docker.image}",
            *[a for n in names for a in ("-e", n)],  # values from this client's environment
            *[a for src, dst in self.mounts for a in ("-v", f"{src}:{dst}:ro")],
            self.docker.image,
            "dagster",
            "code-server",
            "start",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-m",
            "pipelines.definitions",
            "-d",
            "/opt/tokenmill",
        )
        deadline = time.monotonic() + TIMEOUT
        while True:
            probe = subprocess.run(
                [str(BIN / "dagster"), "api", "grpc-health-check", "-p", str(self.port)],
                env=self.env,
                capture_output=True,
                timeout=60,
            )
            if probe.returncode == 0:
                return
            state = self.docker.run("inspect", "-f", "{{.State.Status}}", self.code_server)
            if state.strip() != "running" or time.monotonic() > deadline:
                logs = self.docker.run("logs", self.code_server, check=False)
                raise AssertionError(f"code server {state.strip()}: {logs[-3000:]}")
            time.sleep(0.5)

    def start_daemon(self) -> None:
        with open(self.home / "daemon.log", "wb") as out:
            self.daemon = subprocess.Popen(
                [str(BIN / "dagster-daemon"), "run", "-w", str(self.home / "workspace.yaml")],
                env=self.env,
                cwd=self.home,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop_daemon(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGTERM)
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.daemon.pid, signal.SIGKILL)
                self.daemon.wait()


def wait_for(what: str, check: Callable[[], Any], deployment: Deployment) -> Any:
    """Poll ``check`` until it returns something truthy; fail with the daemon's log tail."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        value = check()
        if value:
            return value
        daemon = deployment.daemon
        if daemon is not None and daemon.poll() is not None:
            raise AssertionError(f"dagster-daemon exited while waiting for {what}")
        if time.monotonic() > deadline:
            log = (deployment.home / "daemon.log").read_text(errors="replace")[-4000:]
            raise AssertionError(f"timed out waiting for {what}; daemon log:\n{log}")
        time.sleep(0.2)


def runs_of(instance: DagsterInstance, job: str) -> list[Any]:
    return [r for r in instance.get_runs() if r.job_name == job]


def all_done(instance: DagsterInstance, job: str, count: int) -> list[Any] | None:
    """The ``job`` runs once there are ``count`` of them and none is still queued or going."""
    runs = runs_of(instance, job)
    return runs if len(runs) >= count and all(r.status in DONE for r in runs) else None


def merged_identity(manifest: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    """What a merged version is made of: its content hash and its shards' (key, content hash)
    in order (a virtual merge copies no token: equal identities read equal samples)."""
    shards = [(str(s["key"]), str(s["content_hash"])) for s in manifest["shards"]]
    return str(manifest["content_hash"]), shards


def merged_identity_local(root: Path, ds: str) -> tuple[str, list[tuple[str, str]]]:
    prefix = pointer_target(root / merged_pointer(ds))
    assert prefix is not None, f"{ds}: no merged pointer in {root}"
    return merged_identity(read_dataset_manifest(prefix))


def merged_identity_s3(s3: S3, mirror: Path, ds: str) -> tuple[str, list[tuple[str, str]]]:
    """The current merged version of ``ds`` on S3, found through its pointer like a reader."""
    pointer = mirror / merged_pointer(ds)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    s3.client.download_file(s3.bucket, f"root/{merged_pointer(ds)}", str(pointer))
    prefix = pointer_target(pointer)
    assert prefix is not None
    key = dataset_manifest(prefix.relative_to(mirror).as_posix())
    body = s3.client.get_object(Bucket=s3.bucket, Key=f"root/{key}")["Body"].read()
    return merged_identity(json.loads(body))


def leaked(where: str, data: str | bytes) -> list[str]:
    raw = data.encode() if isinstance(data, str) else data
    return [f"{where}: {n}" for n in (KEY_ID, SECRET, PG_PASSWORD) if n.encode() in raw]


def test_sensor_backfill_refresh_in_containers(
    image: Docker,
    pg_database: Postgres,
    recipe_dir: Path,
    s3: S3,
    make_recipe: Callable[..., Recipe],
    gpt2_dir: Path,
    documents: dict[str, list[dict[str, str]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    docker = image
    timings = {
        "images: base (0: cached)": docker.base_image_seconds,
        "make image": docker.image_seconds,
    }
    dangling = set(docker.ids("images", "-q", "--filter", "dangling=true"))
    local = make_recipe()
    remote = s3_project(make_recipe, s3)
    config = recipe_dir
    recipe_file = config / "recipe.yaml"
    shutil.copy(remote.path, recipe_file)
    recipe_file.chmod(0o644)

    home = tmp_path / "dagster_home"
    home.mkdir()
    env_vars = {
        **pg_database.env(),
        "DAGSTER_PG_PASSWORD": PG_PASSWORD,  # trust auth: any password is accepted
        "DAGSTER_HOME": str(home),
        "TOKENMILL_LOG_BUCKET": s3.bucket,
        "TOKENMILL_RECIPE": str(recipe_file),
        "TOKENMILL_IMAGE": docker.image,
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3.endpoint,
        "DOCKER_HOST": docker.host,
        # the daemon and the CLI load infra/docker/dagster.yaml's instance class from pipelines/
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    for name, value in env_vars.items():
        monkeypatch.setenv(name, value)
    # Read-only mounts at the paths the recipe names (a bind mount resolves the symlink).
    mounts = [(gpt2_dir.resolve(), gpt2_dir), (config, config)]
    deployment = Deployment(docker, home, dict(os.environ), mounts)
    deployment.write_config()
    try:
        with DagsterInstance.from_config(str(home)) as instance:
            start = time.perf_counter()
            deployment.start_code_server()
            deployment.cli("sensor", "stop", "tokenmill_automation")  # the refresh is run by (c)
            deployment.start_daemon()
            timings["code server up + daemon started"] = time.perf_counter() - start

            # (a) the shard sensors find 4 + 2 new shards: one range run per dataset
            start = time.perf_counter()
            docs_runs = wait_for(
                "the docs sensor run", lambda: all_done(instance, "docs_shard_job", 1), deployment
            )
            code_runs = wait_for(
                "the code sensor run", lambda: all_done(instance, "code_shard_job", 1), deployment
            )
            timings["(a) sensor runs, 4 + 2 shards"] = time.perf_counter() - start
            [sensor_run] = docs_runs
            assert sensor_run.status == DagsterRunStatus.SUCCESS, sensor_run
            assert sensor_run.tags["dagster/sensor_name"] == "docs_shard_sensor"
            assert (
                sensor_run.tags["dagster/asset_partition_range_start"],
                sensor_run.tags["dagster/asset_partition_range_end"],
            ) == ("extra-00000", "part-00002")
            assert [r.status for r in code_runs] == [DagsterRunStatus.SUCCESS]

            # (b) 32 more shards, registered by hand and backfilled in ranges of 16
            deployment.cli("sensor", "stop", "docs_shard_sensor")
            backfill_shards(tmp_path / "sources" / "docs", documents["docs"])
            s3.upload_tree(tmp_path / "sources" / "docs", "sources/docs")
            more = [f"more-{i:05d}" for i in range(BACKFILL_SHARDS)]
            instance.add_dynamic_partitions(partitions_name("docs"), more)
            start = time.perf_counter()
            backfill_id = launch_backfill(instance, remote, more)
            killed = kill_first_backfill_run_mid_step(instance, docker, backfill_id, deployment)
            kill = time.perf_counter()
            timings["(b) backfill start -> a step started, container killed"] = kill - start
            wait_for(
                "run monitoring to fail the killed run",
                lambda: run_status(instance, killed) in DONE,
                deployment,
            )
            failed = time.perf_counter()
            timings["(b) kill -> run failed (run monitoring, 5 s poll)"] = failed - kill
            wait_for("the retry of the killed run", lambda: retry_of(instance, killed), deployment)
            timings["(b) run failed -> retry created (retry daemon, 5 s poll)"] = (
                time.perf_counter() - failed
            )
            runs = wait_for(
                "the backfill to finish",
                lambda: backfill_finished(instance, backfill_id),
                deployment,
            )
            timings["(b) backfill of 32 shards (2 ranges, 1 killed + retried)"] = (
                time.perf_counter() - start
            )
            check_backfill(instance, runs, killed, more)

            # (c) the refresh: merge, indices, blend
            start = time.perf_counter()
            deployment.cli("job", "launch", "-j", "refresh_job")
            [refresh] = wait_for(
                "the refresh run", lambda: all_done(instance, "refresh_job", 1), deployment
            )
            timings["(c) refresh"] = time.perf_counter() - start
            assert refresh.status == DagsterRunStatus.SUCCESS, refresh

            launched = [r for r in instance.get_runs()]
            containers = docker.ids("ps", "-aq", "--filter", "label=dagster/run_id")
            assert len(containers) == len(launched)  # every run ran in a container of its own
            event_log = "\n".join(
                f"{run!r}\n" + "\n".join(repr(e) for e in instance.all_logs(run.run_id))
                for run in launched
            )
        deployment.stop_daemon()

        # Credentials: in no container's output, event, run record or step log.
        found = leaked("event log", event_log)
        for container in docker.ids("ps", "-aq", "--filter", f"label={LABEL}"):
            logs = subprocess.run(
                ["docker", "logs", container], env=docker.env(), capture_output=True, timeout=60
            )
            found += leaked(f"container {container} logs", logs.stdout + logs.stderr)
        daemon_log = (home / "daemon.log").read_text(errors="replace")
        found += leaked("daemon log", daemon_log)
        assert "Traceback" not in daemon_log, daemon_log[-6000:]  # e.g. a failed sensor tick
        step_logs = s3.keys("dagster/compute-logs/")
        assert step_logs, "no step logs reached the log bucket"
        for key in step_logs:
            body = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
            found += leaked(key, body)
        assert found == []
        # What the launcher forwards is in the container's configuration (docs/operations.md).
        inspect = docker.run("inspect", containers[0])
        assert SECRET in inspect

        # Outputs: the same as a local-root run of the same recipe and corpus.
        start = time.perf_counter()
        with DagsterInstance.ephemeral() as local_instance:
            assert materialize_recipe(local, local_instance) == 0
        timings["local-root run of the same recipe (host, in process)"] = (
            time.perf_counter() - start
        )
        pulled = tmp_path / "pulled"
        uri = f"s3://{s3.bucket}/root/blends/mix/manifest.json"
        done = subprocess.run(
            [str(BIN / "tokenmill"), "pull", uri, str(pulled)],
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        expected = blend_batches(Path(local.storage.root) / "blends" / "mix" / "manifest.json")
        got = blend_batches(pulled / "blends" / "mix" / "manifest.json")
        for split in SPLITS:
            assert len(got[split]) > 0 and np.array_equal(got[split], expected[split]), split
        for ds in ("docs", "code"):
            assert merged_identity_s3(s3, tmp_path / "mirror", ds) == merged_identity_local(
                Path(local.storage.root), ds
            ), ds
    finally:
        deployment.stop_daemon()
        docker.remove_labelled()
        with capsys.disabled():  # the phase timings, in every run (docs/operations.md)
            print()
            for name, seconds in timings.items():
                print(f"[e2e-docker] {name}: {seconds:.1f} s", flush=True)

    # Nothing left behind on the daemon.
    assert docker.ids("ps", "-aq") == []
    networks = docker.run("network", "ls", "--format", "{{.Name}}").split()
    assert sorted(networks) == ["host", "none"]
    assert set(docker.ids("images", "-q", "--filter", "dangling=true")) == dangling


def launch_backfill(instance: DagsterInstance, recipe: Recipe, keys: list[str]) -> str:
    """An asset backfill of the docs shard stages over ``keys``, as the UI submits one; the
    backfill daemon splits it into ranges (the shard assets' BackfillPolicy)."""
    from pipelines.build import build_definitions

    return add_shard_backfill(instance, build_definitions(recipe).resolve_asset_graph(), keys)


def kill_first_backfill_run_mid_step(
    instance: DagsterInstance, docker: Docker, backfill_id: str, deployment: Deployment
) -> str:
    """``docker kill`` the container of the first backfill run as soon as a step of it starts;
    the killed run's id."""

    def started_step() -> str | None:
        for run in instance.get_runs():
            if run.tags.get("dagster/backfill") != backfill_id or run.parent_run_id:
                continue
            if instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_START):
                return run.run_id
        return None

    run_id = wait_for("a backfill step to start", started_step, deployment)
    [container] = docker.ids("ps", "-q", "--filter", f"label=dagster/run_id={run_id}")
    docker.run("kill", container)
    return str(run_id)


def run_status(instance: DagsterInstance, run_id: str) -> DagsterRunStatus:
    run = instance.get_run_by_id(run_id)
    assert run is not None, run_id
    return run.status


def retry_of(instance: DagsterInstance, run_id: str) -> str | None:
    """The id of the failed run's automatic retry once the retry daemon has created it. Fails at
    once, naming the cause, if the daemon has read past the run's failure event without creating
    one (it never returns to an event; a backfill would wait for that retry forever)."""
    cursor = instance.daemon_cursor_storage.get_cursor_values({FAILURE_CURSOR}).get(FAILURE_CURSOR)
    # The run is read after the cursor: the daemon tags a run with its retry before it moves on.
    run = instance.get_run_by_id(run_id)
    assert run is not None and run.status == DagsterRunStatus.FAILURE, run
    retry = run.tags.get(AUTO_RETRY_RUN_ID_TAG)
    if retry:
        return str(retry)
    # RetrySafeInstance fails the run just before it stores the event: it may not be there yet.
    failure = instance.get_records_for_run(run_id, of_type=DagsterEventType.RUN_FAILURE).records
    if failure and cursor is not None and int(cursor) >= failure[0].storage_id:
        engine = [
            e.message for e in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT)
        ]
        raise AssertionError(
            f"the retry daemon read the failure of run {run_id} (event {failure[0].storage_id}, "
            f"cursor {cursor}) and launched no retry; tags {dict(run.tags)}; engine events "
            f"{engine[-5:]}"
        )
    return None


def backfill_finished(instance: DagsterInstance, backfill_id: str) -> list[Any] | None:
    backfill = instance.get_backfill(backfill_id)
    if backfill is None or backfill.status.value in ("REQUESTED", "CANCELING"):
        return None
    runs = [r for r in instance.get_runs() if r.tags.get("dagster/backfill") == backfill_id]
    return runs if all(r.status in DONE for r in runs) else None


def check_backfill(
    instance: DagsterInstance, runs: list[Any], killed: str, keys: list[str]
) -> None:
    """Two ranges of 16; the killed run failed mid-step and its retry succeeded; every shard of
    the backfill materialized once per stage."""
    by_id = {r.run_id: r for r in runs}
    first = [r for r in runs if not r.parent_run_id]
    ranges = sorted(
        (r.tags["dagster/asset_partition_range_start"], r.tags["dagster/asset_partition_range_end"])
        for r in first
    )
    assert ranges == [(keys[0], keys[15]), (keys[16], keys[31])]
    assert by_id[killed].status == DagsterRunStatus.FAILURE
    starts = {e.step_key for e in instance.all_logs(killed, of_type=DagsterEventType.STEP_START)}
    successes = {
        e.step_key for e in instance.all_logs(killed, of_type=DagsterEventType.STEP_SUCCESS)
    }
    assert starts - successes, "the container was killed after its steps had finished"
    [retry] = [r for r in runs if r.parent_run_id == killed]
    assert retry.status == DagsterRunStatus.SUCCESS and retry.tags["dagster/retry_number"] == "1"
    assert all(r.status == DagsterRunStatus.SUCCESS for r in runs if r.run_id != killed)
    tokens = instance.get_materialized_partitions(AssetKey(["docs", "tokens"]))
    assert set(keys) <= tokens
