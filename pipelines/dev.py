"""``make dev``: run ``dagster dev`` so that SIGINT, SIGTERM and SIGHUP stop it and all it started.

Started from a script (a background job without job control), a process inherits SIGINT
ignored; Python then installs no handler, so ``dagster dev``, its webserver and its daemon all
ignore Ctrl-C and ``kill -INT``, and a SIGTERM that make forwards stops ``dagster dev`` alone,
leaving its children running. ``python -m pipelines.dev COMMAND...`` runs COMMAND in a process
group of its own with default signal dispositions and, on any of those signals, sends SIGTERM
to the whole group, waits up to ``--grace`` seconds and SIGKILLs whatever is left. When the
command ends by itself, anything it left in its group is stopped the same way. Exit code: 0
after a requested stop, else the command's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_SECONDS = 20.0
POLL_SECONDS = 0.2


def _default_signals() -> None:
    """In the child before exec: default dispositions, whatever the caller inherited."""
    for sig in (*STOP_SIGNALS, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member changed user: it is there
        return True
    return True


def stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM every process of ``proc``'s group, then SIGKILL after ``grace`` seconds if any
    is left (``proc`` is reaped meanwhile: a zombie leader would keep the group alive)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()
        if not _group_alive(proc.pid):
            return
        time.sleep(POLL_SECONDS)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def supervise(command: Sequence[str], grace: float = GRACE_SECONDS) -> int:
    """Run ``command`` in its own process group until it ends or a stop signal arrives."""
    proc = subprocess.Popen(list(command), start_new_session=True, preexec_fn=_default_signals)
    requested: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        requested.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    while proc.poll() is None and not requested:
        time.sleep(POLL_SECONDS)
    if requested:
        print(f"dev: {signal.Signals(requested[0]).name}: stopping", file=sys.stderr, flush=True)
    stop_group(proc, grace if requested else min(grace, 5.0))
    rc = proc.wait()
    return 0 if requested else rc


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``[--grace S] COMMAND...`` and supervise COMMAND."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.dev", description=__doc__)
    parser.add_argument("--grace", type=float, default=GRACE_SECONDS, help="seconds (default 20)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("a command to run is required")
    return supervise(args.command, args.grace)


if __name__ == "__main__":
    sys.exit(main())
