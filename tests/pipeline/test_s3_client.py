"""The pipeline's S3 client is the library's (``tokenmill.storage.s3.make_client``): the same
retries, the same ``TOKENMILL_S3_*`` timeouts and the same "waiting for S3" line as ``pull``."""

from __future__ import annotations

import pytest

from assets.support import s3 as pipeline_s3
from tokenmill.errors import ConfigError
from tokenmill.storage.s3 import CONNECT_TIMEOUT_ENV, MAX_ATTEMPTS, READ_TIMEOUT_ENV


def test_the_pipeline_client_takes_tokenmills_timeouts_and_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv(CONNECT_TIMEOUT_ENV, "3")
    monkeypatch.setenv(READ_TIMEOUT_ENV, "7")
    client = pipeline_s3.s3_client("http://127.0.0.1:9")
    config = client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (3.0, 7.0)
    assert config.retries == {"mode": "standard", "total_max_attempts": MAX_ATTEMPTS + 1}
    assert client.meta.endpoint_url == "http://127.0.0.1:9"
    assert pipeline_s3.s3_client("http://127.0.0.1:9") is client  # one per process and settings
    monkeypatch.setenv(READ_TIMEOUT_ENV, "11")  # changed settings: a new client
    assert pipeline_s3.s3_client("http://127.0.0.1:9").meta.config.read_timeout == 11.0
    monkeypatch.setenv(READ_TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigError, match=f"{READ_TIMEOUT_ENV}='soon'"):
        pipeline_s3.s3_client("http://127.0.0.1:9")
