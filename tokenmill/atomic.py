"""Crash-safe file writing: temp name in the same directory, fsync, rename, fsync the directory.

A killed process leaves at worst a ``*.tmp-<host>-<pid>-<rand>`` file, never a final-named file
that looks complete. The host part makes liveness checkable on a storage root shared by several
machines (or containers, which have their own pid numbers): only this host's temps are judged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TMP_MARK = ".tmp-"
_HOST_MAX = 40


def host_tag() -> str:
    """This machine's name as a temp-name part: letters, digits and ``.``/``_`` only (a ``-``
    would be ambiguous with the ``-<pid>-<rand>`` that follows), at most 40 characters."""
    name = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname())[:_HOST_MAX]
    return name or "_"


def temp_suffix() -> str:
    """``<host>-<pid>-<rand>``: who writes a temp, so only its own host judges it stale."""
    return f"{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


def temp_path_for(path: str | os.PathLike[str]) -> Path:
    """A unique temporary sibling of ``path`` (same directory, so rename is atomic)."""
    p = Path(path)
    return p.with_name(f"{p.name}{TMP_MARK}{temp_suffix()}")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory entry so a completed rename survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Rename a fully written and fsynced temp file to its final name."""
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


@contextlib.contextmanager
def name_os_errors(
    path: str | os.PathLike[str], source: str | os.PathLike[str] | None = None
) -> Iterator[None]:
    """Re-raise an OSError that carries no file name (how a full or failing disk reports a
    write: ENOSPC, EIO) with ``path`` as its file (and ``source`` when copying from one)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        if exc.errno is None:
            raise OSError(f"{os.fspath(path)}: {exc}") from exc
        names = [os.fspath(path)] if source is None else [os.fspath(source), None, os.fspath(path)]
        raise OSError(exc.errno, exc.strerror or str(exc), *names) from exc


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp sibling for writing; on clean exit fsync and rename it to ``path``.

    On an exception the temp file is removed and ``path`` is left untouched.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(final)
    try:
        with name_os_errors(final), open(tmp, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        commit(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Atomically replace ``path`` with ``data``."""
    with atomic_open(path, "wb") as fh:
        fh.write(data)


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically write ``obj`` as sorted, indented JSON (deterministic bytes)."""
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def writer_alive(suffix: str) -> bool:
    """Whether the writer named by a temp name's ``<host>-<pid>-<rand>`` suffix may still run:
    a temp of another host is always taken as live (its pids mean nothing here); on this host
    the pid must run and not be a zombie. A host-less ``<pid>-<rand>`` (written before temps
    named their host) is judged by its pid alone."""
    parts = suffix.rsplit("-", 2)
    if len(parts) == 3:
        host, pid_text = parts[0], parts[1]
        if host != host_tag():
            return True
    else:
        pid_text = suffix.split("-", 1)[0]
    return _pid_alive(pid_text)


def _pid_alive(pid_text: str) -> bool:
    """True when ``pid_text`` is the pid of a process of this host that runs (not a zombie)."""
    try:
        pid = int(pid_text)
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's live process
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no procfs: the signal check is all there is
    return state not in ("Z", "X")


def remove_stale_temps(path: str | os.PathLike[str]) -> None:
    """Delete temp siblings of ``path`` left by killed writers of this host. Temps of live
    processes stay (a concurrent writer of the same path, e.g. two runs of one partition), and
    so do other hosts' temps. The folder is read once, comparing names by prefix only; no
    per-entry stat or path object for the (many) other files of a big output folder."""
    p = Path(path)
    prefix = f"{p.name}{TMP_MARK}"
    try:
        with os.scandir(p.parent) as entries:
            stale = [
                e.name
                for e in entries
                if e.name.startswith(prefix) and not writer_alive(e.name[len(prefix) :])
            ]
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p.parent / name)


def file_sha256(
    path: str | os.PathLike[str], offset: int = 0, length: int | None = None, block: int = 1 << 22
) -> str:
    """Hex sha256 of a file (or of ``length`` bytes from ``offset``), streamed in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(offset)
        left = -1 if length is None else length
        while left:
            chunk = fh.read(block if left < 0 else min(block, left))
            if not chunk:
                break
            h.update(chunk)
            if left > 0:
                left -= len(chunk)
    return h.hexdigest()
