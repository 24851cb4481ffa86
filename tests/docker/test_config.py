"""The Docker deployment's configuration against the others (no daemon needed): one image, one
environment contract. infra/docker/dagster.yaml reads the same instance variables as
infra/dagster.yaml and infra/ecs/dagster.yaml, forwards every one of them (and the recipe and
S3 settings) into run containers, and runs the same code location as the image's default command
and the Helm chart's user deployment."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster._config import process_config
from dagster._core.instance.config import dagster_instance_config
from dagster_docker import DockerRunLauncher

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
PG = {f"DAGSTER_PG_{n}" for n in ("HOST", "PORT", "USERNAME", "PASSWORD", "DB")}
# What a run needs besides the instance: the recipe, and S3 as boto3 reads it.
RUN_ENV = {"TOKENMILL_RECIPE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def env_names(node: Any) -> set[str]:
    """Every ``{env: NAME}`` in a config tree."""
    if isinstance(node, dict):
        if set(node) == {"env"}:
            return {node["env"]}
        return {n for value in node.values() for n in env_names(value)}
    if isinstance(node, list):
        return {n for value in node for n in env_names(value)}
    return set()


def instance_env(config: dict[str, Any]) -> set[str]:
    """The variables the instance itself reads (the run launcher's own settings aside)."""
    return env_names({k: v for k, v in config.items() if k != "run_launcher"})


DOCKER = load(INFRA / "docker" / "dagster.yaml")


def test_docker_instance_validates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(DOCKER))
    loaded, _ = dagster_instance_config(str(tmp_path))
    assert loaded["run_launcher"]["class"] == "DockerRunLauncher"
    for name in env_names(DOCKER):
        monkeypatch.setenv(name, "x")
    launcher = process_config(DockerRunLauncher.config_type(), DOCKER["run_launcher"]["config"])
    assert launcher.success, launcher.errors
    assert DOCKER["storage"]["postgres"]["postgres_db"]["scheme"] == "postgresql+psycopg2"
    assert DOCKER["run_coordinator"]["class"] == "QueuedRunCoordinator"
    assert DOCKER["run_monitoring"]["enabled"] and DOCKER["run_monitoring"]["poll_interval_seconds"]
    assert DOCKER["run_retries"] == {"enabled": True, "max_retries": 1}


def test_same_instance_environment_as_host_and_ecs() -> None:
    host, ecs = load(INFRA / "dagster.yaml"), load(INFRA / "ecs" / "dagster.yaml")
    expected = PG | {"TOKENMILL_LOG_BUCKET"}
    assert instance_env(DOCKER) == instance_env(host) == instance_env(ecs) == expected
    for config in (DOCKER, host, ecs):
        assert config["storage"] == host["storage"]
    # each launcher adds only where its image/task comes from
    assert env_names(DOCKER["run_launcher"]) == {"TOKENMILL_IMAGE"}
    assert env_names(ecs["run_launcher"]) == {"TOKENMILL_ECS_TASK_DEFINITION"}


def test_docker_runs_get_what_the_instance_and_the_code_read() -> None:
    config = DOCKER["run_launcher"]["config"]
    forwarded = set(config["env_vars"])
    assert instance_env(DOCKER) | RUN_ENV <= forwarded
    assert "TOKENMILL_IMAGE" not in forwarded  # the daemon's, not the run's
    assert config["network"] == "host"
    assert all(v.endswith(":ro") for v in config["container_kwargs"]["volumes"])  # no data volume


def test_helm_provides_the_same_contract() -> None:
    """The chart renders the Postgres settings itself (the DAGSTER_PG_* role), and gives the code
    server and every run pod the recipe and the AWS secret."""
    helm = load(INFRA / "helm" / "values.yaml")
    [deployment] = helm["dagster-user-deployments"]["deployments"]
    assert {e["name"] for e in deployment["env"]} >= {"TOKENMILL_RECIPE"}
    aws = {s["name"] for s in deployment["envSecrets"]}
    launcher = helm["runLauncher"]["config"]["k8sRunLauncher"]
    assert aws and aws <= {s["name"] for s in launcher["envSecrets"]}
    assert (
        helm["postgresql"]["postgresqlScheme"]
        == DOCKER["storage"]["postgres"]["postgres_db"]["scheme"]
    )
    assert helm["dagsterDaemon"]["runMonitoring"]["enabled"]
    assert helm["dagsterDaemon"]["runRetries"]["enabled"]


def test_one_image_one_code_location() -> None:
    """The image's default command, the Helm user deployment and the Docker code server all
    serve ``pipelines.definitions`` from ``/opt/tokenmill``."""
    dockerfile = (INFRA / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.M)
    assert "WORKDIR /opt/tokenmill" in dockerfile and "/opt/venv/bin:" in dockerfile
    cmd = re.search(r"^CMD (\[.*?\])$", dockerfile, re.M | re.S)
    assert cmd is not None
    args = yaml.safe_load(cmd.group(1).replace("\\\n", ""))
    helm = load(INFRA / "helm" / "values.yaml")
    [deployment] = helm["dagster-user-deployments"]["deployments"]
    grpc = deployment["dagsterApiGrpcArgs"]
    for flag in ("--module-name", "--working-directory"):
        assert args[args.index(flag) + 1] == grpc[grpc.index(flag) + 1]
    workspace = (INFRA / "docker" / "workspace.yaml").read_text()
    assert "-m pipelines.definitions -d /opt/tokenmill" in workspace
    assert load(INFRA / "docker" / "workspace.yaml")["load_from"][0]["grpc_server"]["port"]
