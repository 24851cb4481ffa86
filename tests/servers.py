"""Server fixtures (registered by ``tests/conftest.py`` for every directory): real S3
(moto_server) and Postgres servers on loopback, and a blend-shaped storage root.

``moto_server`` is a real HTTP server speaking the S3 protocol (from ``moto[server]``); it runs
as a child process on a free 127.0.0.1 port for the whole session and is stopped by its PID.
Each test gets its own bucket and fake credentials through the environment. Postgres is a
throwaway cluster of Debian's ``postgresql`` (``initdb``/``pg_ctl``), also session-wide.
"""

from __future__ import annotations

import getpass
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
from prod_servers import S3, Postgres
from tiny_pairs import random_dataset

from tokenmill.formats.merge import merge_datasets
from tokenmill.formats.merge import virtual_merge as merge_virtually
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill_dev.moto import free_port, moto_server

SERVER_START_SECONDS = 60


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a moto_server child process, stopped by PID at the end."""
    with moto_server(tmp_path_factory.mktemp("moto") / "server.log", SERVER_START_SECONDS) as url:
        yield url


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    """Fake credentials and the endpoint in the environment; a new bucket for this test."""
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    bucket = f"tm-{secrets.token_hex(6)}"
    client.create_bucket(Bucket=bucket)
    return S3(moto_endpoint, bucket, client)


def _shard(prefix: Path, seed: int, docs: int) -> None:
    """A shard of ``docs`` random documents (uint16 tokens) with its manifest."""
    random_dataset(prefix, docs, seed, kind="tokenized", lengths=(5, 60), vocab=50000)


def build_storage_root(root: Path) -> Path:
    """A pipeline-shaped storage root with blend ``mix``; returns its manifest path.

    ``docs`` is merged from three shards (its ``.bin`` is recorded by parts), ``code`` is a
    single shard, so both kinds of dataset manifest are exercised.
    """
    shards = []
    for i in range(3):
        shards.append(root / "tokens" / "docs" / f"s{i}_text_document")
        _shard(shards[-1], seed=i, docs=40)
    merged = root / "merged" / "docs_text_document"
    merge_datasets(shards, merged)
    code = root / "merged" / "code_text_document"
    _shard(code, seed=7, docs=30)
    build_blend(
        "mix",
        {"docs": merged, "code": code},
        root / "blends" / "mix",
        root / "nanoset",
        BlendSettings(
            NanosetSettings(sequence_length=16, split_spec="90,10,0", train_samples=300),
            weights={"docs": 0.7, "code": 0.3},
        ),
    )
    return root / "blends" / "mix" / "manifest.json"


@pytest.fixture
def storage_root(tmp_path: Path) -> Path:
    """``tmp_path/src``: a storage root holding blend ``mix`` (see ``build_storage_root``)."""
    build_storage_root(tmp_path / "src")
    return tmp_path / "src"


def _pg_bin(name: str) -> str:
    """A Postgres server binary: Debian's newest ``/usr/lib/postgresql/*/bin``, else ``PATH``."""
    versions = sorted(
        Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3])
    )
    found = str(versions[-1]) if versions else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: install Debian's postgresql (.ci/run does)")
    return found


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """``initdb`` + ``pg_ctl start`` on a free loopback port (as ``postgres`` when run as root,
    since the server refuses root); ``pg_ctl stop`` and the data directory removed at the end."""
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    base = Path(tempfile.mkdtemp(prefix="tokenmill-pg-"))
    data, port = base / "data", free_port()
    if as_user:
        shutil.chown(base, "postgres", "postgres")
    user = "postgres" if as_user else getpass.getuser()

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, cwd=base)

    run(_pg_bin("initdb"), "-D", str(data), "-A", "trust", "-U", user, "--no-sync")
    options = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"
    pg_ctl = _pg_bin("pg_ctl")
    run(pg_ctl, "-D", str(data), "-o", options, "-l", str(base / "server.log"), "-w", "start")
    try:
        run(_pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", user, "dagster")
        yield Postgres("127.0.0.1", port, user, "dagster")
    finally:
        run(pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_database(postgres: Postgres) -> Iterator[Postgres]:
    """A fresh database on the session's Postgres server, dropped after the test (dynamic
    partitions and runs live in the instance, so tests must not see each other's)."""
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


def build_stream_root(root: Path, semantics: str) -> Path:
    """A storage root with blend ``mix``: a virtual merge of three shards, a physical merge
    (its ``.bin`` recorded by parts) and a single pair; returns its manifest."""
    shards = []
    for i in range(3):
        shards.append(root / "tokens" / "docs" / f"s{i}_text_document")
        random_dataset(shards[-1], 40, i, kind="tokens", lengths=(5, 300), counted=True)
    merge_virtually([(f"s{i}", p) for i, p in enumerate(shards)], root / "merged" / "docs")
    merge_datasets(shards[:2], root / "merged" / "phys")
    random_dataset(root / "merged" / "code", 30, 7, kind="tokens", lengths=(5, 200), counted=True)
    build_blend(
        "mix",
        {
            "docs": root / "merged" / "docs",
            "phys": root / "merged" / "phys",
            "code": root / "merged" / "code",
        },
        root / "blends" / "mix",
        root / "nanoset",
        BlendSettings(
            NanosetSettings(
                sequence_length=64, split_spec="90,10,0", train_samples=200, semantics=semantics
            ),
            weights={"docs": 0.5, "phys": 0.2, "code": 0.3},
        ),
    )
    return root / "blends" / "mix" / "manifest.json"
