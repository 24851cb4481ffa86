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
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp sibling for writing; on clean exit fsync and rename it to ``path``.

    On an exception the temp file is removed and ``path`` is left untouched.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(final)
    try:
        with open(tmp, mode) as fh:
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


def remove_stale_temps(path: str | os.PathLike[str]) -> None:
    """Delete temp siblings of ``path`` left by a killed writer (any pid)."""
    p = Path(path)
    if not p.parent.is_dir():
        return
    for cand in p.parent.glob(f"{p.name}{TMP_MARK}*"):
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
