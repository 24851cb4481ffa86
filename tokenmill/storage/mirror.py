"""A local mirror of an ``s3://`` storage root's records, for the commands that read a whole root
(``tokenmill find``, ``tokenmill takedown``) and write versions back to it.

:func:`local_root` yields a local folder with the root's layout: the root itself when it is
local; for ``s3://`` a temporary folder holding every object of the root except what no record
reader needs (token ``.bin`` files, the HF export, quarantine files, temps: a blend and an index
never read a ``.bin``), downloaded through ``tokenmill.storage.store.S3Store``. The local code
then runs unchanged on the mirror. With ``write=True`` the files it added or changed are uploaded
when the block succeeds, in the commit order of ``tokenmill.storage.publish`` (data, markers,
merged pointers, blend pointers last), so a cut upload never leaves a marker or pointer naming a
file that is not there. Each pointer is a compare-and-swap against the ETag it was mirrored at
(listed; ``tokenmill.storage.staging.put_pointer``): when another writer moved it meanwhile,
ConflictError names it and the versions, and it keeps the other writer's version (the immutable
files already uploaded stay for ``tokenmill gc``).
The mirror is removed at the end, whatever happens.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tokenmill.atomic import is_temp, write_bytes
from tokenmill.paths import relative_path_problem
from tokenmill.storage import layout
from tokenmill.storage.publish import is_pointer, publish
from tokenmill.storage.staging import ReadPointer, put_pointer
from tokenmill.storage.store import S3Store
from tokenmill.storage.versions import version_named

__all__ = ["SKIPPED_SUFFIXES", "RootMirror", "local_root", "mirrored", "root_of_blend"]

# What no provenance or takedown step reads: token data, the HF export, quarantined lines.
SKIPPED_SUFFIXES = (".bin", ".quarantine.jsonl", ".lock")
SKIPPED_TOPS = ("hf",)


def mirrored(key: str) -> bool:
    """True for a key of the root that the mirror copies (see the module docstring)."""
    return not (
        is_temp(key)
        or key.endswith(SKIPPED_SUFFIXES)
        or key.split("/", 1)[0] in SKIPPED_TOPS
        or relative_path_problem(key) is not None
    )


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class RootMirror:
    """The records of an S3 root copied under ``local`` (sha256 of each, to tell what changed)."""

    def __init__(self, store: S3Store, local: Path) -> None:
        self.store = store
        self.local = local
        self.fetched: dict[str, str] = {}
        self.pointers: dict[str, ReadPointer] = {}  # pointer key -> as mirrored (ETag, version)

    def fetch(self) -> None:
        """Download every mirrored object (one listing of the root)."""
        for item in self.store.files(""):
            if not mirrored(item.key):
                continue
            data = self.store.read(item.key)
            if data is None:  # removed since the listing (gc): not part of the root now
                continue
            write_bytes(self.local / item.key, data)
            self.fetched[item.key] = _digest(data)
            if is_pointer(item.key):  # the listed ETag: a move since then fails the swap
                self.pointers[item.key] = ReadPointer(item.etag, version_named(data))

    def written(self) -> list[str]:
        """Keys of the files added or changed under the mirror since :meth:`fetch`."""
        out = []
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            key = path.relative_to(self.local).as_posix()
            if mirrored(key) and self.fetched.get(key) != _digest(path.read_bytes()):
                out.append(key)
        return out

    def push(self) -> list[str]:
        """Upload what changed in commit order; pointers checked against what was mirrored
        (ConflictError when one moved meanwhile). Returns the keys uploaded, in order."""

        store = self.store

        def put(key: str) -> str:
            path = self.local / key
            if is_pointer(key):
                read = self.pointers.get(key, ReadPointer(None, None))
                put_pointer(store.client, path, store.bucket, store.key(key), read)
            else:
                store.write(key, path.read_bytes())
            return key

        return publish(self.written(), put)


@contextmanager
def local_root(
    root: str | os.PathLike[str], *, endpoint_url: str | None = None, write: bool = False
) -> Iterator[Path]:
    """The storage ``root`` as a local folder: itself when local; for ``s3://`` a mirror of its
    records (module docstring), uploaded back on success when ``write`` and always removed."""
    uri = os.fspath(root)
    if not uri.startswith("s3://"):
        yield Path(uri)
        return
    local = Path(tempfile.mkdtemp(prefix="tokenmill-mirror-"))
    try:
        mirror = RootMirror(S3Store(uri, endpoint_url), local)
        mirror.fetch()
        yield local
        if write:
            mirror.push()
    finally:
        shutil.rmtree(local, ignore_errors=True)


def root_of_blend(uri: str) -> str | None:
    """The storage root of an ``s3://…/blends/<name>[/manifest.json]`` URI (None otherwise)."""
    if not uri.startswith("s3://"):
        return None
    parts = uri.rstrip("/").split("/")
    if parts[-1] == layout.BLEND_MANIFEST:
        parts = parts[:-1]
    if len(parts) < 5 or parts[-2] != layout.BLENDS:
        return None
    return "/".join(parts[:-2])
