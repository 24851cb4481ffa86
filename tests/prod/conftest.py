"""Fixtures for the production tests: the pipeline's tiny recipe project (as ``tests/pipeline``
builds it), and a Postgres database of its own per test on the session's server (dynamic
partitions and runs live in the instance, so tests must not see each other's)."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest

TESTS = Path(__file__).resolve().parents[1]
for extra in (TESTS.parent, TESTS / "pipeline"):  # the code location; pipeline_project.py
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from pipeline_project import make_project, tiny_documents  # noqa: E402
from prod_servers import Postgres  # noqa: E402

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


@pytest.fixture
def pg_database(postgres: Postgres) -> Iterator[Postgres]:
    """A fresh database on the session's Postgres server, dropped after the test."""
    name = f"dagster_{secrets.token_hex(4)}"
    admin = f"host={postgres.host} port={postgres.port} user={postgres.user} dbname={postgres.db}"

    def execute(sql: str) -> None:
        conn = psycopg2.connect(admin)
        conn.autocommit = True  # CREATE/DROP DATABASE cannot run in a transaction
        try:
            with conn.cursor() as cur:
                cur.execute(sql)
        finally:
            conn.close()

    execute(f"CREATE DATABASE {name}")
    try:
        yield Postgres(postgres.host, postgres.port, postgres.user, name)
    finally:
        execute(f"DROP DATABASE {name} WITH (FORCE)")
