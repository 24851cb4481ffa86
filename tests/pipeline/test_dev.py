"""``make dev``'s supervisor (``pipelines.dev``): a stop signal ends the command and everything it
started, also when the caller inherited SIGINT ignored (a background job of a script)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for `dagster dev`: starts a grandchild, writes both pids, then waits. With
# `stubborn`, both ignore SIGTERM (only SIGKILL stops them).
FAKE_DEV = """
import os, signal, subprocess, sys, time
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         preexec_fn=(lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
                         if sys.argv[2] == "stubborn" else None)
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    return state != "Z"


def _start(tmp_path: Path, mode: str, grace: float) -> tuple[subprocess.Popen[bytes], list[int]]:
    pids = tmp_path / "pids"
    command = [sys.executable, "-m", "pipelines.dev", "--grace", str(grace)]
    command += [sys.executable, "-c", FAKE_DEV, str(pids), mode]
    # As a script's background job: SIGINT (and SIGQUIT) ignored, inherited by what it starts.
    sup = subprocess.Popen(
        command,
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not (pids.is_file() and pids.read_text()):
        assert time.monotonic() < deadline and sup.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)  # the supervisor's handlers are installed before it starts the command
    return sup, [int(p) for p in pids.read_text().split()]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_ends_the_command_and_its_children(tmp_path: Path, sig: int) -> None:
    sup, pids = _start(tmp_path, "plain", grace=20)
    assert all(_alive(p) for p in pids)
    started = time.monotonic()
    sup.send_signal(sig)
    assert sup.wait(timeout=30) == 0
    assert time.monotonic() - started < 10  # SIGTERM sufficed: no wait for the grace period
    assert not any(_alive(p) for p in pids)
    assert f"dev: {signal.Signals(sig).name}: stopping" in sup.stderr.read().decode()


def test_what_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    sup, pids = _start(tmp_path, "stubborn", grace=1)
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
