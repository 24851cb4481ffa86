"""The Dagster side is layered one way, and uses Dagster's public API.

``pipelines`` may import ``assets``; ``assets`` (and its ``support`` package below both) never
imports ``pipelines``; ``assets.support`` imports no asset stage. Dagster's private API
(``dagster._…`` modules, non-``@public`` instance methods) is used by the code location in one
module only, ``FENCE``, behind its version guard; the tests and benchmarks that drive Dagster's
daemons in process list theirs in ``PRIVATE_KEPT`` (no public API does what they do).
"""

import ast
from pathlib import Path

import dagster
import pytest
from dagster._annotations import is_public

from assets.support import dagster_private

ROOT = Path(__file__).resolve().parents[2]
FENCE = "assets/support/dagster_private.py"
# (file, private module) -> why no public API replaces it.
PRIVATE_KEPT = {
    # This test asks Dagster which instance methods are public.
    ("tests/pipeline/test_layering.py", "dagster._annotations"): "which methods are @public",
    # Driving the daemons in process (backfill, sensor, run queue) has no public API.
    ("tests/pipeline_project.py", "dagster._core.execution.backfill"): "a UI-style backfill",
    ("tests/pipeline_project.py", "dagster._core.utils"): "backfill ids",
    ("tests/prod/test_backfill.py", "dagster._core.test_utils"): "daemon workspace context",
    ("tests/prod/test_backfill.py", "dagster._core.workspace.load_target"): "daemon workspace",
    ("tests/prod/test_backfill.py", "dagster._daemon.backfill"): "backfill daemon iteration",
    ("tests/prod/test_backfill.py", "dagster._daemon.daemon"): "daemon logger",
    ("bench/bench_pipeline.py", "dagster._core.test_utils"): "daemon workspace context",
    ("bench/bench_pipeline.py", "dagster._core.workspace.load_target"): "daemon workspace",
    ("bench/bench_pipeline.py", "dagster._daemon.run_coordinator.queued_run_coordinator_daemon"): (
        "run queue daemon iteration"
    ),
    ("bench/bench_pipeline.py", "dagster._daemon.backfill"): "backfill daemon iteration",
    ("bench/bench_pipeline.py", "dagster._daemon.daemon"): "daemon logger",
    ("bench/bench_pipeline.py", "dagster._daemon.sensor"): "sensor daemon iteration",
    # The UI's stale status has no public Python API (GraphQL only); the test compares it.
    ("tests/pipeline/test_materialize.py", "dagster._core.definitions.data_version"): "UI status",
    ("tests/pipeline/test_materialize.py", "dagster._core.loader"): "UI status loading context",
    # Validating dagster.yaml files against Dagster's own schema has no public API.
    ("tests/prod/test_backfill.py", "dagster._core.instance.config"): "dagster.yaml schema",
    ("tests/prod/test_instance.py", "dagster._core.instance.config"): "dagster.yaml schema",
    ("tests/prod/test_instance.py", "dagster._config"): "dagster.yaml schema",
    ("tests/prod/test_instance.py", "dagster._serdes.config_class"): "dagster.yaml classes",
    ("tests/docker/test_config.py", "dagster._core.instance.config"): "dagster.yaml schema",
    ("tests/docker/test_config.py", "dagster._config"): "dagster.yaml schema",
    # The reproduction of the retry race RetrySafeInstance (in FENCE) works around.
    ("tests/docker/test_retry_order.py", "dagster._core.storage.tags"): "retry tag names",
    ("tests/docker/test_retry_order.py", "dagster._core.events"): "a run-failure event",
    (
        "tests/docker/test_retry_order.py",
        "dagster._daemon.auto_run_reexecution.auto_run_reexecution",
    ): ("the retry daemon's decision, replayed"),
    (
        "tests/docker/test_retry_order.py",
        "dagster._daemon.auto_run_reexecution.event_log_consumer",
    ): ("the retry daemon, driven in process"),
    ("tests/docker/test_e2e_docker.py", "dagster._core.storage.tags"): "retry tag names",
}


def imports(path: Path) -> list[str]:
    """Every module a file imports (``from x import y`` gives ``x``), at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module)
    return found


def files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_assets_never_import_pipelines() -> None:
    bad = [
        f"{p.relative_to(ROOT)}: {m}"
        for p in files("assets")
        for m in imports(p)
        if m == "pipelines" or m.startswith("pipelines.")
    ]
    assert not bad, bad


def test_support_imports_no_asset_stage() -> None:
    bad = [
        f"{p.relative_to(ROOT)}: {m}"
        for p in files("assets/support")
        for m in imports(p)
        if m.startswith("assets.") and not m.startswith("assets.support")
    ]
    assert not bad, bad


def test_materialize_and_summary_import_no_asset_stage() -> None:
    """Their business logic (staleness, counts) lives in ``assets.support`` or ``tokenmill``."""
    bad = [
        f"{name}: {m}"
        for name in ("pipelines/materialize.py", "pipelines/summary.py")
        for m in imports(ROOT / name)
        if m == "assets" or (m.startswith("assets.") and not m.startswith("assets.support"))
    ]
    assert not bad, bad


def test_no_private_dagster_imports() -> None:
    used = {
        (p.relative_to(ROOT).as_posix(), m)
        for p in files("assets", "pipelines", "tests", "bench")
        for m in imports(p)
        if m.startswith("dagster._")
    }
    fenced = {(path, m) for path, m in used if path == FENCE}
    assert fenced  # the fence is where they are, not a name that went stale
    assert used - fenced - set(PRIVATE_KEPT) == set()
    assert not any(path.startswith(("assets/", "pipelines/")) for path, _ in PRIVATE_KEPT)
    # The allow-list names only imports that are still there.
    assert set(PRIVATE_KEPT) - used == set()


def test_private_instance_methods_only_in_the_fence() -> None:
    """Non-``@public`` ``DagsterInstance`` methods are invisible to the import scan: the code
    location calls them (by name, on anything) only in ``FENCE``."""
    instance = dagster.DagsterInstance
    private = set()
    for name in dir(instance):
        member = getattr(instance, name, None)
        member = member.fget if isinstance(member, property) else member
        if not name.startswith("__") and callable(member) and not is_public(member):
            private.add(name)
    assert {"report_run_failed", "get_latest_storage_id_by_partition"} <= private
    used = [
        f"{p.relative_to(ROOT)}:{node.lineno}: {node.attr}"
        for p in files("assets", "pipelines")
        if p.relative_to(ROOT).as_posix() != FENCE
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr in private
    ]
    assert used == []


def test_the_fence_refuses_an_untested_dagster() -> None:
    assert dagster.__version__ in dagster_private.TESTED_DAGSTER
    with pytest.raises(dagster_private.UntestedDagsterError) as caught:
        dagster_private.check_dagster_version("9.0.0")
    message = str(caught.value)
    assert "tested with dagster 1.13.27, found 9.0.0" in message
    assert "assets/support/dagster_private.py" in message and "TESTED_DAGSTER" in message


@pytest.mark.parametrize("source", ["from pipelines import jobs", "import pipelines.sensors"])
def test_the_import_scan_sees_both_forms(tmp_path: Path, source: str) -> None:
    path = tmp_path / "m.py"
    path.write_text(f"def f():\n    {source}\n", encoding="utf-8")
    assert any(m.startswith("pipelines") for m in imports(path))
