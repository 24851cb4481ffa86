"""The tree stays ruff-clean (lint and format) and the library and the Dagster code location
mypy-clean, so CI catches what `make lint` would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args: list[str]) -> None:
    proc = subprocess.run([str(RUFF), *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy() -> None:
    """The library and the code location (``assets``, ``pipelines``) type-check (``make
    lint``'s mypy), so a type error fails CI too."""
    mypy = Path(sys.executable).with_name("mypy")
    proc = subprocess.run(
        [str(mypy), "tokenmill", "assets", "pipelines"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
