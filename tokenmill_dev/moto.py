"""A moto_server child on a free loopback port, for the tests and the benchmarks (one launcher:
``tests/servers.py`` and ``bench/_pipeline_s3.py`` both use it)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

START_SECONDS = 60


def free_port() -> int:
    """A TCP port nobody listens on right now (bound to 127.0.0.1, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def moto_server(log: Path, start_seconds: float = START_SECONDS) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a moto_server child (its request log in ``log``), stopped by
    its PID on exit; RuntimeError with the log when it exits or does not answer in time."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_seconds
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}: {log.read_text()}")
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server not up after {start_seconds}s") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
