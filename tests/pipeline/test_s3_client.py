"""The pipeline's S3 client is the library's (``tokenmill.storage.s3.shared_client``): the
``StorageResource`` hands its endpoint to the factory, and the client its workspaces stage
through and its listings use has the same retries, ``TOKENMILL_S3_*`` timeouts and "waiting for
S3" line as ``pull``. No server: a workspace without inputs asks S3 nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from assets.support.resources import StorageResource
from tokenmill.errors import ConfigError
from tokenmill.storage import s3

ENDPOINT = "http://127.0.0.1:9"


def test_the_pipeline_client_takes_tokenmills_timeouts_and_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv(s3.CONNECT_TIMEOUT_ENV, "3")
    monkeypatch.setenv(s3.READ_TIMEOUT_ENV, "7")
    monkeypatch.setattr(s3, "_CLIENTS", {})
    storage = StorageResource(
        root="s3://bkt/root", s3_endpoint_url=ENDPOINT, work_dir=str(tmp_path), run_cache_hours=0
    )
    with storage.workspace(upload=False) as ws:
        assert ws.stage is not None
        client = ws.stage.client
    config = client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (3.0, 7.0)
    assert config.retries == {"mode": "standard", "total_max_attempts": s3.MAX_ATTEMPTS + 1}
    assert client.meta.endpoint_url == ENDPOINT
    assert storage._store().client is client  # type: ignore[union-attr]  # one per process
    monkeypatch.setenv(s3.READ_TIMEOUT_ENV, "11")  # changed settings: a new client
    with storage.workspace(upload=False) as ws:
        assert ws.stage is not None
        assert ws.stage.client.meta.config.read_timeout == 11.0
    monkeypatch.setenv(s3.READ_TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigError, match=f"{s3.READ_TIMEOUT_ENV}='soon'"):
        storage._store()
