"""The pipeline's S3 wiring hands its settings to the library's one client factory: the
``StorageResource``'s endpoint reaches the client its workspaces stage through and the one its
listings and deletions use. No server: a workspace without inputs asks S3 nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from assets.support.resources import StorageResource
from tokenmill.storage import s3


def test_the_storage_resource_uses_the_librarys_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv(s3.CONNECT_TIMEOUT_ENV, "3")
    monkeypatch.setenv(s3.READ_TIMEOUT_ENV, "7")
    monkeypatch.setattr(s3, "_CLIENTS", {})
    endpoint = "http://127.0.0.1:9"
    storage = StorageResource(
        root="s3://bkt/root", s3_endpoint_url=endpoint, work_dir=str(tmp_path), run_cache_hours=0
    )
    with storage.workspace(upload=False) as ws:
        assert ws.stage is not None
        client = ws.stage.client
    config = client.meta.config
    assert (client.meta.endpoint_url, config.connect_timeout, config.read_timeout) == (
        endpoint,
        3.0,
        7.0,
    )
    assert client is s3.shared_client(endpoint) is storage._store().client  # type: ignore[union-attr]
