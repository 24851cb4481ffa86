"""Fixtures for the fault suite: the pipeline's tiny recipe project (as ``tests/pipeline`` builds
it) beside the server fixtures every directory gets from ``tests/conftest.py``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]
for extra in (TESTS.parent, TESTS / "pipeline"):  # the code location; pipeline_project.py
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from pipeline_project import make_project, tiny_documents  # noqa: E402

from tokenmill.recipe import Recipe  # noqa: E402


@pytest.fixture(scope="session")
def documents() -> dict[str, list[dict[str, str]]]:
    """Short real documents (see ``pipeline_project.tiny_documents``)."""
    return tiny_documents()


@pytest.fixture
def make_recipe(
    tmp_path: Path, gpt2_dir: Path, documents: dict[str, list[dict[str, str]]]
) -> Callable[..., Recipe]:
    """``make_project`` in ``tmp_path``: keyword overrides merge into the recipe's sections."""

    def make(**overrides: Any) -> Recipe:
        return make_project(tmp_path, gpt2_dir, documents, **overrides)

    return make
