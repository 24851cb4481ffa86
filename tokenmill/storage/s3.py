"""S3 helpers shared by ``tokenmill pull``, ``tokenmill gc`` and the pipeline: URI parsing, the one
retry policy, and the one wrapper that turns S3 failures into ``InputError`` naming the URI.

Retries happen in one place: botocore's ``standard`` retry mode (``MAX_ATTEMPTS`` retries per
request, exponential backoff with jitter, a per-client retry quota); s3transfer adds its own for a
download stream cut mid-file. The only other retry is for a response body cut while it is read
(``read_object``, ``tokenmill.storage.pull``): botocore has already handed that response over and
cannot repeat it. boto3 is imported lazily (pipeline extra).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from tokenmill.errors import ConfigError, InputError

T = TypeVar("T")
RETRY_MODE = "standard"
MAX_ATTEMPTS = 8  # botocore retries per request, after the first try: 9 tries in all
BODY_ATTEMPTS = 3  # tries to read a response body that a dropped connection cut short
MISSING_CODES = ("NoSuchKey", "404", "NotFound")


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` → ``("bucket", "some/prefix")``; ConfigError without bucket."""
    if not uri.startswith("s3://"):
        raise ConfigError(f"{uri}: not an s3:// URI")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ConfigError(f"{uri}: no bucket name")
    return bucket, prefix.strip("/")


def retry_config() -> dict[str, Any]:
    """botocore's ``retries`` setting every tokenmill S3 client uses."""
    return {"mode": RETRY_MODE, "max_attempts": MAX_ATTEMPTS}


def make_client(endpoint_url: str | None, **config: Any) -> Any:
    """A boto3 S3 client with the retry policy (credentials and region from the environment);
    ``config`` adds botocore ``Config`` options such as ``max_pool_connections``."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
        config=Config(retries=retry_config(), **config),
    )


def is_s3_error(exc: BaseException) -> bool:
    """An error of S3 or of the way to it (an answer, a connection, credentials, a transfer),
    as opposed to a programming error, which must surface as itself."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError
    from s3transfer.exceptions import RetriesExceededError, S3DownloadFailedError

    s3_side = (BotoCoreError, ClientError, Boto3Error, RetriesExceededError, S3DownloadFailedError)
    return isinstance(exc, (*s3_side, ConnectionError, TimeoutError))


def is_missing(exc: BaseException) -> bool:
    """True for S3's "no such object" answer."""
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in (
        MISSING_CODES
    )


def is_cut_body(exc: BaseException) -> bool:
    """True when a response body stopped mid-read (a dropped or stalled connection)."""
    from botocore.exceptions import (
        ConnectionClosedError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from urllib3.exceptions import ProtocolError

    cut = (ConnectionClosedError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError)
    return isinstance(exc, (*cut, ProtocolError, ConnectionError))


@contextlib.contextmanager
def s3_errors(what: str) -> Iterator[None]:
    """Re-raise an S3 failure inside the block as ``InputError("<what>: <type>: <message>")``;
    anything else (a TypeError, a KeyError) passes through unchanged."""
    try:
        yield
    except Exception as exc:
        if not is_s3_error(exc):
            raise
        raise InputError(f"{what}: {type(exc).__name__}: {exc}") from exc


def call(what: str, op: Callable[[], T]) -> T:
    """``op()`` with S3 failures raised as InputError naming ``what`` (botocore has retried)."""
    with s3_errors(what):
        return op()


def read_object(client: Any, bucket: str, key: str) -> bytes | None:
    """The bytes of ``s3://bucket/key``, None when it does not exist; a body cut mid-read is
    fetched again (up to ``BODY_ATTEMPTS`` tries), other failures raise InputError."""
    attempt = 1
    with s3_errors(f"reading s3://{bucket}/{key}"):
        while True:
            try:
                body = client.get_object(Bucket=bucket, Key=key)["Body"]
            except Exception as exc:
                if is_missing(exc):
                    return None
                raise
            try:
                return bytes(body.read())
            except Exception as exc:
                if attempt == BODY_ATTEMPTS or not is_cut_body(exc):
                    raise
            finally:
                body.close()
            attempt += 1
