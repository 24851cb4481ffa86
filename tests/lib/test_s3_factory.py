"""One S3 client factory (``tokenmill.storage.s3.shared_client``): the endpoint and the
``TOKENMILL_S3_*`` timeouts it is given reach the clients of staging, ``gc``'s store, ``pull``
and the streaming loader, one client per process and settings. No server: clients are built,
never asked anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenmill.errors import ConfigError
from tokenmill.loader._s3 import cache_for
from tokenmill.storage import s3
from tokenmill.storage.pull import _open_source
from tokenmill.storage.staging import S3Stage
from tokenmill.storage.store import S3Store, open_store

ENDPOINT = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials, a region, tokenmill's timeouts, and no client of an earlier test."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv(s3.CONNECT_TIMEOUT_ENV, "3")
    monkeypatch.setenv(s3.READ_TIMEOUT_ENV, "7")
    monkeypatch.setattr(s3, "_CLIENTS", {})


def _settings(client: Any) -> tuple[str, float, float, dict[str, Any]]:
    config = client.meta.config
    return client.meta.endpoint_url, config.connect_timeout, config.read_timeout, config.retries


def test_staging_gc_pull_and_the_loader_get_the_factorys_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = (ENDPOINT, 3.0, 7.0, {"mode": "standard", "total_max_attempts": s3.MAX_ATTEMPTS + 1})
    stage = S3Stage.open("s3://bkt/root", ENDPOINT, tmp_path / "stage")
    store = open_store("s3://bkt/root", ENDPOINT)
    assert isinstance(store, S3Store)
    source, key = _open_source("s3://bkt/blends/mix/manifest.json", ENDPOINT, 4)
    assert key == "blends/mix/manifest.json"
    assert _settings(stage.client) == _settings(store.client) == expected
    assert _settings(source.client) == expected  # type: ignore[union-attr]
    assert source.client.meta.config.max_pool_connections == 4 + 2  # type: ignore[union-attr]
    assert stage.client is store.client  # one client per process and settings
    assert s3.shared_client(ENDPOINT) is stage.client

    # The loader names no endpoint: the standard AWS environment gives it.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:10")
    loader = cache_for(tmp_path / "cache", None).client()
    assert _settings(loader) == ("http://127.0.0.1:10", *expected[1:])
    assert loader is s3.shared_client(
        None, max_pool_connections=loader.meta.config.max_pool_connections
    )


def test_a_changed_setting_makes_a_new_client_and_a_bad_one_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = s3.shared_client(ENDPOINT)
    assert s3.shared_client(ENDPOINT) is first
    assert s3.shared_client("http://127.0.0.1:11") is not first  # another endpoint
    monkeypatch.setenv(s3.READ_TIMEOUT_ENV, "11")
    changed = s3.shared_client(ENDPOINT)
    assert changed is not first and changed.meta.config.read_timeout == 11.0
    monkeypatch.setenv(s3.READ_TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigError, match=f"{s3.READ_TIMEOUT_ENV}='soon': expected a positive"):
        s3.shared_client(ENDPOINT)
