"""Which S3 errors ``tokenmill.storage.s3.retrying`` tries again: the network's, never the local
disk's."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from tokenmill.errors import InputError
from tokenmill.storage import s3


def client_error(status: int, code: str) -> ClientError:
    """A botocore ClientError as a server answering ``status`` produces it."""
    response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "GetObject")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (client_error(503, "SlowDown"), True),
        (client_error(500, "InternalError"), True),
        (client_error(400, "ThrottlingException"), True),
        (client_error(404, "NoSuchKey"), False),
        (client_error(403, "AccessDenied"), False),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), True),
        (ConnectionResetError(errno.ECONNRESET, "reset by peer"), True),
        (NoCredentialsError(), False),
        (OSError(errno.ENOSPC, "No space left on device"), False),
        (OSError(errno.EIO, "Input/output error"), False),
        (OSError(errno.ENOENT, "No such file", "/data/x.bin"), False),
        (ValueError("not an I/O problem"), False),
    ],
)
def test_is_transient(exc: BaseException, transient: bool) -> None:
    assert s3.is_transient(exc) is transient


def test_wrapped_cause_decides() -> None:
    try:
        try:
            raise client_error(503, "SlowDown")
        except ClientError as inner:
            raise RuntimeError("upload failed") from inner
    except RuntimeError as outer:
        assert s3.is_transient(outer)


def test_retrying_gives_up_at_once_on_a_full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(s3, "BACKOFF_SECONDS", 0.0)

    def full() -> None:
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(InputError, match=r"^downloading x: OSError: .*No space left on device"):
        s3.retrying("downloading x", full)
    assert len(calls) == 1


def test_retrying_retries_transient_errors_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(s3, "BACKOFF_SECONDS", 0.0)

    def flaky() -> str:
        calls.append(1)
        if len(calls) < s3.ATTEMPTS:
            raise client_error(503, "SlowDown")
        return "ok"

    assert s3.retrying("reading y", flaky) == "ok"
    assert len(calls) == s3.ATTEMPTS
