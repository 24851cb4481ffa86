"""Crash-safe file writing: temp in the folder's ``.tmp/``, fsync, rename, fsync the folder.

A temp of ``<dir>/<name>`` is ``<dir>/.tmp/<name>.tmp-<host>-<pid>-<rand>``: on the same file
system (an atomic rename) and in a folder of its own, so finding a killed writer's temps lists
only the temps in flight. A killed process leaves at worst a temp, never a complete-looking file;
the host part lets each host of a shared root judge only its own temps. Writers never remove
``.tmp/`` (one would pull it from under another): only an owner of the whole folder does
(``remove_temp_dir``), and creators retry when that races them (``create_temp``). Temps beside
the file (``<dir>/<name>.tmp-…``) are swept once, by the call that creates ``<dir>/.tmp/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Self, TypeVar

from tokenmill.errors import FormatError

TMP_MARK = ".tmp-"
TMP_DIR = ".tmp"
_HOST_MAX = 40
# The most a temp name adds to the final name: ".tmp-<host>-<pid, 7 digits at most>-<8 hex>",
# and a transfer library's extension of its partial file (".1a2B3c4D"): whatever the host.
TEMP_NAME_EXTRA = len(TMP_MARK) + _HOST_MAX + 1 + 7 + 1 + 8 + 9
_CREATE_TRIES = 5
_T = TypeVar("_T")
# The end of a temp's name: ``.tmp-[<host>-]<pid>-<rand>``, and the extension a transfer
# library may add to its own partial file of that temp (e.g. boto3's ``.1a2B3c4D``).
_TEMP_END = re.compile(r"\.tmp-(?:([A-Za-z0-9._]{1,40})-)?(\d+)-([0-9a-f]+)(?:\.[A-Za-z0-9]+)?$")


def host_tag() -> str:
    """This machine's name as a temp-name part: letters, digits and ``.``/``_`` only (a ``-``
    would be ambiguous with the ``-<pid>-<rand>`` that follows), at most 40 characters."""
    name = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname())[:_HOST_MAX]
    return name or "_"


def temp_dir(folder: str | os.PathLike[str]) -> Path:
    """``<folder>/.tmp``, made (with ``folder``) when absent; the call that makes it also
    removes dead temps beside the files (so ``folder`` is listed once only)."""
    tdir = Path(folder) / TMP_DIR
    try:
        os.makedirs(tdir)
    except FileExistsError:
        return tdir
    _remove_dead(Path(folder), [e for e in _entries(Path(folder)) if TMP_MARK in e], strict=True)
    return tdir


def temp_path_for(path: str | os.PathLike[str]) -> Path:
    """A unique temp name for ``path`` in ``<its folder>/.tmp/`` (made if absent; a temp of a
    temp stays in its ``.tmp/``); the caller creates it, through ``create_temp`` if racing."""
    p = Path(path)
    folder = p.parent.parent if p.parent.name == TMP_DIR else p.parent
    writer = f"{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"  # only its host judges it
    return temp_dir(folder) / f"{p.name}{TMP_MARK}{writer}"


def is_temp(rel: str) -> bool:
    """Whether a (posix) path names a temp or lies in a ``.tmp/`` folder: never uploaded,
    listed as a shard or fetched."""
    return TMP_MARK in rel or TMP_DIR in rel.split("/")


def create_temp(path: str | os.PathLike[str], make: Callable[[Path], _T]) -> tuple[Path, _T]:
    """Name a temp for ``path`` and create it with ``make(temp)`` (open, mkdir, link, ...),
    retrying a few times when an owner removed the empty ``.tmp/`` in between (ENOENT)."""
    attempt = 1
    while True:
        tmp = temp_path_for(path)
        try:
            return tmp, make(tmp)
        except FileNotFoundError:
            if attempt >= _CREATE_TRIES or tmp.parent.is_dir():
                raise
            attempt += 1


def remove_temp_dir(folder: str | os.PathLike[str]) -> None:
    """Remove ``<folder>/.tmp`` when it is empty (a temp in flight keeps it). For an owner of
    the whole folder only; a concurrent writer re-creates it (``create_temp``)."""
    with contextlib.suppress(OSError):  # absent, or not empty
        os.rmdir(Path(folder) / TMP_DIR)


def remove_empty_dir(folder: str | os.PathLike[str]) -> bool:
    """Remove ``folder`` when nothing but an empty ``.tmp/`` is left in it (e.g. a version
    folder whose files were just deleted); True when it is gone."""
    try:
        if os.listdir(folder) not in ([], [TMP_DIR]):
            return False
        remove_temp_dir(folder)
        os.rmdir(folder)
    except OSError:  # not there, or a writer put something there meanwhile
        return False
    return True


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


def discard_temp(fh: IO[Any] | None, tmp: str | os.PathLike[str] | None) -> None:
    """Close an abandoned temp's handle (flushing the bytes being discarded may fail too, and
    is ignored) and remove the temp; either may be None (not opened, already gone)."""
    if fh is not None:
        with contextlib.suppress(OSError):
            fh.close()
    if tmp is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp of ``path`` for writing; on clean exit fsync and rename it to ``path``, on
    an exception remove the temp (``path`` untouched)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp, opened = create_temp(final, lambda t: open(t, mode))  # noqa: SIM115 - closed below
    try:
        with name_os_errors(final), opened as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        commit(tmp, final)
    except BaseException:
        discard_temp(None, tmp)
        raise


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Atomically replace ``path`` with ``data``."""
    with atomic_open(path, "wb") as fh:
        fh.write(data)


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically write ``obj`` as sorted, indented JSON (deterministic bytes)."""
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def load_json(raw: bytes | str, where: object, field: str = "json") -> Any:
    """Parse the JSON of a file tokenmill wrote; any damage (too deep, an integer too long) is
    a FormatError naming ``where``, never a bare ValueError or RecursionError."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(where, field, f"not valid JSON ({exc})") from exc
    except RecursionError as exc:
        raise FormatError(where, field, "not readable JSON: nested too deeply") from exc
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        raise FormatError(where, field, f"not readable JSON ({exc})") from exc


def read_if_exists(path: str | os.PathLike[str]) -> bytes | None:
    """The file's bytes, or None when there is no such file."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def read_json(path: str | os.PathLike[str], field: str = "json") -> Any:
    """``load_json`` of the file at ``path`` (FileNotFoundError when it is not there)."""
    return load_json(Path(path).read_bytes(), path, field)


def writer_alive(suffix: str) -> bool:
    """Whether the writer of a temp suffix ``<host>-<pid>-<rand>`` may still run: another
    host's always does; here its pid must run, not a zombie (a host-less ``<pid>-<rand>``: the
    same)."""
    parts = suffix.rsplit("-", 2)
    if len(parts) == 3 and parts[0] != host_tag():
        return True
    try:
        pid = int(parts[1] if len(parts) == 3 else suffix.split("-", 1)[0])
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
    """Delete the temps (files or folders) dead writers of this host left in ``path``'s
    folder's ``.tmp/``; live writers' and other hosts' temps stay. Lists ``.tmp/`` only."""
    tdir = Path(path).parent / TMP_DIR
    _remove_dead(tdir, _entries(tdir), strict=False)


def _entries(folder: Path) -> list[str]:
    """The names in ``folder`` (none when it does not exist)."""
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove_dead(folder: Path, names: list[str], *, strict: bool) -> None:
    """Delete each temp among ``names`` (in ``folder``) whose writer is dead. ``strict`` (a folder
    of finished files): only names ending like a temp; else (``.tmp/``) also any name with a
    ``.tmp-``, judged by what follows it (a garbled suffix counts as dead)."""
    for name in names:
        end = _TEMP_END.search(name)
        if end is not None:
            suffix = "-".join(part for part in end.groups() if part is not None)
        elif strict or TMP_MARK not in name:
            continue
        else:
            suffix = name.partition(TMP_MARK)[2]
        if writer_alive(suffix):
            continue
        target = folder / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)


def file_sha256(path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> str:
    """Hex sha256 of a file from ``offset`` (``length`` bytes; None or negative: to the end),
    streamed in blocks."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        if length is None or length < 0:
            return hashlib.file_digest(fh, "sha256").hexdigest()
        h = hashlib.sha256()
        while length > 0 and (chunk := fh.read(min(1 << 22, length))):
            h.update(chunk)
            length -= len(chunk)
    return h.hexdigest()


def json_sha256(obj: Any) -> str:
    """Hex sha256 of ``obj``'s canonical JSON (sorted keys, compact, ASCII): a content hash."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


class CommitOnExit:
    """A writer as a context manager: a clean exit commits it (``finalize``, a no-op once
    committed); an exception or a failing commit discards what it wrote (``abort``)."""

    def finalize(self) -> None:
        """Commit what was written (a subclass's own protocol: temp, fsync, rename)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Discard everything written so far."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.finalize()
        except BaseException:
            self.abort()
            raise
