"""Pointers to immutable versions: the one small file a refresh moves.

A version's files are written under a folder that names it and never rewritten. The pointer
(``merged/<ds>/current.json``; for a blend, ``blends/<name>/manifest.json`` itself) is written
last, atomically (temp → fsync → rename locally; on S3 the object is uploaded after every file
it names), so a reader sees the old version or the new one, never a mix, and a failed refresh
leaves the pointer where it was.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from tokenmill.atomic import load_json, write_json
from tokenmill.errors import FormatError
from tokenmill.storage.layout import version_dir_name

POINTER_FORMAT = 1


def version_hash(description: Any) -> str:
    """The version of an artifact: sha256 of the canonical JSON of everything its content
    depends on (inputs' content hashes, settings, format version)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def write_pointer(path: str | os.PathLike[str], version: str, target: str) -> dict[str, Any]:
    """Point ``path`` at ``version``, whose files live at ``target`` (relative to the pointer's
    folder); atomic. Returns the record written."""
    version_dir_name(version)  # refuses a malformed version before anything is written
    record = {"format_version": POINTER_FORMAT, "version": version, "target": target}
    write_json(path, record)
    return record


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pointer at ``path`` (``{"version", "target"}``), or None when there is none yet;
    FormatError naming the file when it is not a pointer this tokenmill wrote."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    return parse_pointer(raw, path)


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
    """The path a pointer names (its ``target`` under the pointer's folder), or None when there
    is no pointer yet."""
    record = read_pointer(path)
    return None if record is None else Path(path).parent / str(record["target"])
