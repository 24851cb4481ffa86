"""S3 for the pipeline: listing, transfers with retries, and a local stage for an ``s3://`` root.

The client comes from the library's one factory, ``tokenmill.storage.s3.make_client``, as for
``tokenmill pull`` and ``gc`` (endpoint from the recipe's ``storage.s3_endpoint_url`` or
``$AWS_ENDPOINT_URL``; credentials only from the environment, so they never pass through config,
logs or metadata; timeouts from ``$TOKENMILL_S3_CONNECT_TIMEOUT`` / ``$TOKENMILL_S3_READ_TIMEOUT``;
a stalled request says "waiting for S3"). Transient errors (5xx, throttling, dropped
connections) are retried by botocore's standard retry mode (``tokenmill.storage.s3.MAX_ATTEMPTS``),
and by s3transfer for a download cut mid-stream; what still fails raises ``InputError`` naming the
``s3://`` URI (``tokenmill.storage.s3.call``), which fails the run.

:class:`S3Stage` mirrors parts of an S3 root in a local directory: ``fetch`` downloads the
inputs a step reads, ``push`` uploads what the step wrote in the commit order of
:mod:`tokenmill.storage.publish` (data first, then dataset manifests, index-cache descriptions and
stats, then ``current.json`` pointers, a blend's ``manifest.json`` last; a marker that really
replaces an existing object is deleted before its data is overwritten, a pointer is simply
overwritten: a PUT is atomic) and deletes the fetched files the step removed, so a failed or
killed transfer never leaves a marker that describes files which are not there.

A pointer the step fetched is written back by a conditional PUT (compare-and-swap, as
``tokenmill.storage.versions.swap_pointer`` locally): ``If-Match`` the ETag it had when fetched,
or ``If-None-Match: *`` when it was not there. When another writer moved it meanwhile, S3
answers 412 and the push raises ConflictError naming the pointer and the versions (the
step's immutable files are uploaded; the pointer stays at the other writer's version). A
pointer the step never fetched is written unconditionally (the sole writer of a tree).

:class:`RunCache` is a run's download cache on this host: steps of one run (in one process or
several) that read the same object download it once. An entry is named by the object's bucket,
key, ETag and size (a changed object is a new entry), written read-only with a fixed mtime
(a copy changed in place no longer matches and is downloaded again), and reaches a step's work
directory as a hard link (a copy across file systems). Steps replace files by rename, which
never touches the entry; the link is read-only, and an entry written in place anyway (as root)
is detected by its mtime and downloaded again by the next step that wants it. What a step
uploads is kept too (one HEAD names its ETag), so later steps of the run read it without a
download.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.atomic import commit, create_temp, is_temp, temp_path_for
from tokenmill.errors import ConflictError, InputError
from tokenmill.paths import relative_path_problem
from tokenmill.storage.publish import delete_first, is_pointer, publish
from tokenmill.storage.s3 import (
    CONNECT_TIMEOUT_ENV,
    MAX_ATTEMPTS,
    READ_TIMEOUT_ENV,
    call,
    make_client,
    read_object,
)
from tokenmill.storage.versions import pointer_version, version_named

# S3's answers to a conditional PUT whose condition failed: the object changed (412), another
# conditional write to it is in flight (409), or an If-Match object is gone.
CONFLICT_CODES = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey")

MULTIPART_BYTES = 64 << 20  # larger files go up (and down) in parts of this size


# Settings a client is built from besides the endpoint; a change means a new client.
CLIENT_ENVIRONMENT = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    CONNECT_TIMEOUT_ENV,
    READ_TIMEOUT_ENV,
)
_CLIENTS: dict[str, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def s3_client(endpoint_url: str | None) -> Any:
    """The pipeline's boto3 S3 client: ``tokenmill.storage.s3.make_client`` (retries, timeouts,
    "waiting" line; credentials from the environment).

    Building one costs ~0.1-0.5 s (botocore loads its service models), so a process keeps one
    per endpoint and environment (keyed by a hash: no credential is kept in the key); boto3
    clients are thread-safe."""
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
    settings = [str(os.getpid()), str(endpoint), str(MAX_ATTEMPTS)]
    settings += [os.environ.get(name, "") for name in CLIENT_ENVIRONMENT]
    key = hashlib.sha256("\0".join(settings).encode()).hexdigest()
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = make_client(endpoint)
        return _CLIENTS[key]


@dataclass(frozen=True)
class S3Object:
    """One listed object: key, size and ETag (quotes removed)."""

    key: str
    size: int
    etag: str


def list_objects(client: Any, bucket: str, prefix: str, *, recursive: bool) -> list[S3Object]:
    """Objects under ``prefix`` (a folder when it ends with ``/``), sorted by key; with
    ``recursive=False`` only the folder's direct children."""

    def run() -> list[S3Object]:
        args = {"Bucket": bucket, "Prefix": prefix, **({} if recursive else {"Delimiter": "/"})}
        found = []
        for page in client.get_paginator("list_objects_v2").paginate(**args):
            for obj in page.get("Contents", []):
                found.append(S3Object(obj["Key"], int(obj["Size"]), obj["ETag"].strip('"')))
        return sorted(found, key=lambda o: o.key)

    return call(f"listing s3://{bucket}/{prefix}", run)


def _transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)


def download(client: Any, bucket: str, key: str, path: Path) -> None:
    """``s3://bucket/key`` → ``path`` through a temp (a failed transfer leaves nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, _ = create_temp(path, Path.touch)  # boto3 replaces the reserved name

    def run() -> None:
        try:
            client.download_file(bucket, key, str(tmp), Config=_transfer_config())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    call(f"downloading s3://{bucket}/{key}", run)
    commit(tmp, path)


def upload(client: Any, path: Path, bucket: str, key: str) -> None:
    """``path`` → ``s3://bucket/key``, multipart above ``MULTIPART_BYTES``."""
    call(
        f"uploading {path.name} to s3://{bucket}/{key}",
        lambda: client.upload_file(str(path), bucket, key, Config=_transfer_config()),
    )


@dataclass(frozen=True)
class ReadPointer:
    """A pointer as a step fetched it: its ETag (None: it was not there) and version."""

    etag: str | None
    version: str | None


def put_pointer(client: Any, path: Path, bucket: str, key: str, read: ReadPointer) -> str | None:
    """Compare-and-swap ``path`` (a pointer file) to ``s3://bucket/key``: one PUT, ``If-Match``
    the ETag ``read`` names (``If-None-Match: *`` when there was none). Returns the new ETag
    (None when the object already named this version). ConflictError when the object moved
    to another version meanwhile; finding this version there (e.g. our own PUT, retried after
    a lost answer, now answered 412) is success."""
    from botocore.exceptions import ClientError

    uri = f"s3://{bucket}/{key}"
    data = path.read_bytes()
    condition = {"IfNoneMatch": "*"} if read.etag is None else {"IfMatch": f'"{read.etag}"'}

    def run() -> str | None:
        try:
            response = client.put_object(Bucket=bucket, Key=key, Body=data, **condition)
            return str(response["ETag"]).strip('"')
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in CONFLICT_CODES:
                raise
        version = pointer_version(path)
        found = read_object(client, bucket, key)
        found_version = None if found is None else version_named(found)
        if found is not None and found_version == version:
            return None
        raise ConflictError(uri, read.version, found_version, str(version))

    return call(f"uploading pointer {path.name} to {uri}", run)


def delete(client: Any, bucket: str, key: str) -> None:
    """Remove ``s3://bucket/key`` (absent is fine)."""
    call(f"deleting s3://{bucket}/{key}", lambda: client.delete_object(Bucket=bucket, Key=key))


def local_name(bucket: str, key: str, base: str) -> str:
    """The part of a listed ``key`` below ``base``, to be joined under a local folder; InputError
    naming the object when that could land outside the folder (our own root never holds such a
    key, so it is corruption or tampering, not data)."""
    name = key[len(base) :]
    problem = relative_path_problem(name)
    if problem:
        uri, root = f"s3://{bucket}/{key}", f"s3://{bucket}/{base}"  # repr: no raw control chars
        raise InputError(f"{uri!r}: its key below {root!r} {problem}; refusing to copy it locally")
    return name


RUN_CACHE_PREFIX = "tokenmill-run-"
CACHE_MTIME_NS = 1_000_000_000 * 10**9  # every cache entry's mtime; any write changes it


@dataclass(frozen=True)
class RunCache:
    """Objects downloaded during one run (``root``: ``<work dir>/tokenmill-run-<run id>``)."""

    root: Path

    @classmethod
    def open(cls, base: Path, run_id: str, max_age_hours: float) -> RunCache:
        """The run's cache under ``base`` (made if needed); other runs' caches unused for
        ``max_age_hours`` are removed on the way (a run that died without cleaning up)."""
        safe = "".join(c for c in run_id if c.isalnum() or c in "-_") or "run"
        cache = cls(base / f"{RUN_CACHE_PREFIX}{safe}")
        cache.root.mkdir(parents=True, exist_ok=True)
        cache.touch()
        cutoff = time.time() - max_age_hours * 3600
        for other in base.glob(f"{RUN_CACHE_PREFIX}*"):
            try:
                stale = other != cache.root and other.stat().st_mtime < cutoff
            except FileNotFoundError:
                continue
            if stale:
                shutil.rmtree(other, ignore_errors=True)
        return cache

    def touch(self) -> None:
        """Mark the cache as in use now (its age counts from the last use)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.root)

    def remove(self) -> None:
        """Delete the whole cache (the run is over)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def entry(self, bucket: str, obj: S3Object) -> Path:
        """Where ``obj`` (at its current ETag and size) is kept."""
        name = hashlib.sha256(f"{bucket}\0{obj.key}\0{obj.etag}\0{obj.size}".encode())
        return self.root / "objects" / name.hexdigest()

    def holds(self, entry: Path, size: int) -> bool:
        """True when ``entry`` is complete and unmodified."""
        try:
            st = entry.stat()
        except FileNotFoundError:
            return False
        return st.st_size == size and st.st_mtime_ns == CACHE_MTIME_NS

    def keep(self, client: Any, bucket: str, key: str, path: Path) -> None:
        """Take ``path``, just uploaded to ``s3://bucket/key``, into the cache (a later step of
        the run reads it without a download): one HEAD names the object's ETag. Best effort:
        a failure here leaves the cache as it was."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = client.head_object(Bucket=bucket, Key=key)
            obj = S3Object(key, int(head["ContentLength"]), str(head["ETag"]).strip('"'))
            entry = self.entry(bucket, obj)
            if obj.size != path.stat().st_size or self.holds(entry, obj.size):
                return
            entry.parent.mkdir(parents=True, exist_ok=True)
            try:
                incoming, _ = create_temp(entry, functools.partial(os.link, path))
            except OSError:
                incoming, _ = create_temp(entry, functools.partial(shutil.copyfile, path))
            os.chmod(incoming, 0o444)
            os.utime(incoming, ns=(CACHE_MTIME_NS, CACHE_MTIME_NS))
            os.replace(incoming, entry)
        except (OSError, BotoCoreError, ClientError, KeyError, ValueError):
            return

    def fetch(self, client: Any, bucket: str, obj: S3Object, path: Path) -> bool:
        """``obj`` at ``path``: linked from the cache, downloaded into it first when it does not
        hold the object (then True). Falls back to a plain download when the cache cannot be
        used (e.g. removed meanwhile); an object that changed since it was listed is not kept."""
        entry = self.entry(bucket, obj)
        incoming: Path | None = None
        downloaded = False
        try:
            if not self.holds(entry, obj.size):
                entry.parent.mkdir(parents=True, exist_ok=True)
                downloaded = True
                incoming = temp_path_for(entry)  # download() creates it (through its own temp)
                download(client, bucket, obj.key, incoming)
                if incoming.stat().st_size != obj.size:  # rewritten after the listing
                    path.parent.mkdir(parents=True, exist_ok=True)
                    commit(incoming, path)
                    return True
                os.chmod(incoming, 0o444)
                os.utime(incoming, ns=(CACHE_MTIME_NS, CACHE_MTIME_NS))
                os.replace(incoming, entry)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            try:
                os.link(entry, path)
            except OSError:  # another file system, or no hard links there
                shutil.copyfile(entry, path)
        except OSError:
            if incoming is not None:
                incoming.unlink(missing_ok=True)
            download(client, bucket, obj.key, path)
            return True
        return downloaded


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return (st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass
class S3Stage:
    """A local directory standing in for ``s3://bucket/prefix`` during one step."""

    client: Any
    bucket: str
    prefix: str
    local: Path
    cache: RunCache | None = None
    fetched: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    pointers: dict[str, ReadPointer] = field(default_factory=dict)  # as fetched: CAS on push

    def key(self, rel: str) -> str:
        """The object key of a path relative to the root."""
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def uri(self, rel: str) -> str:
        """``s3://bucket/prefix/rel``."""
        return f"s3://{self.bucket}/{self.key(rel)}"

    def fetch(self, inputs: list[str]) -> None:
        """Download each input: ``dir/`` is a folder (recursively), ``path`` is a file and its
        ``path.*`` siblings (a dataset prefix gives its ``.bin``, ``.idx`` and manifest). A key
        that would land outside the stage is refused (``local_name``) before any download."""
        base = f"{self.prefix}/" if self.prefix else ""
        wanted: dict[str, S3Object] = {}
        listed: dict[str, S3Object] = {}
        for rel in inputs:
            folder = rel.endswith("/")
            for obj in list_objects(self.client, self.bucket, self.key(rel), recursive=True):
                name = obj.key[len(base) :]
                listed[name] = obj
                if not (folder or name == rel or name.startswith(rel + ".")):
                    continue
                if not is_temp(name) and name not in self.fetched:
                    wanted[local_name(self.bucket, obj.key, base)] = obj
        for name, obj in wanted.items():
            self.get(obj, name)
        for rel in inputs:
            if is_pointer(rel) and rel not in self.pointers:
                listed_obj = listed.get(rel)
                etag = None if listed_obj is None else listed_obj.etag
                self.pointers[rel] = ReadPointer(etag, pointer_version(self.local / rel))

    def listing(self, rel_prefix: str) -> dict[str, S3Object]:
        """``{path relative to the root: object}`` of every object whose path starts with
        ``rel_prefix`` (one LIST request), temp names left out."""
        base = f"{self.prefix}/" if self.prefix else ""
        found = list_objects(self.client, self.bucket, self.key(rel_prefix), recursive=True)
        return {o.key[len(base) :]: o for o in found if not is_temp(o.key[len(base) :])}

    def get(self, obj: S3Object, rel: str) -> None:
        """One listed object to ``rel`` in the stage (through the run cache), as fetched."""
        path = self.local / rel
        if self.cache is None:
            download(self.client, self.bucket, obj.key, path)
        else:
            self.cache.fetch(self.client, self.bucket, obj, path)
        self.fetched[rel] = _stamp(path)

    def _written(self) -> Iterator[str]:
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel = path.relative_to(self.local).as_posix()
            if is_temp(rel) or rel.endswith(".lock"):
                continue
            if self.fetched.get(rel) != _stamp(path):
                yield rel

    def exists(self, rel: str) -> bool:
        """True when ``rel`` is an object under the root now (one HEAD request)."""
        from botocore.exceptions import ClientError

        def head() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=self.key(rel))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise
            return True

        return call(f"looking up {self.uri(rel)}", head)

    def push(self) -> list[str]:
        """Upload new and changed files in commit order (``tokenmill.storage.publish``) and delete
        fetched files the step removed; the relative paths uploaded, in upload order."""
        written = list(self._written())
        for rel in sorted(written):
            if delete_first(rel) and (rel in self.fetched or self.exists(rel)):
                delete(self.client, self.bucket, self.key(rel))

        def put(rel: str) -> str:
            if rel in self.pointers:
                etag = put_pointer(
                    self.client, self.local / rel, self.bucket, self.key(rel), self.pointers[rel]
                )
                self.pointers[rel] = ReadPointer(etag, pointer_version(self.local / rel))
            else:
                upload(self.client, self.local / rel, self.bucket, self.key(rel))
            if self.cache is not None:
                self.cache.keep(self.client, self.bucket, self.key(rel), self.local / rel)
            return rel

        uploaded = publish(written, put)
        for rel in sorted(self.fetched):
            if not (self.local / rel).exists():
                delete(self.client, self.bucket, self.key(rel))
        return uploaded
