"""One retry layer for S3: botocore's standard mode retries each request; ``tokenmill.storage.s3``
only maps S3 failures to ``InputError`` naming the URI, repeats a body cut mid-read, and lets a
programming error through as itself. One client factory (``shared_client``): the endpoint and
timeouts it is given reach the clients of staging, ``gc``'s store, ``pull`` and the streaming
loader. Stubbed clients and a dead loopback port, no server."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from botocore.exceptions import ClientError, ResponseStreamingError
from botocore.retries.standard import ExponentialBackoff
from botocore.stub import Stubber

from tokenmill.errors import ConfigError, InputError
from tokenmill.loader._s3 import cache_for
from tokenmill.storage import s3
from tokenmill.storage.pull_plan import open_source
from tokenmill.storage.staging import S3Stage
from tokenmill.storage.store import S3Store, open_store

BUCKET = "bkt"
ENDPOINT = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials and a region, so requests are signed and sent."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


class _Body:
    """A response body whose ``read`` returns ``data`` or raises ``error``."""

    def __init__(self, data: bytes, error: Exception | None = None) -> None:
        self.data, self.error, self.closed = data, error, False

    def read(self, *_: Any) -> bytes:
        if self.error is not None:
            raise self.error
        return self.data

    def close(self) -> None:
        self.closed = True


def _client() -> Any:
    """A real S3 client that never reaches the network (answers come from a Stubber)."""
    return s3.make_client("http://127.0.0.1:9")


def _cut() -> ResponseStreamingError:
    return ResponseStreamingError(error="Connection broken: IncompleteRead(10 bytes read)")


def test_clients_use_botocores_standard_retries() -> None:
    client = s3.make_client("http://127.0.0.1:9", max_pool_connections=5)
    retries = {"mode": "standard", "total_max_attempts": 1 + s3.MAX_ATTEMPTS}
    assert client.meta.config.retries == retries
    assert client.meta.config.max_pool_connections == 5


def test_a_dead_endpoint_is_tried_by_botocore_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every retry is botocore's (1 + MAX_ATTEMPTS sends); the wrapper adds none and names
    the URI."""
    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        client = s3.make_client(f"http://127.0.0.1:{port}")  # bound, never listening
        sends: list[str] = []
        client.meta.events.register("before-send.s3.GetObject", lambda **kw: sends.append("x"))
        with pytest.raises(InputError) as info, s3.s3_errors(f"reading s3://{BUCKET}/a.json"):
            client.get_object(Bucket=BUCKET, Key="a.json")
    assert str(info.value).startswith(
        f"reading s3://{BUCKET}/a.json: EndpointConnectionError: Could not connect"
    )
    assert len(sends) == 1 + s3.MAX_ATTEMPTS


def test_s3_answers_become_input_errors_naming_the_uri() -> None:
    client = _client()
    with Stubber(client) as stub:
        stub.add_client_error("list_objects_v2", "AccessDenied", "Access Denied", 403)
        with pytest.raises(InputError) as info, s3.s3_errors(f"listing s3://{BUCKET}/p"):
            client.list_objects_v2(Bucket=BUCKET)
    assert str(info.value) == (
        f"listing s3://{BUCKET}/p: AccessDenied: An error occurred (AccessDenied) when calling "
        "the ListObjectsV2 operation: Access Denied"
    )
    assert isinstance(info.value.__cause__, ClientError)


@pytest.mark.parametrize("error", [TypeError("bad argument"), KeyError("Contents")])
def test_programming_errors_are_not_input_errors(error: Exception) -> None:
    calls: list[int] = []

    def broken() -> None:
        calls.append(1)
        raise error

    with pytest.raises(type(error)) as info, s3.s3_errors(f"listing s3://{BUCKET}/p"):
        broken()
    assert info.value is error and calls == [1]


def test_read_object_missing_is_none() -> None:
    client = _client()
    with Stubber(client) as stub:
        stub.add_client_error("get_object", "NoSuchKey", "gone", 404)
        assert s3.read_object(client, BUCKET, "absent.json") is None
        stub.assert_no_pending_responses()


def test_exists_is_false_only_for_a_missing_object() -> None:
    """HEAD answers: 200 is there, 404 is absent, and a 403 (or any other failure) is an
    InputError naming the object, never read as "missing" (materialize would rebuild)."""
    client = _client()
    with Stubber(client) as stub:
        stub.add_response("head_object", {}, {"Bucket": BUCKET, "Key": "a.json"})
        stub.add_client_error("head_object", "404", "Not Found", 404)
        stub.add_client_error("head_object", "403", "Forbidden", 403)
        assert s3.exists(client, BUCKET, "a.json")
        assert not s3.exists(client, BUCKET, "b.json")
        with pytest.raises(InputError) as info:
            s3.exists(client, BUCKET, "c.json")
    assert str(info.value) == (
        f"looking up s3://{BUCKET}/c.json: ClientError: An error occurred (403) when calling "
        "the HeadObject operation: Forbidden"
    )


def test_read_object_fetches_a_cut_body_again() -> None:
    client = _client()
    bodies = [_Body(b"", _cut()), _Body(b"{}")]
    with Stubber(client) as stub:
        for body in bodies:
            stub.add_response("get_object", {"Body": body}, {"Bucket": BUCKET, "Key": "m.json"})
        assert s3.read_object(client, BUCKET, "m.json") == b"{}"
        stub.assert_no_pending_responses()
    assert all(body.closed for body in bodies)


def test_read_object_reads_a_span_by_a_range_get_cut_or_not_and_names_what_failed() -> None:
    client = _client()
    expected = {"Bucket": BUCKET, "Key": "t.bin", "Range": "bytes=8-15"}
    with Stubber(client) as stub:
        for body in (_Body(b"", _cut()), _Body(b"01234567")):
            stub.add_response("get_object", {"Body": body}, expected)
        assert s3.read_object(client, BUCKET, "t.bin", (8, 16)) == b"01234567"
        for _ in range(s3.BODY_ATTEMPTS):
            stub.add_response("get_object", {"Body": _Body(b"", _cut())}, expected)
        with pytest.raises(InputError, match=r"^reading block 1 of t\.bin: Response"):
            s3.read_object(client, BUCKET, "t.bin", (8, 16), "reading block 1 of t.bin")
        stub.assert_no_pending_responses()


def test_read_object_gives_up_after_body_attempts() -> None:
    client = _client()
    with Stubber(client) as stub:
        for _ in range(s3.BODY_ATTEMPTS):
            stub.add_response("get_object", {"Body": _Body(b"", _cut())})
        with pytest.raises(InputError, match=rf"^reading s3://{BUCKET}/m\.json: Response"):
            s3.read_object(client, BUCKET, "m.json")
        stub.assert_no_pending_responses()


def test_read_object_does_not_repeat_a_programming_error() -> None:
    client = _client()
    with Stubber(client) as stub:
        stub.add_response("get_object", {"Body": _Body(b"", TypeError("read() takes 1 arg"))})
        stub.add_response("get_object", {"Body": _Body(b"{}")})
        with pytest.raises(TypeError, match="takes 1 arg"):
            s3.read_object(client, BUCKET, "m.json")
        # The second answer was never asked for: it is still there for the next read.
        assert s3.read_object(client, BUCKET, "m.json") == b"{}"


def test_timeouts_are_shorter_by_default_and_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.errors import ConfigError

    client = s3.make_client("http://127.0.0.1:9")
    assert (client.meta.config.connect_timeout, client.meta.config.read_timeout) == (10.0, 30.0)
    monkeypatch.setenv("TOKENMILL_S3_CONNECT_TIMEOUT", "2.5")
    monkeypatch.setenv("TOKENMILL_S3_READ_TIMEOUT", "7")
    client = s3.make_client("http://127.0.0.1:9")
    assert (client.meta.config.connect_timeout, client.meta.config.read_timeout) == (2.5, 7.0)
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv("TOKENMILL_S3_READ_TIMEOUT", bad)
        with pytest.raises(ConfigError, match=f"TOKENMILL_S3_READ_TIMEOUT={bad!r}: expected a"):
            s3.make_client("http://127.0.0.1:9")


def test_an_endpoint_that_never_answers_fails_soon_and_says_it_waits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loopback server accepts every connection and never answers: ``tokenmill pull`` says it
    is waiting for the endpoint, and fails after botocore's tries with the read timeout set in
    the environment (never botocore's 60 s per try)."""
    import threading

    from tokenmill.cli import main

    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0.0)
    monkeypatch.setattr(s3, "WAITING_EVERY", 0.0, raising=False)  # every waiting line shows
    monkeypatch.setenv("TOKENMILL_S3_CONNECT_TIMEOUT", "1")
    monkeypatch.setenv("TOKENMILL_S3_READ_TIMEOUT", "0.2")
    held: list[socket.socket] = []
    stop = threading.Event()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(32)
        server.settimeout(0.05)
        url = f"http://127.0.0.1:{server.getsockname()[1]}"

        def accept() -> None:
            while not stop.is_set():
                try:
                    held.append(server.accept()[0])  # read nothing, answer nothing
                except TimeoutError:
                    continue

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        result: list[int] = []
        argv = ["pull", f"s3://{BUCKET}/blends/mix/manifest.json", str(tmp_path / "dest")]
        puller = threading.Thread(
            target=lambda: result.append(main([*argv, "--endpoint-url", url])), daemon=True
        )
        puller.start()
        puller.join(120)  # a hang guard only: with 0.2 s per try this ends within seconds
        stop.set()
        acceptor.join()
        for conn in held:
            conn.close()
    assert result == [1], "tokenmill pull still waiting on a silent endpoint"
    err = capsys.readouterr().err
    assert f"tokenmill: waiting for S3 ({url}): " in err
    assert "ReadTimeoutError" in err and f"s3://{BUCKET}/blends/mix/manifest.json" in err
    assert len(held) == 1 + s3.MAX_ATTEMPTS  # every try reached the endpoint, none answered


def test_requests_share_one_watchdog_that_reports_only_late_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request only records its deadline with the process's one watchdog thread (no thread
    per request): one answered in time says nothing, one past its deadline says it waits, even
    while the watchdog sleeps until a later deadline of another thread's request."""
    waiting = s3._Waiting(_client(), read_timeout=60.0)
    get = SimpleNamespace(method="GET")
    waiting.sent(request=get)  # the watchdog starts here, if no request started it before
    waiting.answered()
    started: list[threading.Thread] = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda t: (started.append(t), start(t))[1])

    said: list[str] = []
    late = threading.Event()
    monkeypatch.setattr(waiting, "say", lambda what: (said.append(what), late.set()))
    for _ in range(20):
        waiting.sent(request=get)
        waiting.answered()
    slow = s3._Waiting(_client(), read_timeout=60.0)
    slow.slow_after = 3600.0
    armed, done = threading.Event(), threading.Event()

    def pending() -> None:  # another thread's request, due in an hour, answered at the end
        slow.sent(request=get)
        armed.set()
        done.wait(60)
        slow.answered()

    other = threading.Thread(target=pending, daemon=True)
    other.start()
    armed.wait(30)
    waiting.slow_after = 0.0
    waiting.sent(request=get)  # due now: wakes the watchdog sleeping until the hour is up
    try:
        assert late.wait(30)  # a hang guard: the watchdog reports a due request at once
    finally:
        done.set()
        other.join()
    assert started == [other]  # that thread only: none per request
    assert said == ["no answer to a GET after 0 s …"]


def _fork_while_held(lock: Any, child: Callable[[], bool]) -> int:
    """Fork while another thread holds ``lock`` (as a thread of a DataLoader's parent may);
    the exit code of the child, which runs ``child`` on a thread of its own (0 when it returns
    True within 20 s, 3 when it hangs or fails)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(30)
    pid = os.fork()
    if pid == 0:
        ok = threading.Event()
        threading.Thread(target=lambda: child() and ok.set(), daemon=True).start()
        os._exit(0 if ok.wait(20) else 3)
    release.set()
    holder.join()
    for _ in range(300):  # a hang guard: a deadlocked child is killed, the test fails
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on a lock its parent held at fork time")


def test_a_forked_child_gets_a_working_watchdog_whatever_its_parent_held() -> None:
    """A process forked (a DataLoader worker) while another thread of its parent held the
    "waiting" lock (the watchdog printing a line) starts its own watchdog, which reports a
    late request of the child: no deadlock on the lock held at fork time."""
    waiting = s3._Waiting(_client(), read_timeout=60.0)
    get = SimpleNamespace(method="GET")
    waiting.sent(request=get)  # the parent's watchdog is running
    waiting.answered()

    def late_request_reported() -> bool:  # real say: its lock too
        late, say = threading.Event(), waiting.say
        waiting.say = lambda what: (say(what), late.set())  # type: ignore[method-assign]
        waiting.slow_after = 0.0
        waiting.sent(request=get)
        return late.wait(20)

    assert _fork_while_held(s3._Waiting._lock, late_request_reported) == 0


def test_a_forked_child_builds_its_client_whatever_its_parent_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process forked while another thread of its parent was building a shared client (a
    background fetch's first GET; 0.1-0.5 s under the clients' lock) builds its own."""
    monkeypatch.setattr(s3, "_CLIENTS", {})
    assert _fork_while_held(s3._CLIENTS_LOCK, lambda: s3.shared_client(ENDPOINT) is not None) == 0


def test_a_forked_child_uses_the_block_cache_whatever_its_parent_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DataLoader worker forked while a fetch thread of its parent held the block cache's
    lock (making the client, or evicting blocks) gets its client; it waits on none of the
    parent's background jobs."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", ENDPOINT)
    cache = cache_for(tmp_path / "cache", None)
    stop = threading.Event()
    cache.later(lambda: stop.wait(60))  # a parent's job its child never runs

    def child() -> bool:
        cache.drain()
        return cache.client() is not None

    try:
        assert _fork_while_held(cache._lock, child) == 0
    finally:
        stop.set()


@pytest.fixture
def _timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """tokenmill's timeouts set, and no shared client of an earlier test."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv(s3.CONNECT_TIMEOUT_ENV, "3")
    monkeypatch.setenv(s3.READ_TIMEOUT_ENV, "7")
    monkeypatch.setattr(s3, "_CLIENTS", {})


def _settings(client: Any) -> tuple[str, float, float, dict[str, Any]]:
    config = client.meta.config
    return client.meta.endpoint_url, config.connect_timeout, config.read_timeout, config.retries


@pytest.mark.usefixtures("_timeouts")
def test_staging_gc_pull_and_the_loader_get_the_factorys_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = (ENDPOINT, 3.0, 7.0, {"mode": "standard", "total_max_attempts": s3.MAX_ATTEMPTS + 1})
    stage = S3Stage.open("s3://bkt/root", ENDPOINT, tmp_path / "stage")
    store = open_store("s3://bkt/root", ENDPOINT)
    assert isinstance(store, S3Store)
    source, key = open_source("s3://bkt/blends/mix/manifest.json", ENDPOINT, 4)
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


@pytest.mark.usefixtures("_timeouts")
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
