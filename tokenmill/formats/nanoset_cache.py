"""Nanoset index cache format: content-addressed ``.npy`` entries, writer and the one reader.

An entry is ``<hash>-Nanoset-<split>-{document,sample,shuffle}_index.npy`` plus
``<hash>-Nanoset-<split>-description.json`` written last. The description's ``key`` holds every
input that changes the arrays; its md5 names the files, so a changed setting never finds a stale
entry; ``files`` records each array's ``{file, dtype, shape, bytes, sha256}``. Arrays are written
temp → fsync → rename, loaded with ``allow_pickle=False`` and ``mmap_mode="r"``, and checked
against the sizes, dtypes and shapes the description records (:func:`load_entry_arrays`, used by
the index builder and by the loader alike). Builders take an exclusive ``fcntl.flock`` on a lock
file so that N processes starting at once build one entry and the others wait and load it; the lock
file is removed when released (readers never create one), so none stays in the cache.
numpy + stdlib only: the loader imports it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import (
    atomic_open,
    file_sha256,
    load_json,
    remove_stale_temps,
    write_bytes,
)
from tokenmill.errors import CacheError, FormatError

ARRAYS = ("document", "sample", "shuffle")
DESCRIPTION_SUFFIX = "-description.json"


def key_hash(key: dict[str, Any]) -> str:
    """md5 of the ordered, indented JSON of ``key`` (the references' naming scheme)."""
    return hashlib.md5(json.dumps(key, indent=4).encode("utf-8")).hexdigest()


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the lock file ``path``, removed again on release.

    The holder unlinks the file before unlocking, so a waiter may wake holding a lock on a
    removed file: it then retries on the file now at ``path`` (the usual lock-and-unlink
    protocol), and two holders never overlap.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            current = os.stat(path)
            if (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
                break
        except FileNotFoundError:  # removed by the holder we waited for: lock the next one
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def save_array(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Write ``array`` atomically as ``.npy``; return the record kept in the description."""
    array = np.ascontiguousarray(array)
    remove_stale_temps(path)
    with atomic_open(path, "wb") as fh:
        np.save(fh, array, allow_pickle=False)
    return {
        "file": path.name,
        "dtype": array.dtype.str,
        "shape": list(array.shape),
        "bytes": path.stat().st_size,
        "sha256": file_sha256(path),
    }


def load_array(
    path: Path, record: dict[str, Any], *, full: bool = False, what: str = "array"
) -> np.ndarray:
    """Memory-map an array written by :func:`save_array`, refusing any mismatch.

    Always checks the byte size, dtype and shape (cheap); ``full`` also re-hashes the file.
    Raises CacheError naming the file and the field that differs from the record, FormatError
    (naming ``what``) when the file is not a plain numeric ``.npy`` (never unpickled).
    """
    if not path.is_file():
        raise CacheError(f"{path}: missing (the cache entry is incomplete)")
    size = path.stat().st_size
    if size != record.get("bytes"):
        raise CacheError(f"{path}: {size} bytes, the description records {record.get('bytes')}")
    try:
        array = np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError, EOFError) as exc:
        raise FormatError(
            path, what, f"unreadable .npy, not a plain numeric array ({exc}); rebuild it"
        ) from exc
    if array.dtype.hasobject:
        raise FormatError(path, what, "unreadable .npy: an object array; rebuild it")
    if array.dtype.str != record.get("dtype"):
        raise CacheError(
            f"{path}: dtype {array.dtype.str}, the description records {record.get('dtype')}"
        )
    if list(array.shape) != record.get("shape"):
        raise CacheError(
            f"{path}: shape {list(array.shape)}, the description records {record.get('shape')}"
        )
    if full and file_sha256(path) != record.get("sha256"):
        raise CacheError(f"{path}: sha256 differs from the description")
    return array


def write_description(path: Path, description: dict[str, Any]) -> None:
    """Atomically write the description (the commit point of a cache entry)."""
    remove_stale_temps(path)
    write_bytes(path, (json.dumps(description, indent=4) + "\n").encode("utf-8"))


def read_description(path: Path) -> dict[str, Any] | None:
    """The parsed description, or None when it is missing or unreadable (never committed)."""
    try:
        description = load_json(path.read_bytes(), path, "description")
    except (FileNotFoundError, FormatError):
        return None
    return description if isinstance(description, dict) else None


def remove_entry(paths: list[Path]) -> None:
    """Delete a cache entry's files (description first, so no reader trusts the rest)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        remove_stale_temps(path)


def entry_paths(cache_dir: str | Path, digest: str, split: str) -> dict[str, Path]:
    """The four files of one entry, keyed "document", "sample", "shuffle", "description"."""
    return _named(Path(cache_dir) / f"{digest}-Nanoset-{split}")


def entry_paths_from_description(description_path: Path) -> dict[str, Path]:
    """The four files of the entry whose description is ``description_path``."""
    return _named(description_path.with_name(description_path.name[: -len(DESCRIPTION_SUFFIX)]))


def _named(base: Path) -> dict[str, Path]:
    """An entry's file paths from ``<cache_dir>/<hash>-Nanoset-<split>``."""
    paths = {name: Path(f"{base}-{name}_index.npy") for name in ARRAYS}
    paths["description"] = Path(f"{base}{DESCRIPTION_SUFFIX}")
    return paths


def load_entry_arrays(
    paths: dict[str, Path], description: dict[str, Any], *, full: bool = False
) -> dict[str, np.ndarray]:
    """An entry's three arrays, memory-mapped and each checked against its record (file name,
    size, dtype, shape; ``full``: sha256) and its rank (``sample`` 2-D, the others 1-D,
    integers). CacheError naming the file and what differs; FormatError for a file that is no
    plain numeric ``.npy``."""
    files = description.get("files")
    if not isinstance(files, dict):
        raise CacheError(f"{paths['description']}: no 'files' record")
    arrays = {}
    for name in ARRAYS:
        record = files.get(name)
        if not isinstance(record, dict) or record.get("file") != paths[name].name:
            found = record.get("file") if isinstance(record, dict) else record
            raise CacheError(f"{paths['description']}: {name} file is {found!r}")
        array = load_array(paths[name], record, full=full, what=f"{name}_index")
        ndim = 2 if name == "sample" else 1
        if array.dtype.kind not in "iu" or array.ndim != ndim:
            raise CacheError(
                f"{paths[name]}: {array.ndim}-D {array.dtype}, expected a {ndim}-D integer array"
            )
        arrays[name] = array
    return arrays
