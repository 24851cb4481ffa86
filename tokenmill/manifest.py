"""Per-dataset manifests (``P.manifest.json``): written last, the only thing that says "done".

A manifest records the format version, the kind of artifact, its inputs (with content hashes),
the config that produced it, counts, and the sizes and sha256 of its own files.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tokenmill._atomic import file_sha256, write_json
from tokenmill.errors import FormatError
from tokenmill.formats.indexed import data_file_path, index_file_path

FORMAT_VERSION = 1


def dataset_manifest_path(prefix: str | os.PathLike[str]) -> Path:
    """``P.manifest.json`` for a ``.bin``/``.idx`` prefix ``P``."""
    return Path(f"{os.fspath(prefix)}.manifest.json")


def describe_files(paths: list[Path], *, root: Path) -> dict[str, dict[str, Any]]:
    """``{relative name: {bytes, sha256}}`` for files, names relative to ``root``."""
    return {
        str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in paths
    }


def write_dataset_manifest(
    prefix: str | os.PathLike[str],
    *,
    kind: str,
    inputs: list[dict[str, Any]],
    config: dict[str, Any],
    counts: dict[str, int],
) -> dict[str, Any]:
    """Hash the pair's files and write the manifest atomically (call after the pair is final)."""
    prefix = Path(prefix)
    files = describe_files(
        [data_file_path(prefix), index_file_path(prefix)], root=prefix.parent
    )
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "prefix": prefix.name,
        "inputs": inputs,
        "config": config,
        "counts": counts,
        "files": files,
        "content_hash": _content_hash(files),
    }
    write_json(dataset_manifest_path(prefix), manifest)
    return manifest


def _content_hash(files: dict[str, dict[str, Any]]) -> str:
    """One hash for the pair: sha256 over the sorted (name suffix, sha256) entries."""
    h = hashlib.sha256()
    for name in sorted(files, key=lambda n: Path(n).suffix):
        h.update(Path(name).suffix.encode() + b"\0" + files[name]["sha256"].encode() + b"\0")
    return h.hexdigest()


def read_dataset_manifest(prefix: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and sanity-check a dataset manifest; FormatError if missing or malformed."""
    path = dataset_manifest_path(prefix)
    if not path.is_file():
        raise FormatError(path, "manifest", "missing: the dataset was never completed")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(path, "manifest", f"not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise FormatError(path, "format_version", f"expected {FORMAT_VERSION}")
    for key in ("files", "counts", "content_hash"):
        if key not in manifest:
            raise FormatError(path, key, "missing from the manifest")
    return manifest


def check_dataset_files(prefix: str | os.PathLike[str], *, full: bool = False) -> list[str]:
    """Problems between a dataset's manifest and its files: sizes always, sha256 when ``full``."""
    prefix = Path(prefix)
    manifest = read_dataset_manifest(prefix)
    problems = []
    for name, info in manifest["files"].items():
        p = prefix.parent / name
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        size = p.stat().st_size
        if size != info["bytes"]:
            problems.append(f"{p}: {size} bytes, manifest says {info['bytes']}")
        elif full and file_sha256(p) != info["sha256"]:
            problems.append(f"{p}: sha256 differs from the manifest")
    return problems


def dataset_content_hash(prefix: str | os.PathLike[str]) -> str:
    """The content hash of a ``.bin``/``.idx`` pair: from its manifest when the sizes agree,
    otherwise computed from the files (so hand-made Megatron datasets work too)."""
    prefix = Path(prefix)
    if dataset_manifest_path(prefix).is_file():
        manifest = read_dataset_manifest(prefix)
        if not check_dataset_files(prefix):
            return str(manifest["content_hash"])
    files = describe_files([data_file_path(prefix), index_file_path(prefix)], root=prefix.parent)
    return _content_hash(files)
