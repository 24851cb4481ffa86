"""No S3 credentials in anything a run leaves behind (issue 6 §4). With a distinctive secret key
and access key id in the environment, pipeline runs on an S3 root (moto_server) are searched
byte for byte: the instance's whole storage (SQLite files, or every Postgres table), compute
logs, every event's text and metadata, run configs and tags, the objects written to S3, and the
process's captured stdout/stderr. Failing runs too, including a 403 whose XML body echoes the
access key id as AWS's SignatureDoesNotMatch does."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import psycopg2
import pytest
import yaml
from botocore.exceptions import ClientError
from dagster import DagsterInstance
from prod_servers import S3, Postgres
from s3faults import FaultProxy, materialize_shard, s3_tree, step_errors

from tokenmill.cli import main
from tokenmill.recipe import Recipe
from tokenmill.storage.s3 import shared_client

SECRET = "tmFaultSecret9d2e71b0c4ZqXv"
KEY_ID = "AKIATMFAULT7Q3X9Z2W4"
INFRA = Path(__file__).resolve().parents[2] / "infra"


@pytest.fixture
def creds(s3: S3, monkeypatch: pytest.MonkeyPatch) -> S3:
    """The moto bucket, with the distinctive key pair in the environment (moto takes any)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    return s3


def leaked(where: str, data: str | bytes) -> list[str]:
    """``where: what`` for each credential found in ``data``."""
    raw = data.encode() if isinstance(data, str) else data
    return [f"{where}: {name}" for name in (SECRET, KEY_ID) if name.encode() in raw]


def scan_files(root: Path) -> list[str]:
    """Credentials found in any file under ``root`` (databases, compute logs, anything)."""
    return [
        hit
        for p in sorted(root.rglob("*"))
        if p.is_file()
        for hit in leaked(str(p), p.read_bytes())
    ]


def scan_instance(instance: DagsterInstance) -> tuple[str, list[str]]:
    """Every run (config, tags) and every event (messages, metadata, errors) as one text, and
    the credentials found in it."""
    text = "\n".join(
        f"{run!r}\n" + "\n".join(repr(record) for record in instance.all_logs(run.run_id))
        for run in instance.get_runs()
    )
    return text, leaked("event log", text)


def s3_recipe(make_recipe: Callable[..., Recipe], s3: S3, endpoint: str) -> Recipe:
    """The tiny recipe with its storage root at ``s3://<bucket>/root`` behind ``endpoint``."""
    return make_recipe(storage={"root": f"s3://{s3.bucket}/root", "s3_endpoint_url": endpoint})


def test_successful_s3_run_leaves_no_credentials_anywhere(
    creds: S3,
    make_recipe: Callable[..., Recipe],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    home = tmp_path / "dagster_home"  # SQLite storage and compute logs under home/storage
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    recipe = s3_recipe(make_recipe, creds, creds.endpoint)
    with DagsterInstance.from_config(str(home)) as instance:
        result = materialize_shard(recipe, instance, endpoint=creds.endpoint, work=tmp_path / "w")
        assert result.success, step_errors(result)
        logged, found = scan_instance(instance)
    captured = capfd.readouterr()
    assert f"s3://{creds.bucket}/root/tokens/docs/part-00000_text_document" in logged  # metadata
    assert list((home / "storage").rglob("*.err")), "no compute logs were captured"
    found += scan_files(home)
    found += leaked("stdout", captured.out) + leaked("stderr", captured.err)
    found += [hit for key, data in s3_tree(creds, "root/").items() for hit in leaked(key, data)]
    assert found == []


@pytest.fixture
def pg_home(
    postgres: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, str]:
    """A DAGSTER_HOME with ``infra/dagster.yaml``'s storage section on a fresh database of the
    session's Postgres cluster (compute logs stay local, under home/storage); and the database."""
    db = f"tm_secrets_{secrets.token_hex(4)}"
    conn = psycopg2.connect(
        host=postgres.host, port=postgres.port, user=postgres.user, dbname="postgres"
    )
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {db}")
    conn.close()
    for name, value in {**postgres.env(), "DAGSTER_PG_DB": db}.items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "dagster_home"
    home.mkdir()
    storage = yaml.safe_load((INFRA / "dagster.yaml").read_text())["storage"]
    (home / "dagster.yaml").write_text(yaml.safe_dump({"storage": storage}))
    return home, db


def scan_database(postgres: Postgres, db: str) -> list[str]:
    """Credentials found in any row of any table of ``db``."""
    found = []
    with (
        psycopg2.connect(
            host=postgres.host, port=postgres.port, user=postgres.user, dbname=db
        ) as conn,
        conn.cursor() as cur,
    ):
        cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        tables = [row[0] for row in cur.fetchall()]
        assert "event_logs" in tables and "runs" in tables
        for table in tables:
            cur.execute(f'SELECT t::text FROM "{table}" t')
            found += leaked(f"table {table}", "\n".join(row[0] for row in cur.fetchall()))
    return found


@pytest.mark.usefixtures("fast_retries")
def test_failing_s3_runs_and_pull_leak_no_credentials(
    creds: S3,
    postgres: Postgres,
    pg_home: tuple[Path, str],
    proxy: FaultProxy,
    make_recipe: Callable[..., Recipe],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    denied = proxy.add("PUT", r"/root/raw/", "deny")
    with pytest.raises(ClientError) as answer:  # the server really echoes the key id
        shared_client(proxy.endpoint).put_object(Bucket=creds.bucket, Key="root/raw/x", Body=b"")
    assert answer.value.response["Error"]["AWSAccessKeyId"] == KEY_ID

    home, db = pg_home
    recipe = s3_recipe(make_recipe, creds, proxy.endpoint)
    errors = []
    with DagsterInstance.from_config(str(home)) as instance:
        for fault in ("deny", "503"):
            proxy.clear()
            proxy.add("PUT", r"/root/raw/", fault)
            result = materialize_shard(
                recipe,
                instance,
                endpoint=proxy.endpoint,
                work=tmp_path / "w",
                stages=("raw_jsonl",),
            )
            assert not result.success
            errors += step_errors(result)
        _, found = scan_instance(instance)
    assert denied.matched == 1
    assert (
        "An error occurred (SignatureDoesNotMatch) when calling the PutObject operation"
        in errors[0]
    )
    assert (
        "An error occurred (ServiceUnavailable) when calling the PutObject operation" in errors[1]
    )

    proxy.clear()
    proxy.add("GET", r"/manifest\.json$", "deny")
    uri = f"s3://{creds.bucket}/root/blends/mix/manifest.json"
    assert main(["pull", uri, str(tmp_path / "dest"), "--endpoint-url", proxy.endpoint]) == 1
    captured = capfd.readouterr()
    assert (
        f"tokenmill pull: error: reading {uri}: ClientError: An error occurred (SignatureDoes"
        in (captured.err)
    )
    found += leaked("step errors", "\n".join(errors))
    found += scan_database(postgres, db)
    found += scan_files(home)
    found += leaked("stdout", captured.out) + leaked("stderr", captured.err)
    assert found == []
