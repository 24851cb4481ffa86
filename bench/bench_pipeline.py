"""Scale-out of the pipeline through Dagster's run queue: 64 small shards, 1/2/4 concurrent runs.

For each concurrency C (order alternates over repeats): a fresh SQLite ``DAGSTER_HOME`` whose
``QueuedRunCoordinator`` allows C runs at once, and the code location ``pipelines.definitions``
(a bench recipe) served by a code server process, as ``dagster-daemon`` serves it. One run of
``docs_shard_job`` per shard is submitted through Dagster's GraphQL launch mutation (what the UI
and ``DagsterGraphQLClient`` send; the runs wait in the queue), then the queue daemon's own
iteration dequeues them and ``DefaultRunLauncher`` starts each as its own process: real
concurrent runs. Then one ``refresh_job`` run (merge, indices, blend). Then a backfill of every
shard at the highest C: the shard assets' ``BackfillPolicy`` makes ceil(P/16) range runs. Last,
the sensor path: the shards appear as a burst of new files, the sensor daemon's own iteration
evaluates ``docs_shard_sensor`` (in the code server) and requests ceil(P/16) range runs, which
the queue launches; then the refresh. ``--docker-host`` adds the Docker variant's cost per run:
a container of ``--image`` started on the host network against the same Python start on the
host (tests/docker builds that image and runs the whole deployment in containers).

Reported per mode: wall and CPU seconds (user+sys of the bench and every process under it; the
bench is a child subreaper, so run processes are reaped into it), events per run (event log),
and per-partition overhead = wall·C/P − the pure tokenize seconds of a shard (``tokenize_files``
in this process, the baseline). An S3 phase runs one shard and the refresh on moto_server and
counts requests and bytes by operation. Prints a table, writes ``bench/out/pipeline.json``.
Run: ``.venv/bin/python bench/bench_pipeline.py [--quick] [--repeats 1]``. A run costs ≈ 3–7
CPU-s however small its shard, so the default (64 shards × 3 concurrencies + the backfill and
the sensor burst) takes 15–25 minutes on 2 vCPUs; ``--quick`` (16 shards, 2 in the S3 phase)
4–6 minutes; ``--skip-runs`` (only the backfill and the sensor burst) 1–2 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml
from _pipeline_s3 import s3_traffic
from _util import table, write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the code location (assets/, pipelines/)
sys.path.insert(0, str(ROOT / "tests"))  # pipeline_project's shard backfill
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PR_SET_CHILD_SUBREAPER = 36
LOCATION = "tokenmill"
TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}  # runs log to the DB only
SUBMIT = """
mutation Submit($executionParams: ExecutionParams!) {
  launchPipelineExecution(executionParams: $executionParams) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}
"""


def make_corpus(out: Path, shards: int) -> list[Path]:
    """``shards`` JSONL files of real text (stdlib sources cut to 2,000 characters), ~32 KB each."""
    from tokenmill_dev.corpus import stdlib_documents, write_jsonl_shards

    docs = ({"text": d["text"][:2000]} for d in stdlib_documents(kind="all"))
    return write_jsonl_shards(docs, out, shards=shards, max_bytes=shards * 32_000)


def tokenize_baseline(shards: list[Path], tokenizer: Path, out: Path) -> dict[str, float]:
    """Pure tokenize seconds per shard: ``tokenize_files`` on each shard in this process (the
    first one also warms the tokenizer and is left out)."""
    from tokenmill.tokenize.run import tokenize_files

    walls, cpus = [], []
    for i, shard in enumerate(shards):
        wall, cpu = time.perf_counter(), time.process_time()
        tokenize_files([shard], out / f"b{i}", tokenizer, append_eod=True, progress=False)
        if i:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return {"wall": sum(walls) / len(walls), "cpu": sum(cpus) / len(cpus)}


def write_recipe(path: Path, root: str, source: str, tokenizer: Path, endpoint: str = "") -> Path:
    """A one-dataset recipe (``docs``) with a blend of it; ``root`` may be an ``s3://`` URI."""
    storage: dict[str, Any] = {"root": root}
    if endpoint:
        storage["s3_endpoint_url"] = endpoint
    recipe = {
        "storage": storage,
        "tokenizer": {"path": str(tokenizer), "append_eod": True},
        "datasets": {"docs": {"source": source, "on_bad_record": "quarantine"}},
        "nanoset": {"sequence_length": 128, "split": "90,5,5", "seed": 1, "train_samples": 2000},
        "blends": {"mix": {"weights": {"docs": 1.0}}},
    }
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def cpu_seconds() -> float:
    """User+sys seconds of this process, every reaped descendant, and every live descendant
    with the children it reaped (the code server reaps its runs), at this moment."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def reap_descendants(timeout: float = 90.0) -> None:
    """Wait for every process left under this subreaper (the code server shuts down after its
    context closes), so their CPU time counts; gives up after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.1)


@contextlib.contextmanager
def queue_instance(home: Path, recipe: Path, concurrency: int) -> Iterator[tuple[Any, Any]]:
    """(instance, workspace process context): SQLite under ``home`` with a run queue of
    ``concurrency`` and the code location served by a code server process."""
    from dagster import DagsterInstance
    from dagster._core.test_utils import create_test_daemon_workspace_context
    from dagster._core.workspace.load_target import ModuleTarget

    home.mkdir(parents=True)
    config = {
        "run_coordinator": {
            "module": "dagster._core.run_coordinator",
            "class": "QueuedRunCoordinator",
        },
        "concurrency": {"runs": {"max_concurrent_runs": concurrency}},
        "telemetry": {"enabled": False},
    }
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    os.environ.update(DAGSTER_HOME=str(home), TOKENMILL_RECIPE=str(recipe))
    target = ModuleTarget(
        module_name="pipelines.definitions",
        attribute=None,
        working_directory=str(ROOT),
        location_name=LOCATION,
    )
    with (
        DagsterInstance.get() as instance,
        create_test_daemon_workspace_context(target, instance) as context,
    ):
        yield instance, context


def submit(context: Any, job: str, tags: dict[str, str]) -> str:
    """Queue one run of ``job`` the way the UI does; its run id."""
    from dagster_graphql.test.utils import execute_dagster_graphql

    params = {
        "selector": {
            "repositoryLocationName": LOCATION,
            "repositoryName": "__repository__",
            "jobName": job,
        },
        "runConfigData": QUIET,
        "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in tags.items()]},
    }
    result = execute_dagster_graphql(
        context.create_request_context(), SUBMIT, {"executionParams": params}
    )
    answer = result.data["launchPipelineExecution"]
    if answer["__typename"] != "LaunchRunSuccess":
        raise RuntimeError(f"submitting {job} {tags}: {answer}")
    return str(answer["run"]["runId"])


def drain(instance: Any, context: Any, run_ids: list[str], daemons: list[Any]) -> None:
    """Iterate the daemons (queue, backfill) until every run in ``run_ids`` (or, when empty,
    every run) has finished; RuntimeError naming failed runs."""
    while True:
        for daemon in daemons:
            list(daemon(context))
        runs = instance.get_runs()
        mine = [r for r in runs if not run_ids or r.run_id in run_ids]
        if mine and all(r.status.value in TERMINAL for r in mine) and not _backfill_open(instance):
            failed = [r.run_id for r in mine if r.status.value != "SUCCESS"]
            if failed:
                raise RuntimeError(
                    f"runs failed: {failed} (DAGSTER_HOME {os.environ['DAGSTER_HOME']})"
                )
            return
        time.sleep(0.2)


def _backfill_open(instance: Any) -> bool:
    return any(b.status.value == "REQUESTED" for b in instance.get_backfills())


def queue_daemon() -> Any:
    """One iteration of the run queue (what ``dagster-daemon`` runs every few seconds)."""
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import (
        QueuedRunCoordinatorDaemon,
    )

    daemon = QueuedRunCoordinatorDaemon(interval_seconds=0)
    return lambda context: daemon.run_iteration(context)


def backfill_daemon(instance: Any, context: Any, keys: list[str]) -> Any:
    """Request a backfill of the shard assets over ``keys``; one backfill daemon iteration."""
    from dagster._daemon.backfill import execute_backfill_iteration
    from dagster._daemon.daemon import get_default_daemon_logger
    from pipeline_project import add_shard_backfill  # the tests' backfill, as the UI submits it

    graph = context.create_request_context().asset_graph
    add_shard_backfill(instance, graph, keys, run_config=QUIET)
    logger = get_default_daemon_logger("BackfillDaemon")
    return lambda ctx: execute_backfill_iteration(ctx, logger)


def sensor_daemon(instance: Any, context: Any) -> Any:
    """The sensor daemon's iteration with only the shard sensor running (the automation sensor
    is stopped, so the refresh stays one measured run)."""
    from dagster._daemon.daemon import get_default_daemon_logger
    from dagster._daemon.sensor import execute_sensor_iteration

    repo = (
        context.create_request_context()
        .get_code_location(LOCATION)
        .get_repository("__repository__")
    )
    automation = repo.get_sensor("tokenmill_automation")
    instance.stop_sensor(automation.get_remote_origin_id(), automation.selector_id, automation)
    logger = get_default_daemon_logger("SensorDaemon")
    return lambda ctx: execute_sensor_iteration(ctx, logger, None, None)


def run_mode(work: Path, source: Path, tokenizer: Path, concurrency: int, mode: str) -> dict:
    """One measured pass: shard runs (``runs``: one per shard; ``backfill``: backfill ranges;
    ``sensor``: the shard sensor's range runs for a burst of new shards) then the refresh run.
    Event bytes are the serialized events, as the event log stores them (Postgres: one row
    each)."""
    from dagster import serialize_value

    tag = f"{mode}-c{concurrency}-{time.monotonic_ns()}"
    recipe = write_recipe(work / f"{tag}.yaml", str(work / tag / "root"), str(source), tokenizer)
    keys = sorted(p.name.split(".")[0] for p in source.iterdir())
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    with queue_instance(work / tag / "home", recipe, concurrency) as (instance, context):
        if mode != "sensor":  # the sensor registers the shards it finds
            instance.add_dynamic_partitions("docs_shards", keys)
        start, cpu_start = time.perf_counter(), cpu_seconds()
        daemons = [queue_daemon()]
        shard_ids: list[str] = []
        if mode == "backfill":
            daemons.append(backfill_daemon(instance, context, keys))
        elif mode == "sensor":
            daemons.append(sensor_daemon(instance, context))
        else:
            shard_ids = [submit(context, "docs_shard_job", {"dagster/partition": k}) for k in keys]
        drain(instance, context, shard_ids, daemons)
        shards_wall, shards_cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
        shard_runs = [r.run_id for r in instance.get_runs()]
        start, cpu_start = time.perf_counter(), cpu_seconds()
        refresh = submit(context, "refresh_job", {})
        drain(instance, context, [refresh], daemons[:1])
        refresh_wall, refresh_cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
        logs = {r: instance.all_logs(r) for r in [*shard_runs, refresh]}
        events = {r: len(entries) for r, entries in logs.items()}
        stored = {r: sum(len(serialize_value(e)) for e in entries) for r, entries in logs.items()}
        kinds = Counter(
            e.dagster_event.event_type_value
            for r in shard_runs[:1]
            for e in instance.all_logs(r)
            if e.dagster_event
        )
    reap_descendants()
    return {
        "mode": mode,
        "concurrency": concurrency,
        "partitions": len(keys),
        "runs": len(shard_runs),
        "shards_wall": shards_wall,
        "refresh_wall": refresh_wall,
        "shards_cpu": shards_cpu,
        "refresh_cpu": refresh_cpu,
        "wall": time.perf_counter() - wall0,
        "cpu": cpu_seconds() - cpu0,
        "events_per_shard_run": sum(events[r] for r in shard_runs) / len(shard_runs),
        "events_refresh_run": events[refresh],
        "event_bytes_per_shard_run": sum(stored[r] for r in shard_runs) / len(shard_runs),
        "event_bytes_refresh_run": stored[refresh],
        "event_kinds_first_shard_run": dict(sorted(kinds.items())),
    }


COLUMNS = [  # (header, value of one result row)
    ("mode", lambda r: r["mode"]),
    ("C", lambda r: str(r["concurrency"])),
    ("runs", lambda r: str(r["runs"])),
    ("shards wall s", lambda r: f"{r['shards_wall']:.1f}"),
    ("shards CPU s", lambda r: f"{r['shards_cpu']:.1f}"),
    ("overhead s/partition", lambda r: f"{r['overhead_per_partition']:.2f}"),
    ("CPU overhead s/partition", lambda r: f"{r['cpu_overhead_per_partition']:.2f}"),
    ("refresh wall/CPU s", lambda r: f"{r['refresh_wall']:.1f}/{r['refresh_cpu']:.1f}"),
    ("events/run", lambda r: f"{r['events_per_shard_run']:.0f}"),
    ("event KB/run", lambda r: f"{r['event_bytes_per_shard_run'] / 1000:.0f}"),
]


def report(baseline: dict[str, float], results: list[dict[str, Any]]) -> None:
    """Add the overheads against the pure tokenize baseline to each result; print the table."""
    for r in results:
        parts = r["partitions"]
        r["overhead_per_partition"] = r["shards_wall"] * r["concurrency"] / parts - baseline["wall"]
        r["cpu_overhead_per_partition"] = r["shards_cpu"] / parts - baseline["cpu"]
    print(table([[h for h, _ in COLUMNS], *([cell(r) for _, cell in COLUMNS] for r in results)]))
    print(
        f"baseline: pure tokenize {baseline['wall']:.3f} s wall, {baseline['cpu']:.3f} s CPU per"
        " shard (tokenize_files in process)"
    )


def container_cost(docker_host: str, image: str, repeats: int = 5) -> dict[str, float]:
    """Median seconds of: a container of ``image`` on the host network that exits at once; one
    that imports the code location (what a run worker does first), and that import on the host.
    The difference is what the Docker variant adds to each run."""
    import statistics
    import subprocess

    env = {**os.environ, "DOCKER_HOST": docker_host}
    probe = "import dagster, dagster_postgres, dagster_aws, pipelines.build"
    docker = ["docker", "run", "--rm", "--network", "host", image]

    def median(cmd: list[str], **kwargs: Any) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run(cmd, check=False, capture_output=True, **kwargs)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    host = median(
        [sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT
    )
    result = {
        "container_true": median([*docker, "true"], env=env),
        "container_python": median([*docker, "python", "-c", probe], env=env),
        "host_python": host,
    }
    result["per_run"] = result["container_python"] - result["host_python"]
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); 0 on success."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 shards, no repeats")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=1, help="passes over the concurrencies")
    parser.add_argument("--s3-shards", type=int, default=4, help="shards in the S3 phase (0: skip)")
    parser.add_argument("--skip-runs", action="store_true", help="only the backfill and sensor")
    parser.add_argument("--docker-host", help="DOCKER_HOST of a daemon holding --image")
    parser.add_argument("--image", default="tokenmill:e2e", help="the project image (make image)")
    args = parser.parse_args(argv)
    shards = 16 if args.quick else args.shards
    s3_shards = min(args.s3_shards, 2) if args.quick else args.s3_shards
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    from tokenmill_dev.bundled import build_bundled_tokenizer

    tokenizer = build_bundled_tokenizer("gpt2", ROOT / ".tokenizers" / "gpt2")
    load = {"before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-pipeline-") as tmp:
        work = Path(tmp)
        corpus = make_corpus(work / "sources", shards)
        shard_bytes = sum(p.stat().st_size for p in corpus) / shards
        (work / "baseline").mkdir()
        baseline = tokenize_baseline(corpus, tokenizer, work / "baseline")
        results = []
        for rep in range(0 if args.skip_runs else args.repeats):
            for c in args.concurrency if rep % 2 == 0 else args.concurrency[::-1]:
                results.append(run_mode(work, work / "sources", tokenizer, c, "runs"))
                print(f"runs, C={c}: {results[-1]['wall']:.1f} s", flush=True)
        top = max(args.concurrency)
        for mode in ("backfill", "sensor"):
            results.append(run_mode(work, work / "sources", tokenizer, top, mode))
            print(f"{mode}, C={top}: {results[-1]['wall']:.1f} s", flush=True)
        docker = container_cost(args.docker_host, args.image) if args.docker_host else {}
        traffic = {}
        if s3_shards:
            traffic = s3_traffic(work / "s3", corpus[:s3_shards], tokenizer, write_recipe, QUIET)
    load["after"] = os.getloadavg()
    report(baseline, results)
    if docker:
        print(
            f"Docker: container start+exit {docker['container_true']:.2f} s; a run's Python start "
            f"(import the code location) {docker['container_python']:.2f} s in a container vs "
            f"{docker['host_python']:.2f} s on the host: +{docker['per_run']:.2f} s wall per run"
        )
    if traffic:
        print("S3 per run (moto_server):")
        for run in traffic["runs"]:
            print(
                f"  {run['job']}: {run['requests']}, {run['bytes_up']} B up, "
                f"{run['bytes_down']} B down"
            )
    from assets.shards import PARTITIONS_PER_BACKFILL_RUN

    expected = math.ceil(shards / PARTITIONS_PER_BACKFILL_RUN)
    path = write_results(
        "pipeline",
        {
            "shards": shards,
            "shard_bytes": shard_bytes,
            "baseline_tokenize_per_shard": baseline,
            "results": results,
            "backfill_runs_expected": expected,
            "s3": traffic,
            "docker": docker,
            "loadavg": load,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
