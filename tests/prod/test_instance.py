"""The production instance configs: infra/dagster.yaml on a real Postgres (and S3 for logs),
the ECS variant and the Helm values through Dagster's own config validation."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml
from dagster import DagsterInstance, asset, materialize
from dagster._config import process_config
from dagster._core.instance.config import dagster_instance_config
from dagster._serdes.config_class import class_from_code_pointer
from prod_servers import S3, Postgres

INFRA = Path(__file__).resolve().parents[2] / "infra"


@pytest.fixture
def prod_env(postgres: Postgres, s3: S3, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment infra/*.yaml read: the test Postgres, the moto bucket, a task family."""
    env = {
        **postgres.env(),
        "TOKENMILL_LOG_BUCKET": s3.bucket,
        "TOKENMILL_ECS_TASK_DEFINITION": "tokenmill-run",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def home_with(tmp_path: Path, config: Path) -> Path:
    """A DAGSTER_HOME holding ``config`` as its dagster.yaml."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(config, home / "dagster.yaml")
    return home


def configurable_sections(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{section: {module, class, config}}`` of an instance config (the pluggable classes)."""
    return {k: v for k, v in config.items() if isinstance(v, dict) and "module" in v}


@pytest.mark.parametrize("path", ["dagster.yaml", "ecs/dagster.yaml"])
def test_every_configurable_class_validates(path: str, prod_env: dict[str, str]) -> None:
    config, _ = dagster_instance_config(str((INFRA / path).parent), (INFRA / path).name)
    sections = configurable_sections(config)
    assert {"compute_logs", "run_coordinator"} <= set(sections)
    instance_class = sections.pop("instance_class")  # not a ConfigurableClass: no config
    assert issubclass(
        class_from_code_pointer(instance_class["module"], instance_class["class"]), DagsterInstance
    )
    for name, section in sections.items():
        cls = class_from_code_pointer(section["module"], section["class"])
        result = process_config(cls.config_type(), section.get("config", {}))
        assert result.success, f"{path} {name}: {result.errors}"
    if path.startswith("ecs/"):
        assert sections["run_launcher"]["class"] == "EcsRunLauncher"


def test_postgres_instance_runs_an_asset_graph(
    prod_env: dict[str, str], postgres: Postgres, tmp_path: Path
) -> None:
    """infra/dagster.yaml as is: run, event and schedule storage in Postgres; a materialization
    of two assets is recorded there (checked with a direct SQL query)."""

    @asset
    def numbers() -> list[int]:
        return [1, 2, 3]

    @asset
    def total(numbers: list[int]) -> int:
        return sum(numbers)

    home = home_with(tmp_path, INFRA / "dagster.yaml")
    with DagsterInstance.from_config(str(home)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
        assert type(instance.compute_log_manager).__name__ == "S3ComputeLogManager"
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        result = materialize([numbers, total], instance=instance)
        assert result.success and result.output_for_node("total") == 6
        run_id = result.run_id
        assert instance.get_latest_materialization_event(total.key) is not None
    dsn = f"host={postgres.host} port={postgres.port} user={postgres.user} dbname={postgres.db}"
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT status FROM runs WHERE run_id = %s", (run_id,))
        assert cur.fetchall() == [("SUCCESS",)]
        cur.execute(
            "SELECT count(*) FROM event_logs WHERE run_id = %s AND dagster_event_type = %s",
            (run_id, "ASSET_MATERIALIZATION"),
        )
        assert cur.fetchone() == (2,)


def test_queue_limits_agree_between_instance_and_helm() -> None:
    """The Helm values queue the same kinds of runs as the instance files (tags and keys)."""
    values = yaml.safe_load((INFRA / "helm" / "values.yaml").read_text())
    queued = values["concurrency"]["runs"]
    instance = yaml.safe_load((INFRA / "ecs" / "dagster.yaml").read_text())
    runs = instance["concurrency"]["runs"]
    assert queued["maxConcurrentRuns"] == runs["max_concurrent_runs"]
    assert [(t["key"], t["limit"]) for t in queued["tagConcurrencyLimits"]] == [
        (t["key"], t["limit"]) for t in runs["tag_concurrency_limits"]
    ]


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate mapping keys (PyYAML silently keeps the last)."""


def _no_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    keys = [loader.construct_object(k) for k, _ in node.value]
    duplicated = sorted({str(k) for k in keys if keys.count(k) > 1})
    if duplicated:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate keys {duplicated}", node.start_mark
        )
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def test_helm_values_lint() -> None:
    """Offline lint of the chart values: YAML without duplicate keys or tabs, lines <= 100,
    and the K8sRunLauncher / external Postgres / S3 log settings the deployment relies on."""
    text = (INFRA / "helm" / "values.yaml").read_text()
    assert "\t" not in text
    assert max(len(line) for line in text.splitlines()) <= 100
    values = yaml.load(text, Loader=_UniqueKeyLoader)
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert launcher["envSecrets"] == [{"name": "tokenmill-aws"}]
    assert values["postgresql"]["enabled"] is False
    assert values["postgresql"]["postgresqlScheme"] == "postgresql+psycopg2"
    assert values["computeLogManager"]["type"] == "S3ComputeLogManager"
    deployment = values["dagster-user-deployments"]["deployments"][0]
    assert deployment["dagsterApiGrpcArgs"][:2] == ["--module-name", "pipelines.definitions"]
    for path in ("helm/values.yaml", "dagster.yaml", "ecs/dagster.yaml"):
        yaml.load((INFRA / path).read_text(), Loader=_UniqueKeyLoader)


def test_dockerfile_serves_the_code_location() -> None:
    """The image copies what the code location imports and serves the module workspace.yaml
    names (a Docker build needs a daemon and network, so this is checked statically)."""
    text = (INFRA / "Dockerfile").read_text()
    for folder in ("assets/", "pipelines/", "recipes/"):  # the code location, from build/image
        assert f"COPY src/{folder} {folder}" in text
    # the library is installed from the staged source against the host-built wheelhouse
    assert "COPY src/ /tmp/src/" in text and "--no-index" in text and "/tmp/src" in text
    workspace = yaml.safe_load((INFRA.parent / "workspace.yaml").read_text())
    module = workspace["load_from"][0]["python_module"]["module_name"]
    assert f'"--module-name", "{module}"' in text
