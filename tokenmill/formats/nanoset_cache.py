"""Nanoset index cache format: content-addressed ``.npy`` entries, writer and the one reader.

An entry is ``<hash>-Nanoset-<split>-{document,sample,shuffle}_index.npy`` plus
``<hash>-Nanoset-<split>-description.json`` written last. The description's ``key`` holds every
input that changes the arrays and its md5 names the files, so a changed setting never finds a
stale entry; ``files`` records each array's ``{file, dtype, shape, bytes, sha256}``, checked on
every load. Builders hold an exclusive ``flock`` so that N processes build one entry and the
others wait and load it. numpy + stdlib only: the loader imports it.
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

from tokenmill.atomic import atomic_open, file_sha256, load_json, remove_stale_temps, write_bytes
from tokenmill.errors import CacheError, FormatError

ARRAYS = ("document", "sample", "shuffle")
DESCRIPTION_SUFFIX = "-description.json"


def key_hash(key: dict[str, Any]) -> str:
    """md5 of the ordered, indented JSON of ``key`` (the references' naming scheme)."""
    return hashlib.md5(json.dumps(key, indent=4).encode("utf-8")).hexdigest()


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the lock file ``path``, removed again on release. A waiter
    that wakes holding a lock on the removed file retries on the one now at ``path``."""
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
    """Memory-map an array written by :func:`save_array`: CacheError naming the field that
    differs from ``record`` (size, dtype, shape; ``full``: sha256), FormatError naming ``what``
    for a file that is not a plain numeric ``.npy`` (never unpickled)."""
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
    for field, found in (("dtype", array.dtype.str), ("shape", list(array.shape))):
        if found != record.get(field):
            raise CacheError(
                f"{path}: {field} {found}, the description records {record.get(field)}"
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


def segment_keys(files: dict[str, Any], kind: str) -> list[str]:
    """The record keys of array ``kind``'s parts in order: a growing entry that extends its
    predecessor records ``<kind>.0``, ``<kind>.1``, ... (earlier entries' files) before its own
    ``<kind>`` (see docs/formats.md, "Growing entries: segments")."""
    count = 0
    while f"{kind}.{count}" in files:
        count += 1
    return [*(f"{kind}.{i}" for i in range(count)), kind]


def segment_files(description: dict[str, Any]) -> list[str]:
    """The file names of a description's segments (earlier entries' arrays it reads)."""
    files = description.get("files")
    if not isinstance(files, dict):
        return []
    return [str(r.get("file")) for k, r in files.items() if "." in k and isinstance(r, dict)]


def entry_array_paths(paths: dict[str, Path], description: dict[str, Any]) -> dict[str, list[Path]]:
    """Each array's part files in order (one for an entry without segments), beside the
    description. CacheError for a segment record whose file is not a plain cache-entry name."""
    files = description.get("files")
    if not isinstance(files, dict):
        raise CacheError(f"{paths['description']}: no 'files' record")
    out: dict[str, list[Path]] = {}
    for name in ARRAYS:
        parts = []
        for key in segment_keys(files, name)[:-1]:
            record = files[key]
            found = record.get("file") if isinstance(record, dict) else record
            suffix = f"-{name}_index.npy"
            if not isinstance(found, str) or "/" in found or not found.endswith(suffix):
                raise CacheError(f"{paths['description']}: segment {key} file is {found!r}")
            parts.append(paths["description"].parent / found)
        out[name] = [*parts, paths[name]]
    return out


def load_entry_arrays(
    paths: dict[str, Path], description: dict[str, Any], *, full: bool = False
) -> dict[str, np.ndarray]:
    """An entry's three arrays, each part checked by :func:`load_array` and for its file name and
    rank (``sample`` 2-D integers, the others 1-D); segments give a :class:`SegmentedArray`."""
    part_files = entry_array_paths(paths, description)
    files = description["files"]
    arrays: dict[str, Any] = {}
    for name, part_paths in part_files.items():
        parts = []
        for key, path in zip(segment_keys(files, name), part_paths, strict=True):
            record = files.get(key)
            if not isinstance(record, dict) or record.get("file") != path.name:
                found = record.get("file") if isinstance(record, dict) else record
                raise CacheError(f"{paths['description']}: {key} file is {found!r}")
            array = load_array(path, record, full=full, what=f"{name}_index")
            ndim = 2 if name == "sample" else 1
            if array.dtype.kind not in "iu" or array.ndim != ndim:
                raise CacheError(
                    f"{path}: {array.ndim}-D {array.dtype}, expected a {ndim}-D integer array"
                )
            parts.append(array)
        arrays[name] = parts[0] if len(parts) == 1 else SegmentedArray(parts)
    return arrays


class SegmentedArray:
    """Read-only concatenation along axis 0 of memory-mapped parts (a growing entry's segments,
    oldest first): indexing reads only the parts it touches. Supports what index readers use
    (``len``, ``shape``, ``a[i]``, ``a[ints]``, ``a[slice]``, ``a[:, c]``, ``min``/``max``,
    ``astype``); ``np.asarray(a)`` concatenates."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        if not parts:
            raise CacheError("a segmented array needs at least one part")
        self.parts = parts
        self.dtype = parts[0].dtype
        self.ndim = parts[0].ndim
        for part in parts:
            if part.dtype != self.dtype or part.ndim != self.ndim:
                raise CacheError(
                    f"segments differ: {part.ndim}-D {part.dtype} after {self.ndim}-D {self.dtype}"
                )
        rows = np.array([len(p) for p in parts], dtype=np.int64)
        self._ends = np.cumsum(rows)
        self.shape = (int(self._ends[-1]), *parts[0].shape[1:])
        self.size = int(np.prod(self.shape))

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = np.concatenate(self.parts)
        return whole if dtype is None else whole.astype(dtype)

    def _take(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (any shape of int64 positions, already in range) from their parts."""
        flat = rows.reshape(-1)
        part = np.searchsorted(self._ends, flat, side="right")
        out = np.empty((len(flat), *self.shape[1:]), dtype=self.dtype)
        for p in np.unique(part).tolist():
            at = part == p
            out[at] = self.parts[p][flat[at] - (self._ends[p] - len(self.parts[p]))]
        return out.reshape(*rows.shape, *self.shape[1:])

    def __getitem__(self, item: Any) -> Any:
        rest: tuple[Any, ...] = ()
        if isinstance(item, tuple):
            item, rest = item[0], item[1:]
        n = len(self)
        if isinstance(item, slice):
            rows = np.arange(n, dtype=np.int64)[item]
        elif isinstance(item, int | np.integer):
            i = int(item) + n if int(item) < 0 else int(item)
            if not 0 <= i < n:
                raise IndexError(f"index {int(item)} is out of bounds for length {n}")
            got = self._take(np.array(i, dtype=np.int64))
            return got[rest] if rest else got
        else:
            rows = np.asarray(item).astype(np.int64)
            if rows.dtype == bool:
                raise TypeError("boolean masks are not supported by a segmented array")
            if rows.size and (int(rows.min()) < -n or int(rows.max()) >= n):
                raise IndexError(f"index out of bounds for length {n}")
            rows = np.where(rows < 0, rows + n, rows)
        got = self._take(rows)
        return got[(slice(None), *rest)] if rest else got

    def min(self) -> Any:
        """The smallest value (ValueError when empty, as numpy)."""
        return min(p.min() for p in self.parts if p.size) if self.size else np.min(self.parts[0])

    def max(self) -> Any:
        """The largest value (ValueError when empty, as numpy)."""
        return max(p.max() for p in self.parts if p.size) if self.size else np.max(self.parts[0])

    def astype(self, dtype: Any) -> np.ndarray:
        """The whole array converted (a copy)."""
        return np.asarray(self).astype(dtype)
