"""Fixtures for the Dagster pipeline tests: a tiny real-text corpus, a recipe, definitions.

Everything is small (a few dozen documents, 32-token sequences) so the whole directory runs in
well under the suite's budget; the tokenizer is the bundled GPT-2 from the root ``conftest.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the code location (assets/, pipelines/) lives at the repo root
    sys.path.insert(0, str(ROOT))

from dagster import DagsterInstance, Definitions  # noqa: E402
from pipeline_project import make_project, tiny_documents  # noqa: E402

from pipelines.build import build_definitions, resources_for  # noqa: E402
from tokenmill.recipe import Recipe  # noqa: E402


@pytest.fixture(scope="session")
def documents() -> dict[str, list[dict[str, str]]]:
    """Short real documents (see ``project.tiny_documents``)."""
    return tiny_documents()


@pytest.fixture
def make_recipe(
    tmp_path: Path, gpt2_dir: Path, documents: dict[str, list[dict[str, str]]]
) -> Callable[..., Recipe]:
    """``make_project`` in ``tmp_path``."""

    def make(**overrides: Any) -> Recipe:
        return make_project(tmp_path, gpt2_dir, documents, **overrides)

    return make


@pytest.fixture
def recipe(make_recipe: Callable[..., Recipe]) -> Recipe:
    """The default tiny recipe: docs (3 shards + one with 3 bad lines) and code (2 shards)."""
    return make_recipe()


@pytest.fixture
def defs(recipe: Recipe) -> Definitions:
    """Definitions of the tiny recipe."""
    return build_definitions(recipe)


@pytest.fixture
def resources(recipe: Recipe) -> dict[str, object]:
    """The storage and tokenizer resources of the tiny recipe."""
    return resources_for(recipe)


@pytest.fixture
def instance() -> DagsterInstance:
    """An in-memory Dagster instance."""
    with DagsterInstance.ephemeral() as inst:
        yield inst
