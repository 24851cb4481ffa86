"""Developer tooling: the test tiers that ``make test-fast`` deselects, CI mode (a skipped tier
fails), ``make dev``'s silenced ``dg`` hint, and the lean install of ``make demo``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DAGSTER = Path(sys.executable).with_name("dagster")


def _make_variable(text: str, pattern: str) -> str:
    """The value captured by ``pattern`` on the one Makefile line it matches."""
    [value] = re.findall(pattern, text, flags=re.MULTILINE)
    return str(value)


def _collected(*args: str) -> set[str]:
    """Node ids pytest selects with ``args`` (collection only; the ``-q`` of pyproject's addopts
    makes it list ids)."""
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only"]
    proc = subprocess.run(
        [*pytest, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing selected
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_fast_tier_deselects_servers_browser_docker_and_slow() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\ntest-fast:", 1)[1].split("\n\n", 1)[0]
    assert "pytest -p no:cacheprovider --fast" in recipe
    paths = (
        "tests/lib/test_s3.py",  # stubbed clients: fast
        "tests/prod/test_pull.py",  # local pulls (fast) and moto_server pulls (servers)
        "tests/faults/test_kill.py",  # slow module
        "tests/pipeline/test_ui.py",  # browser
        "tests/docker",  # docker
    )
    fast = _collected("--fast", *paths)
    assert {node.split("::")[0] for node in fast} == {
        "tests/lib/test_s3.py",
        "tests/prod/test_pull.py",
    }
    servers = _collected("-m", "servers", "tests/prod/test_pull.py")
    assert servers and not servers & fast
    assert all("s3" in node for node in servers)  # the moto_server tests, by their fixtures
    marked = _collected("-m", "slow or browser or docker", *paths[2:])
    assert {node.split("::")[0].split("/")[1] for node in marked} == {
        "faults",
        "pipeline",
        "docker",
    }
    assert len(_collected(*paths)) == len(fast | servers | marked)  # every test is in one tier


def test_make_dev_silences_only_the_dg_hint() -> None:
    """``dagster dev`` warns that it is superseded by ``dg dev``; the Makefile's filter hides
    exactly that warning. A missing DAGSTER_HOME stops the command right after the hint."""
    makefile = (ROOT / "Makefile").read_text()
    value = _make_variable(makefile, r"^dev: export PYTHONWARNINGS := (.+)$")
    command = [str(DAGSTER), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", "1"]
    env = {**os.environ, "DAGSTER_HOME": str(ROOT / "no-such-dagster-home")}
    env.pop("PYTHONWARNINGS", None)

    def stderr(**extra: str) -> str:
        proc = subprocess.run(
            command, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=120
        )
        assert "is not a directory or does not exist" in proc.stderr, proc.stderr
        return proc.stderr

    assert "Use 'dg dev' instead." in stderr()
    quiet = stderr(PYTHONWARNINGS=value)
    assert "superseded" not in quiet and "Invalid -W option" not in quiet


TEST_ONLY = {"torch", "moto", "mypy", "hypothesis", "datasets", "mistral-common", "pytest", "ruff"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def _dry_run(folder: Path, target: str) -> str:
    proc = subprocess.run(
        ["make", "-n", target], cwd=folder, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_make_demo_installs_the_pipeline_only_and_test_adds_its_stack_once(tmp_path: Path) -> None:
    """``make demo`` installs ``.[pipeline,demo]`` (none of the test-only stack), announced on one
    line; ``make test-fast`` adds ``.[test]`` once, then its stamp skips the install."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    assert not (_names(extras["pipeline"]) | _names(extras["demo"])) & TEST_ONLY
    assert _names(extras["test"]) >= TEST_ONLY
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    demo = _dry_run(tmp_path, "demo")
    assert "pip install -q -e '.[pipeline,demo]'" in demo and "test]" not in demo, demo
    assert len(re.findall(r"^echo \"installing .*min", demo, re.M)) == 1, demo
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").touch()
    fast = _dry_run(tmp_path, "test-fast")
    assert "'.[pipeline,demo,test]'" in fast and "'.[pipeline,demo]'" not in fast, fast
    assert 'echo "installing the test stack' in fast, fast
    (tmp_path / ".venv" / ".installed-test").touch()
    assert "pip install" not in _dry_run(tmp_path, "test-fast")


def _pytest_without(tmp_path: Path, missing: set[str], ci: str | None, *args: str) -> str:
    """Run pytest on ``args`` with a PATH holding every tool of this machine but ``missing``
    (symlinks in ``tmp_path``), ``CI`` set to ``ci`` (or unset); its exit status and output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if not Path(folder).is_dir():
            continue
        for tool in Path(folder).iterdir():
            link = bin_dir / tool.name
            if tool.name not in missing and not link.exists() and os.access(tool, os.X_OK):
                link.symlink_to(tool)
    env = {**os.environ, "PATH": str(bin_dir), "PYTHONPATH": str(ROOT)}
    env.pop("CI", None)
    if ci is not None:
        env["CI"] = ci
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", *args]
    proc = subprocess.run(pytest, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    return f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}"


def test_ci_fails_a_skipped_docker_test_naming_what_was_missing(tmp_path: Path) -> None:
    """Without dockerd the container test skips locally, but with ``CI`` set it fails the run
    and says what was missing (tests/conftest.py's ``pytest_runtest_makereport``)."""
    args = ("tests/docker/test_e2e_docker.py",)
    local = _pytest_without(tmp_path / "local", {"dockerd", "docker"}, None, *args)
    assert local.startswith("exit 0\n") and "1 skipped" in local, local
    ci = _pytest_without(tmp_path / "ci", {"dockerd", "docker"}, "true", *args)
    assert ci.startswith("exit 1\n"), ci
    assert "CI is set but this docker test was skipped" in ci, ci
    assert "dockerd not found" in ci or "dockerd needs root" in ci, ci


def test_a_new_dagster_home_has_no_first_visit_dialog(tmp_path: Path) -> None:
    """The UI's newsletter dialog (``nux``) would cover headless screenshots of ``make dev``."""
    from dagster import DagsterInstance

    from pipelines.instance import ensure_dagster_home

    home = ensure_dagster_home(tmp_path / "home")
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.nux_enabled is False


def test_the_suite_builds_tokenizers_outside_the_repo(gpt2_dir: Path) -> None:
    """Without ``make tokenizers``' ``.tokenizers/<name>``, the fixtures build into a cache
    folder outside the work tree (a test run leaves nothing in the repo)."""
    from pipeline_project import TOKENIZER_CACHE, tokenizer_dir

    assert tokenizer_dir("not-built") == TOKENIZER_CACHE / "not-built"
    assert ROOT not in TOKENIZER_CACHE.parents
    repo = ROOT / ".tokenizers" / "gpt2"
    assert gpt2_dir == (repo if (repo / "tokenizer.json").is_file() else TOKENIZER_CACHE / "gpt2")
