"""Opening an ``s3://`` blend in few requests: its small files (manifests, index descriptions
and arrays) are fetched in parallel, checked by sha256, to ``<cache_dir>/files/<bucket>/<key>``
(the ``.bin`` and ``.idx`` are read by blocks: ``_s3_data``).

A version is immutable, so an *open record* (``opened/<h>.json``) lists its mirrored files with
the inode, size and mtime each had when checked: reopening that version costs no request (and
no boto3 import) while they all match; the pointer costs one GET. A file written since voids
the record: the version is mirrored again, each file re-checked (those intact are kept).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokenmill.atomic import load_json, write_bytes, write_json
from tokenmill.errors import FormatError, InputError
from tokenmill.formats.blend_manifest import MANIFEST_NAME, VERSIONS_DIR

CACHE_ENV = "TOKENMILL_CACHE_DIR"
MIRROR_THREADS = 8  # small files fetched at once
RECORD_FORMAT = 2  # an open record of another format is ignored: the version is mirrored again
BLOCKED = (".bin", ".idx")  # read by blocks, not mirrored


def default_cache_dir() -> Path:
    """``$TOKENMILL_CACHE_DIR``, else ``~/.cache/tokenmill/s3``."""
    found = os.environ.get(CACHE_ENV)
    return Path(found) if found else Path.home() / ".cache" / "tokenmill" / "s3"


def _blend_folder(uri: str) -> tuple[str, str, str]:
    """(bucket, key of the manifest named, key of the blend's folder) of a blend URI (the
    folder holds the pointer and ``versions/``)."""
    from tokenmill.storage.s3 import split_uri

    bucket, key = split_uri(uri)
    if not key.endswith(".json"):
        key = posixpath.join(key, MANIFEST_NAME) if key else MANIFEST_NAME
    folder = posixpath.dirname(key)
    if posixpath.basename(posixpath.dirname(folder)) == VERSIONS_DIR:
        folder = posixpath.dirname(posixpath.dirname(folder))
    return bucket, key, folder


def _record_path(root: Path, bucket: str, folder: str, version: str) -> Path:
    """Where the open record of one version of one blend lives."""
    name = hashlib.sha256(f"{bucket}\0{folder}\0{version[:16]}".encode()).hexdigest()[:32]
    return root / "opened" / f"{name}.json"


def _stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _recorded(path: Path, root: Path) -> Path | None:
    """The local manifest of a recorded open, when the record exists and every file it lists
    is unchanged since it was checked; None otherwise."""
    try:
        record = load_json(path.read_bytes(), path, "open record")
        if record.get("format") != RECORD_FORMAT:
            return None
        for rel, stamp in record["files"].items():
            if _stamp(root / rel) != stamp:
                return None
        return root / str(record["manifest"])
    except (OSError, FormatError, KeyError, TypeError, ValueError, AttributeError):
        return None  # no usable record: the version is mirrored (and checked) again


def _pointer_version(bucket: str, key: str, client: Any) -> str | None:
    """The version the pointer at ``key`` names now (one GET), None if it records none."""
    from tokenmill.storage.s3 import read_object

    raw = read_object(client, bucket, key)
    if raw is None:
        return None  # plan_blend says so, naming the URI
    found = load_json(raw, f"s3://{bucket}/{key}", "manifest")
    version = found.get("version") if isinstance(found, dict) else None
    return str(version) if isinstance(version, str) and len(version) >= 16 else None


def mirror_blend(uri: str, version: str | None, root: Path, client: Any) -> Path:
    """Mirror one version of a blend's small files into ``<root>/files/<bucket>/...``
    (``version=None``: the one the pointer names now); returns the local blend manifest.
    ``client()`` gives the boto3 client (not made when the version is named and recorded)."""
    bucket, key, folder = _blend_folder(uri)
    named = version
    if named is None and posixpath.dirname(key) == folder:  # the pointer, not a version's
        named = _pointer_version(bucket, key, client())
    if named is not None:
        found = _recorded(_record_path(root, bucket, folder, named), root)
        if found is not None:
            return found
    if version is None and named is not None:  # by its own manifest: no second pointer GET
        with contextlib.suppress(InputError):  # a layout without versions/: through the pointer
            return _mirror(uri, named, root, bucket, folder)
    return _mirror(uri, version, root, bucket, folder)


def _mirror(uri: str, version: str | None, root: Path, bucket: str, folder: str) -> Path:
    """Fetch what one version needs (parallel GETs; files already mirrored and intact are
    kept), then write its open record."""
    from tokenmill.storage.pull import plan_blend, sync_file

    source, raw, plan = plan_blend(uri, version=version, jobs=MIRROR_THREADS)
    mirror = root / "files" / bucket
    if plan.wanted:
        want = plan.wanted[0]
        mirror = mirror / want.key[: len(want.key) - len(want.rel)]
    small = [w for w in plan.wanted if not w.rel.endswith(BLOCKED)]
    with ThreadPoolExecutor(MIRROR_THREADS, thread_name_prefix="tokenmill-mirror") as pool:
        list(pool.map(lambda w: sync_file(source, w, mirror), small))
    written = [mirror / w.rel for w in small]
    for rel, data in [*plan.dataset_manifests.items(), (plan.manifest_rel, raw)]:
        path = mirror / rel
        if not (path.is_file() and path.read_bytes() == data):
            write_bytes(path, data)
        written.append(path)
    mpath = mirror / plan.manifest_rel
    found = load_json(raw, uri, "manifest").get("version")
    if isinstance(found, str) and len(found) >= 16:
        write_json(
            _record_path(root, bucket, folder, found),
            {
                "format": RECORD_FORMAT,
                "manifest": str(mpath.relative_to(root)),
                "files": {str(p.relative_to(root)): _stamp(p) for p in written},
            },
        )
    return mpath
