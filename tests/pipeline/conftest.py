"""Fixtures for the Dagster pipeline tests: the tiny recipe, its definitions and resources.

Everything is small (a few dozen documents, 32-token sequences) so the whole directory runs in
well under the suite's budget; the corpus, ``make_recipe`` and the bundled GPT-2 come from the
root ``conftest.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from dagster import DagsterInstance, Definitions

from assets.support.resources import StorageResource
from pipelines.build import build_definitions, resources_for
from tokenmill.recipe import Recipe


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
def storage(resources: dict[str, object]) -> StorageResource:
    """The storage resource of the tiny recipe."""
    store = resources["storage"]
    assert isinstance(store, StorageResource)
    return store


@pytest.fixture
def instance() -> DagsterInstance:
    """An in-memory Dagster instance."""
    with DagsterInstance.ephemeral() as inst:
        yield inst
