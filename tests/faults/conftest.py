"""Fixtures of the S3 fault tests: the faulty proxy in front of moto_server and fast retries.
``s3faults`` (which imports Dagster) is imported only by a test that asks for the proxy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from s3faults import FaultProxy


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the session's moto_server, killed at the end."""
    from s3faults import FaultProxy

    faulty = FaultProxy(moto_endpoint)
    try:
        yield faulty
    finally:
        faulty.clear()
        faulty.kill()


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's per-request backoff (the only retry delay, otherwise up to seconds) shrunk to
    a millisecond; the attempt counts stay as configured."""
    from botocore.retries.standard import ExponentialBackoff

    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0.001)
