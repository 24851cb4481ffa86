"""A storage root seen as keys: list, read, write and delete files, locally or under ``s3://``.

Used by ``tokenmill gc``, ``tokenmill pull`` (whose source is a store rooted at ``/`` or at a
bucket) and the pipeline's pruning step alike. Listing reads names and sizes only, never content.
Keys are posix paths relative to the root (``tokenmill.storage.layout``).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.atomic import read_if_exists, remove_empty_dir, write_bytes
from tokenmill.errors import ConfigError, InputError
from tokenmill.storage.s3 import (
    exists,
    is_cut_body,
    is_missing,
    list_objects,
    read_object,
    s3_errors,
    shared_client,
    split_uri,
)

__all__ = ["CHUNK", "LocalStore", "S3Store", "Store", "StoredFile", "open_store", "ranged"]

CHUNK = 1 << 22  # bytes per piece of a ranged read


def ranged(fh: Any, size: int) -> Iterator[bytes]:
    """Up to ``size`` bytes of a file object from where it stands, in chunks."""
    while size > 0:
        chunk = fh.read(min(CHUNK, size))
        if not chunk:
            return
        size -= len(chunk)
        yield chunk


@dataclass(frozen=True)
class StoredFile:
    """One file of a storage root, as a listing reports it."""

    key: str  # relative to the storage root, posix
    size: int
    mtime: float  # local mtime, S3 LastModified
    etag: str | None = None  # S3 only: what a pointer's compare-and-swap is conditioned on


class LocalStore:
    """A storage root on the local filesystem."""

    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise ConfigError(f"{root}: not a directory")
        self.root = root

    def files(self, top: str) -> Iterator[StoredFile]:
        """Every file under the folder ``top`` (recursively); a missing folder has none."""
        for dirpath, _dirs, names in os.walk(self.root / top):  # a missing top: no error, nothing
            for name in names:
                path = Path(dirpath) / name
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                yield StoredFile(path.relative_to(self.root).as_posix(), st.st_size, st.st_mtime)

    def where(self, key: str) -> str:
        """The path of ``key``, for messages."""
        return str(self.root / key)

    def exists(self, key: str) -> bool:
        """True when ``key`` is a file now."""
        return (self.root / key).is_file()

    def read(self, key: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        return read_if_exists(self.root / key)

    @contextlib.contextmanager
    def chunks(self, key: str, lo: int, hi: int) -> Iterator[Iterator[bytes]]:
        """Bytes ``lo..hi`` of the file, in pieces."""
        with open(self.root / key, "rb") as fh:
            fh.seek(lo)
            yield ranged(fh, hi - lo)

    def missing(self, exc: BaseException) -> bool:
        """True when ``exc`` says the file is not there."""
        return isinstance(exc, FileNotFoundError)

    def cut(self, exc: BaseException) -> bool:
        """True when ``exc`` is a read cut mid-way that another try may complete (never here)."""
        return False

    def write(self, key: str, data: bytes) -> None:
        """Write (replace) the file atomically, creating its folder."""
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, data)

    def delete(self, keys: Sequence[str]) -> None:
        """Remove the files (absent ones are fine), then the folders that became empty."""
        for key in keys:
            (self.root / key).unlink(missing_ok=True)
        for folder in sorted({posixpath.dirname(k) for k in keys}, key=len, reverse=True):
            path = self.root / folder
            while path != self.root and remove_empty_dir(path):  # an empty .tmp/ goes too
                path = path.parent


class S3Store:
    """A storage root under ``s3://bucket/prefix``, through the process's client for
    ``endpoint_url`` and botocore ``config`` (``tokenmill.storage.s3.shared_client``)."""

    def __init__(self, uri: str, endpoint_url: str | None, **config: Any) -> None:
        self.bucket, self.prefix = split_uri(uri)
        self.uri = uri
        self.client = shared_client(endpoint_url, **config)

    def key(self, key: str) -> str:
        """The S3 key of ``key`` (a path relative to the storage root)."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def files(self, top: str) -> Iterator[StoredFile]:
        """Every object under ``top/`` (``""``: the whole root), by one paginated listing."""
        start = self.key(top) + "/" if top else (f"{self.prefix}/" if self.prefix else "")
        cut = len(self.prefix) + 1 if self.prefix else 0
        for obj in list_objects(self.client, self.bucket, start, recursive=True):
            yield StoredFile(obj.key[cut:], obj.size, obj.mtime, obj.etag)

    def where(self, key: str) -> str:
        """``s3://bucket/prefix/key``."""
        return f"s3://{self.bucket}/{self.key(key)}"

    def exists(self, key: str) -> bool:
        """True when ``key`` is an object now (one HEAD request)."""
        return exists(self.client, self.bucket, self.key(key))

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        return read_object(self.client, self.bucket, self.key(key))

    @contextlib.contextmanager
    def chunks(self, key: str, lo: int, hi: int) -> Iterator[Iterator[bytes]]:
        """Bytes ``lo..hi`` of the object, in pieces (one range GET; S3 errors as they come, for
        the caller to tell with :meth:`missing` and :meth:`cut`)."""
        span = f"bytes={lo}-{hi - 1}"
        body = self.client.get_object(Bucket=self.bucket, Key=self.key(key), Range=span)["Body"]
        try:
            yield body.iter_chunks(CHUNK)
        finally:
            body.close()

    missing = staticmethod(is_missing)  # S3's "no such object" answer
    cut = staticmethod(is_cut_body)  # a body stopped mid-read: another GET may complete it

    def write(self, key: str, data: bytes) -> None:
        """Upload (replace) the object."""
        with s3_errors(f"writing {self.where(key)}"):
            self.client.put_object(Bucket=self.bucket, Key=self.key(key), Body=data)

    def delete(self, keys: Sequence[str]) -> None:
        """Remove the objects, 1,000 per request (absent ones are fine)."""
        keys = list(keys)
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self.key(k)} for k in keys[start : start + 1000]]
            with s3_errors(f"deleting from s3://{self.bucket}"):
                answer = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            if answer.get("Errors"):  # per-key refusals (e.g. AccessDenied): no retry helps
                raise InputError(f"s3://{self.bucket}: could not delete {answer['Errors'][:3]}")


Store = LocalStore | S3Store


def open_store(root: str | os.PathLike[str], endpoint_url: str | None = None) -> Store:
    """The store of a storage root: ``s3://bucket/prefix`` or a local folder."""
    uri = os.fspath(root)
    return S3Store(uri, endpoint_url) if uri.startswith("s3://") else LocalStore(Path(uri))
