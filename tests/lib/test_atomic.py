"""Temp names and stale-temp removal on a storage root shared by several hosts: a temp says
which host and pid write it, and only temps of dead processes of this host are removed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tokenmill.atomic as atomic
from tokenmill.atomic import (
    TMP_MARK,
    atomic_open,
    host_tag,
    remove_stale_temps,
    temp_path_for,
    writer_alive,
)

DEAD_PID = 2**22 + 1  # above any pid_max: never a running process


def _dead_pid() -> int:
    """The pid of a process that ran on this host and has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_temp_name_says_host_and_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "node-7.cluster")
    tmp = temp_path_for(tmp_path / "x.bin")
    host, pid, rand = tmp.name[len(f"x.bin{TMP_MARK}") :].rsplit("-", 2)
    assert (host, int(pid), len(rand)) == ("node_7.cluster", os.getpid(), 8)
    assert tmp.parent == tmp_path
    assert writer_alive(tmp.name.split(TMP_MARK, 1)[1])


def test_host_tag_is_one_name_part(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "a-b/c d" + "x" * 60)
    tag = host_tag()
    assert len(tag) == 40 and tag.startswith("a_b_c_d") and "-" not in tag
    monkeypatch.setattr(socket, "gethostname", lambda: "")
    assert host_tag() == "_"


def test_liveness_is_judged_per_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "alpha")
    dead = _dead_pid()
    assert writer_alive(f"alpha-{os.getpid()}-0a0a")
    assert not writer_alive(f"alpha-{dead}-0a0a")
    assert not writer_alive("alpha-x-0a0a")
    # Another host's pid numbers mean nothing here: its temp may be written right now.
    assert writer_alive(f"beta-{dead}-0a0a")
    assert writer_alive(f"beta-{DEAD_PID}-0a0a")
    # Temps named before the host part existed are judged by their pid, as they were.
    assert not writer_alive(f"{DEAD_PID}-0a0a")
    assert writer_alive(f"{os.getpid()}-0a0a")


def test_shared_root_keeps_other_hosts_temps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host beta writes ``x.bin`` while a writer on alpha (whose pid is dead on beta) is
    mid-write: beta removes its own dead temps and the legacy one, never alpha's."""
    dead = _dead_pid()
    names = {
        "alpha_writing": f"x.bin{TMP_MARK}alpha-{dead}-0a0a",
        "beta_dead": f"x.bin{TMP_MARK}beta-{dead}-0b0b",
        "beta_live": f"x.bin{TMP_MARK}beta-{os.getpid()}-0c0c",
        "legacy_dead": f"x.bin{TMP_MARK}{DEAD_PID}-0d0d",
        "other_file": f"y.bin{TMP_MARK}beta-{dead}-0e0e",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    monkeypatch.setattr(socket, "gethostname", lambda: "beta")
    with atomic_open(tmp_path / "x.bin") as fh:
        remove_stale_temps(tmp_path / "x.bin")
        fh.write(b"done")
    left = sorted(p.name for p in tmp_path.iterdir())
    expected = [names[k] for k in ("alpha_writing", "beta_live", "other_file")] + ["x.bin"]
    assert left == sorted(expected)
    assert (tmp_path / "x.bin").read_bytes() == b"done"


def test_only_own_prefix_is_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big output folder: the liveness check runs for the path's own temps only."""
    for i in range(200):
        (tmp_path / f"shard-{i:05d}.bin").write_bytes(b"")
        (tmp_path / f"shard-{i:05d}.bin{TMP_MARK}{DEAD_PID}-{i:04x}").write_bytes(b"")
    judged: list[str] = []

    def spy(suffix: str) -> bool:
        judged.append(suffix)
        return False

    monkeypatch.setattr(atomic, "writer_alive", spy)
    remove_stale_temps(tmp_path / "shard-00007.bin")
    assert judged == [f"{DEAD_PID}-0007"]
    assert len(list(tmp_path.iterdir())) == 399


def test_missing_folder_is_nothing_to_remove(tmp_path: Path) -> None:
    remove_stale_temps(tmp_path / "absent" / "x.bin")
    assert not (tmp_path / "absent").exists()
