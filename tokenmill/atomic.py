"""Crash-safe file writing: temp name in the same directory, fsync, rename, fsync the directory.

A killed process leaves at worst a ``*.tmp-<pid>-<rand>`` file, never a final-named file
that looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TMP_MARK = ".tmp-"


def temp_path_for(path: str | os.PathLike[str]) -> Path:
    """A unique temporary sibling of ``path`` (same directory, so rename is atomic)."""
    p = Path(path)
    return p.with_name(f"{p.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


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
    """Whether the process named by a temp name's ``<pid>-<random>`` suffix still runs (a zombie
    counts as dead): its temp file is being written, not left over."""
    try:
        pid = int(suffix.split("-", 1)[0])
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
    """Delete temp siblings of ``path`` left by killed writers. Temps of live processes stay:
    they belong to a concurrent writer of the same path (e.g. two runs of one partition)."""
    p = Path(path)
    if not p.parent.is_dir():
        return
    for cand in p.parent.glob(f"{p.name}{TMP_MARK}*"):
        if writer_alive(cand.name[len(p.name) + len(TMP_MARK) :]):
            continue
        with contextlib.suppress(FileNotFoundError):
            cand.unlink()


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
