"""Fixtures for the production tests: a Postgres database of its own per test on the session's
server (dynamic partitions and runs live in the instance, so tests must not see each other's)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import psycopg2
import pytest
from prod_servers import Postgres


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
