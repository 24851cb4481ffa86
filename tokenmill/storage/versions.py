"""Pointers to immutable versions: the one small file a refresh moves.

A version's files go under a folder that names it and are never rewritten; the pointer
(``merged/<ds>/current.json``, or a blend's ``blends/<name>/manifest.json`` itself) is written
last, atomically, so a reader sees the old version or the new one. A write is a compare-and-swap
(:func:`swap_pointer`): a build reads the pointer *before* its inputs and at the end writes under
an exclusive ``flock`` on ``<folder>/.tmp/<pointer>.lock`` (released when the holder dies) only
when the pointer still names what it read, or its own version; otherwise ConflictError, and the
version of the build that read newer inputs stays. On S3: a conditional PUT (``staging``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Final

from tokenmill.atomic import json_sha256, load_json, read_if_exists, temp_dir, write_bytes
from tokenmill.errors import ConflictError, FormatError
from tokenmill.formats.nanoset_cache import exclusive_lock
from tokenmill.storage.layout import version_dir_name

POINTER_FORMAT = 1
LOCK_SUFFIX = ".lock"
# ``expected`` of a writer that checks nothing: the only writer there is (a test fixture, a tree
# being set up). Every build passes the pointer it read at its start instead.
UNCHECKED: Final = "<unchecked>"
# ``expected`` of a builder that reads the pointer itself, first thing (``build_blend``).
READ_AT_START: Final = "<read at start>"
Expected = Mapping[str, Any] | str | None


def version_hash(description: Any) -> str:
    """The version of an artifact: sha256 of the canonical JSON of everything its content
    depends on (inputs' content hashes, settings, format version)."""
    return json_sha256(description)


def pointer_version(path: str | os.PathLike[str]) -> str | None:
    """The version a pointer file names: None when there is none, ``""`` when it is not JSON
    naming a version (a damaged pointer: a build that read it so may replace it)."""
    data = read_if_exists(path)
    return None if data is None else version_named(data)


def version_named(data: bytes) -> str:
    """The version a pointer's bytes name, ``""`` when they are not JSON naming one."""
    try:
        record = load_json(data, "pointer")
    except FormatError:
        return ""
    version = record.get("version") if isinstance(record, dict) else None
    return version if isinstance(version, str) else ""


@contextmanager
def pointer_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the exclusive lock of the pointer ``path``: ``<folder>/.tmp/<name>.lock`` (in
    ``.tmp/``: never uploaded, listed or fetched; a killed holder's ``flock`` dies with it)."""
    path = Path(path)
    with exclusive_lock(temp_dir(path.parent) / f"{path.name}{LOCK_SUFFIX}"):
        yield


def swap_pointer(
    path: str | os.PathLike[str], version: str, record: Mapping[str, Any], *, expected: Expected
) -> bool:
    """Compare-and-swap under :func:`pointer_lock`: write ``record`` (sorted JSON, atomic) when the
    pointer still names ``expected`` (the record or version read before the build's inputs;
    None: none) or already ``version``; False when it held these bytes. ConflictError when it
    moved elsewhere: a build that read it later (so newer inputs) won, and its version stays."""
    path = Path(path)
    data = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode("utf-8")
    with pointer_lock(path):
        found = pointer_version(path)
        if expected != UNCHECKED:
            want = str(expected["version"]) if isinstance(expected, Mapping) else expected
            if found not in (want, version):
                raise ConflictError(path, want, found, version)
        if read_if_exists(path) == data:
            return False
        write_bytes(path, data)
    return True


def write_pointer(
    path: str | os.PathLike[str], version: str, target: str, *, expected: Expected = UNCHECKED
) -> dict[str, Any]:
    """Point ``path`` at ``version``, whose files live at ``target`` (relative to the pointer's
    folder), by :func:`swap_pointer` against ``expected`` (left out only by the sole writer:
    ``UNCHECKED``). Returns the record written."""
    version_dir_name(version)  # refuses a malformed version before anything is written
    record = {"format_version": POINTER_FORMAT, "version": version, "target": target}
    swap_pointer(path, version, record, expected=expected)
    return record


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pointer at ``path`` (``{"version", "target"}``), or None when there is none yet;
    FormatError naming the file when it is not a pointer this tokenmill wrote."""
    raw = read_if_exists(path)
    return None if raw is None else parse_pointer(raw, path)


def parse_pointer(raw: bytes, path: object) -> dict[str, Any]:
    """``read_pointer`` of bytes already read (e.g. from S3); errors name ``path``."""
    record = load_json(raw, path, "pointer")
    if not isinstance(record, dict) or record.get("format_version") != POINTER_FORMAT:
        raise FormatError(path, "format_version", f"not a version pointer: {record!r:.200}")
    version, target = record.get("version"), record.get("target")
    if not isinstance(version, str) or not isinstance(target, str):
        raise FormatError(path, "pointer", f"version and target must be strings: {record!r:.200}")
    version_dir_name(version)
    if target.startswith("/") or ".." in PurePosixPath(target).parts:
        raise FormatError(path, "target", f"{target!r} leaves the pointer's folder")
    return record


def pointer_target(path: str | os.PathLike[str]) -> Path | None:
    """The path a pointer names (``target`` under its folder), or None when there is none yet."""
    record = read_pointer(path)
    return None if record is None else Path(path).parent / str(record["target"])
