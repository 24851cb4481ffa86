"""The one S3 client factory and the helpers every S3 user shares (pipeline staging, ``tokenmill
pull``, ``gc``, the streaming loader): URI parsing, retries, timeouts, listing, transfers, and the
one wrapper that turns S3 failures into ``InputError`` naming the URI. boto3 is imported lazily.

Retries happen in botocore (``standard`` mode, ``MAX_ATTEMPTS`` per request) and s3transfer (a
download stream cut mid-file); the only other retry is for a response body cut while it is read
(``read_object``, ``tokenmill.storage.pull_blocks``), which botocore has already handed over.

Timeouts: ``TOKENMILL_S3_CONNECT_TIMEOUT`` (default 10 s) and ``TOKENMILL_S3_READ_TIMEOUT``
(default 30 s: botocore's 60 would leave an endpoint that never answers silent for 9 minutes per
request). A request unanswered after ``min(5, read timeout / 2)`` s, or retried, prints one
"waiting for S3 (<endpoint>)" line on stderr (at most one per 10 s per process).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.atomic import commit, create_temp
from tokenmill.errors import ConfigError, InputError

RETRY_MODE = "standard"
MAX_ATTEMPTS = 8  # botocore retries per request, after the first try: 9 tries in all
BODY_ATTEMPTS = 3  # tries to read a response body that a dropped connection cut short
MISSING_CODES = ("NoSuchKey", "404", "NotFound")
CONNECT_TIMEOUT_ENV = "TOKENMILL_S3_CONNECT_TIMEOUT"
READ_TIMEOUT_ENV = "TOKENMILL_S3_READ_TIMEOUT"
TIMEOUT_DEFAULTS = {CONNECT_TIMEOUT_ENV: 10.0, READ_TIMEOUT_ENV: 30.0}
MULTIPART_BYTES = 64 << 20  # larger files go up (and down) in parts of this size
SLOW_AFTER_MAX = 5.0  # seconds without an answer before the "waiting" line
WAITING_EVERY = 10.0  # seconds between two "waiting" lines of one process


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` → ``("bucket", "some/prefix")``; ConfigError without bucket."""
    if not uri.startswith("s3://"):
        raise ConfigError(f"{uri}: not an s3:// URI")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ConfigError(f"{uri}: no bucket name")
    return bucket, prefix.strip("/")


def timeouts() -> dict[str, float]:
    """botocore's ``connect_timeout`` and ``read_timeout`` from the environment (seconds);
    ConfigError naming the variable when one is not a positive number."""
    found = {}
    for name, default in TIMEOUT_DEFAULTS.items():
        text = os.environ.get(name, "").strip()
        try:
            value = float(text) if text else default
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise ConfigError(f"{name}={text!r}: expected a positive number of seconds")
        found[name] = value
    return {
        "connect_timeout": found[CONNECT_TIMEOUT_ENV],
        "read_timeout": found[READ_TIMEOUT_ENV],
    }


_LOADER: list[Any] = []  # botocore's data loader of this process (JSON models, read once)
_LOADER_LOCK = threading.Lock()


def make_client(endpoint_url: str | None, **config: Any) -> Any:
    """A boto3 S3 client with the retry policy and the timeouts (credentials and region from the
    environment), plus botocore ``config`` options; slow or retried requests say so on stderr."""
    import boto3
    import botocore.session
    from botocore.config import Config

    limits = timeouts()
    session = botocore.session.get_session()  # fresh: environment and credentials read now
    with _LOADER_LOCK:
        if _LOADER:  # the parsed service models, shared: a second client costs ~50 ms, not 150
            session.register_component("data_loader", _LOADER[0])
        else:
            _LOADER.append(session.get_component("data_loader"))
    client = boto3.session.Session(botocore_session=session).client(
        "s3",
        endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
        config=Config(
            retries={"mode": RETRY_MODE, "max_attempts": MAX_ATTEMPTS}, **{**limits, **config}
        ),
    )
    _Waiting(client, limits["read_timeout"]).register()
    return client


_CLIENTS: dict[str, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_client(endpoint_url: str | None = None, **config: Any) -> Any:
    """This process's (thread-safe) client per endpoint, ``config``, timeouts and ``AWS_*``
    environment (keyed by a hash: no credential is kept), built on first use: a build costs
    0.1-0.5 s of CPU. A forked process builds its own."""
    aws = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
    settings = (os.getpid(), endpoint_url, sorted(config.items()), sorted(timeouts().items()), aws)
    key = hashlib.sha256(repr(settings).encode()).hexdigest()
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = make_client(endpoint_url, **config)
        return _CLIENTS[key]


class _Waiting:
    """Prints "waiting for S3 (<endpoint>) ..." when a request of ``client`` has no answer after
    a few seconds, or failed and is retried: a stalled endpoint is never silent. A request only
    records its deadline; one watchdog thread per process (``_Watchdog``) reports those past
    it (a timer thread per request cost ~1 ms of CPU per GET)."""

    _last = 0.0  # when this process last printed (shared: many clients, one terminal)
    _lock = threading.Lock()

    def __init__(self, client: Any, read_timeout: float) -> None:
        self.endpoint = client.meta.endpoint_url
        self.client = client
        self.slow_after = min(SLOW_AFTER_MAX, read_timeout / 2)

    def register(self) -> None:
        events = self.client.meta.events
        events.register("before-send.s3", self.sent)
        events.register("needs-retry.s3", self.answered)

    def say(self, what: str) -> None:
        with _Waiting._lock:
            now = time.monotonic()
            if _Waiting._last and now - _Waiting._last < WAITING_EVERY:
                return
            _Waiting._last = now
        print(f"tokenmill: waiting for S3 ({self.endpoint}): {what}", file=sys.stderr, flush=True)

    def sent(self, request: Any = None, **_: Any) -> None:
        """A request goes out: the watchdog reports it if no answer comes in time."""
        method = getattr(request, "method", "request")
        what = f"no answer to a {method} after {self.slow_after:g} s …"
        _watchdog().arm(time.monotonic() + self.slow_after, self, what)

    def answered(
        self, response: Any = None, caught_exception: Any = None, attempts: int = 1, **_: Any
    ) -> None:
        """An attempt ended: disarm the watchdog; report a failure botocore may retry."""
        _watchdog().disarm()
        status = response[0].status_code if response else 0  # 0: no answer
        if caught_exception is not None or status >= 500 or status == 429:
            why = type(caught_exception).__name__ if caught_exception else f"HTTP {status}"
            then = "; retrying …" if attempts <= MAX_ATTEMPTS else ""
            self.say(f"try {attempts} of {MAX_ATTEMPTS + 1} failed ({why}){then}")


class _Watchdog:
    """The requests in flight of this process (one per sending thread: its deadline, who
    reports it and what), and the one daemon thread that reports each once its deadline
    passes; it sleeps while none is pending."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[float, _Waiting, str]] = {}
        self.wake = threading.Condition()
        self.next = float("inf")  # when the thread wakes next (inf: when woken)
        self.thread = threading.Thread(target=self.run, name="tokenmill-s3-waiting", daemon=True)
        self.thread.start()

    def arm(self, deadline: float, waiting: _Waiting, what: str) -> None:
        with self.wake:
            self.pending[threading.get_ident()] = (deadline, waiting, what)
            if deadline < self.next:  # else the thread wakes in time already
                self.next = deadline
                self.wake.notify()

    def disarm(self) -> None:
        with self.wake:
            self.pending.pop(threading.get_ident(), None)

    def run(self) -> None:
        while True:
            with self.wake:
                now = time.monotonic()
                due = [k for k, (t, _, _) in self.pending.items() if t <= now]
                late = [self.pending.pop(k) for k in due]
                if not late:
                    self.next = min((t for t, _, _ in self.pending.values()), default=float("inf"))
                    self.wake.wait(self.next - now if self.pending else None)
            for _, waiting, what in late:
                waiting.say(what)


_WATCHDOG: list[_Watchdog] = []  # this process's, once started (a forked child's starts empty)


def _watchdog() -> _Watchdog:
    """This process's watchdog, started on first use."""
    if not _WATCHDOG:
        with _Waiting._lock:
            if not _WATCHDOG:
                _WATCHDOG.append(_Watchdog())
    return _WATCHDOG[0]


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) starts without its parent's watchdog and with
    fresh locks (the "waiting" one, the clients'): another parent thread may have held one at
    the fork (building a client takes 0.1-0.5 s under it), and the child would wait forever."""
    global _CLIENTS_LOCK, _LOADER_LOCK
    _Waiting._lock = threading.Lock()
    _CLIENTS_LOCK, _LOADER_LOCK = threading.Lock(), threading.Lock()
    _WATCHDOG.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True)
class S3Object:
    """One listed object: key, size, ETag (quotes removed) and LastModified (epoch seconds)."""

    key: str
    size: int
    etag: str
    mtime: float = 0.0


def list_objects(client: Any, bucket: str, prefix: str, *, recursive: bool) -> list[S3Object]:
    """Objects under ``prefix`` sorted by key (names only); ``recursive=False``: direct children."""
    args = {"Bucket": bucket, "Prefix": prefix, **({} if recursive else {"Delimiter": "/"})}
    found = []
    with s3_errors(f"listing s3://{bucket}/{prefix}"):
        for page in client.get_paginator("list_objects_v2").paginate(**args):
            for obj in page.get("Contents", []):
                etag, modified = obj["ETag"].strip('"'), obj["LastModified"].timestamp()
                found.append(S3Object(obj["Key"], int(obj["Size"]), etag, modified))
    return sorted(found, key=lambda o: o.key)


def exists(client: Any, bucket: str, key: str) -> bool:
    """True when ``s3://bucket/key`` is an object now (one HEAD request)."""
    with s3_errors(f"looking up s3://{bucket}/{key}"):
        try:
            client.head_object(Bucket=bucket, Key=key)
        except Exception as exc:
            if is_missing(exc):
                return False
            raise
    return True


def _transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)


def download(client: Any, bucket: str, key: str, path: Path) -> None:
    """``s3://bucket/key`` → ``path`` through a temp (a failed transfer leaves nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, _ = create_temp(path, Path.touch)  # boto3 replaces the reserved name
    try:
        with s3_errors(f"downloading s3://{bucket}/{key}"):
            client.download_file(bucket, key, str(tmp), Config=_transfer_config())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    commit(tmp, path)


def upload(client: Any, path: Path, bucket: str, key: str) -> None:
    """``path`` → ``s3://bucket/key``, multipart above ``MULTIPART_BYTES``."""
    with s3_errors(f"uploading {path.name} to s3://{bucket}/{key}"):
        client.upload_file(str(path), bucket, key, Config=_transfer_config())


def delete(client: Any, bucket: str, key: str) -> None:
    """Remove ``s3://bucket/key`` (absent is fine)."""
    with s3_errors(f"deleting s3://{bucket}/{key}"):
        client.delete_object(Bucket=bucket, Key=key)


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

    code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
    return code in MISSING_CODES


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


def read_object(
    client: Any, bucket: str, key: str, span: tuple[int, int] | None = None, what: str = ""
) -> bytes | None:
    """The bytes of ``s3://bucket/key`` (``span``: ``[lo, hi)``, by a range GET), None when it
    does not exist; a body cut mid-read is fetched again (``BODY_ATTEMPTS`` tries in all), other
    failures raise InputError naming ``what`` (default: the object)."""
    attempt = 1
    extra = {"Range": f"bytes={span[0]}-{span[1] - 1}"} if span else {}
    with s3_errors(what or f"reading s3://{bucket}/{key}"):
        while True:
            try:
                body = client.get_object(Bucket=bucket, Key=key, **extra)["Body"]
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
