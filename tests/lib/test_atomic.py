"""Temp names and stale-temp removal on a storage root shared by several hosts: a temp says
which host and pid write it, lives in its folder's ``.tmp/``, and only temps of dead processes
of this host are removed; finding them never lists the folder of finished files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tokenmill.atomic import (
    TMP_DIR,
    TMP_MARK,
    CommitOnExit,
    atomic_open,
    create_temp,
    host_tag,
    is_temp,
    remove_empty_dir,
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
    assert tmp.parent == tmp_path / TMP_DIR and tmp.parent.is_dir() and not tmp.exists()
    assert temp_path_for(tmp).parent == tmp.parent  # a temp of a temp: same .tmp/, not nested
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
    mid-write: beta removes its own dead temps (of any name in ``.tmp/``, files or staging
    folders) and the legacy host-less one, never alpha's nor its own live one."""
    dead = _dead_pid()
    names = {
        "alpha_writing": f"x.bin{TMP_MARK}alpha-{dead}-0a0a",
        "beta_dead": f"x.bin{TMP_MARK}beta-{dead}-0b0b",
        "beta_live": f"x.bin{TMP_MARK}beta-{os.getpid()}-0c0c",
        "legacy_dead": f"x.bin{TMP_MARK}{DEAD_PID}-0d0d",
        "other_file_dead": f"y.bin{TMP_MARK}beta-{dead}-0e0e",
        "boto_partial_dead": f"y.bin{TMP_MARK}beta-{dead}-0f0f.1a2B3c4D",
        "alpha_host_with_mark": f"y.bin{TMP_MARK}alpha.tmp-{dead}-1b1b",
    }
    tdir = tmp_path / TMP_DIR
    tdir.mkdir()
    for name in names.values():
        (tdir / name).write_bytes(b"partial")
    staging = tdir / f"0123456789abcdef{TMP_MARK}beta-{dead}-1a1a"
    staging.mkdir()
    (staging / "manifest.json").write_bytes(b"{}")
    monkeypatch.setattr(socket, "gethostname", lambda: "beta")
    with atomic_open(tmp_path / "x.bin") as fh:
        remove_stale_temps(tmp_path / "x.bin")
        fh.write(b"done")
    assert sorted(p.name for p in tmp_path.iterdir()) == [TMP_DIR, "x.bin"]
    kept = [names[k] for k in ("alpha_writing", "beta_live", "alpha_host_with_mark")]
    assert sorted(p.name for p in tdir.iterdir()) == sorted(kept)
    assert (tmp_path / "x.bin").read_bytes() == b"done"


def test_stale_scan_never_lists_the_final_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big output folder: finding dead temps lists ``.tmp/`` only (the temps in flight), so
    its cost does not grow with the finished files beside them."""
    for i in range(200):
        (tmp_path / f"shard-{i:05d}.bin").write_bytes(b"")
    temp_path_for(tmp_path / "shard-00007.bin")  # makes .tmp/ (and sweeps the folder once)
    tdir = tmp_path / TMP_DIR
    (tdir / f"shard-00007.bin{TMP_MARK}{DEAD_PID}-0007").write_bytes(b"")
    listed: list[str] = []
    real_listdir, real_scandir = os.listdir, os.scandir

    def listdir(path: Any = ".") -> list[str]:
        listed.append(os.fspath(path))
        return real_listdir(path)

    def scandir(path: Any = ".") -> Any:
        listed.append(os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "scandir", scandir)
    for i in (7, 8):
        remove_stale_temps(tmp_path / f"shard-{i:05d}.bin")
        with atomic_open(tmp_path / f"shard-{i:05d}.bin") as fh:
            fh.write(b"x")
    assert listed and set(listed) == {os.fspath(tdir)}
    assert os.listdir(tdir) == []
    assert len(real_listdir(tmp_path)) == 201


def test_legacy_temps_beside_files_are_swept_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temps older releases wrote beside the file: the call that makes ``.tmp/`` removes the
    dead ones of this host (files and staging folders) and keeps live, other-host and
    non-temp names; later calls never list the folder again."""
    monkeypatch.setattr(socket, "gethostname", lambda: "beta")
    dead = _dead_pid()
    keep = [
        f"x.bin{TMP_MARK}alpha-{dead}-0a0a",
        f"x.bin{TMP_MARK}beta-{os.getpid()}-0c0c",
        f"notes{TMP_MARK}final.txt",
        "x.bin",
    ]
    gone = [f"x.bin{TMP_MARK}{DEAD_PID}-0d0d", f"y.idx{TMP_MARK}beta-{dead}-0e0e"]
    for name in keep + gone:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / f"0123456789abcdef{TMP_MARK}beta-{dead}-1a1a").mkdir()
    final = tmp_path / "x.bin"
    with atomic_open(final) as fh:
        fh.write(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*keep, TMP_DIR])
    (tmp_path / gone[0]).write_bytes(b"")  # a legacy temp appearing later is not looked for
    listed: list[str] = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p=".": listed.append(os.fspath(p)) or real_listdir(p))
    with atomic_open(final) as fh:
        fh.write(b"again")
    assert os.fspath(tmp_path) not in listed and (tmp_path / gone[0]).exists()


def test_create_temp_survives_a_removed_tmp_folder(tmp_path: Path) -> None:
    """An owner of the folder removes the empty ``.tmp/`` between naming a temp and creating
    it: the creator makes it again and creates a fresh name there."""
    attempts: list[Path] = []

    def make(path: Path) -> Any:
        attempts.append(path)
        if len(attempts) == 1:
            os.rmdir(path.parent)
        return open(path, "wb")

    tmp, fh = create_temp(tmp_path / "x.bin", make)
    fh.close()
    assert len(attempts) == 2 and tmp == attempts[1] and tmp.is_file()
    assert tmp.parent == tmp_path / TMP_DIR
    with pytest.raises(FileNotFoundError):  # a missing source is not retried for ever
        create_temp(tmp_path / "x.bin", lambda t: os.link(tmp_path / "absent", t))


def test_remove_empty_dir_takes_an_empty_tmp_folder_along(tmp_path: Path) -> None:
    version = tmp_path / "0123456789abcdef"
    temp_path_for(version / "a.bin")
    assert remove_empty_dir(version) and not version.exists()
    busy = tmp_path / "busy"
    busy_tmp = temp_path_for(busy / "a.bin")
    busy_tmp.write_bytes(b"in flight")
    assert not remove_empty_dir(busy) and busy_tmp.exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a.bin").write_bytes(b"")
    assert not remove_empty_dir(tmp_path / "full")


def test_is_temp_names() -> None:
    assert is_temp(f"tokens/d/x.bin{TMP_MARK}h-1-ab")
    assert is_temp("blends/m/versions/.tmp/0123/manifest.json")
    assert not is_temp("blends/m/versions/0123/manifest.json")
    assert not is_temp("hf/d/data/a.tmp.parquet")


def test_missing_folder_is_nothing_to_remove(tmp_path: Path) -> None:
    remove_stale_temps(tmp_path / "absent" / "x.bin")
    assert not (tmp_path / "absent").exists()


class _Recorder(CommitOnExit):
    """Records the calls its exit makes; ``fail`` makes finalize raise (a full disk)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def finalize(self) -> None:
        self.calls.append("finalize")
        if self.fail:
            raise OSError(28, "No space left on device")

    def abort(self) -> None:
        self.calls.append("abort")


def test_commit_on_exit_commits_clean_exits_and_aborts_everything_else() -> None:
    with _Recorder() as clean:
        pass
    assert clean.calls == ["finalize"]
    with pytest.raises(ValueError), _Recorder() as failed:
        raise ValueError("the caller failed")
    assert failed.calls == ["abort"]
    with pytest.raises(OSError, match="No space"), _Recorder(fail=True) as full:
        pass
    assert full.calls == ["finalize", "abort"]
