"""S3 helpers shared by ``tokenmill pull`` and the pipeline: URI parsing, which errors are worth
another try, and retries with exponential backoff. boto3 is imported lazily (pipeline extra)."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from typing import TypeVar

from tokenmill.errors import ConfigError, InputError

T = TypeVar("T")
ATTEMPTS = 4  # per operation, for transient errors (botocore retries each request below this)
BACKOFF_SECONDS = 0.5
# Errors of the local machine (a full or failing disk): another try cannot help.
LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES})


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` → ``("bucket", "some/prefix")``; ConfigError without bucket."""
    if not uri.startswith("s3://"):
        raise ConfigError(f"{uri}: not an s3:// URI")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ConfigError(f"{uri}: no bucket name")
    return bucket, prefix.strip("/")


def is_transient(exc: BaseException) -> bool:
    """Worth another try: a 5xx or throttling answer, or a connection problem, also when
    wrapped (boto3's transfer errors wrap the ClientError that caused them)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ClientError):
            status = seen.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return int(status) >= 500 or "Throttl" in str(seen.response.get("Error", {}))
        if isinstance(seen, NoCredentialsError):
            return False
        if isinstance(seen, BotoCoreError):
            return True
        if isinstance(seen, OSError):  # a named file or a disk errno is local, not the network
            return seen.filename is None and seen.errno not in LOCAL_ERRNOS
        seen = seen.__cause__ or seen.__context__
    return False


def retrying(what: str, op: Callable[[], T]) -> T:
    """``op()`` with transient errors retried (exponential backoff); InputError naming ``what``."""
    attempt = 1
    while True:
        try:
            return op()
        except Exception as exc:
            if attempt >= ATTEMPTS or not is_transient(exc):
                raise InputError(f"{what}: {type(exc).__name__}: {exc}") from exc
        time.sleep(BACKOFF_SECONDS * 2 ** (attempt - 1))
        attempt += 1
