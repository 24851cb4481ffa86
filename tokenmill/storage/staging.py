"""Staging an ``s3://`` storage root: a step's local work directory filled from S3 and uploaded
back in commit order, through a run's download cache (``tokenmill.storage.run_cache``); the
takedown mirror (``tokenmill.storage.mirror``) is a stage of a whole root.

:class:`S3Stage` ``fetch``es the inputs a step reads, ``push``es what it wrote in the commit
order of :mod:`tokenmill.storage.publish` and deletes the fetched files it removed: a failed or
killed transfer never leaves a marker describing files that are not there. A pointer the step
fetched is written back by a conditional PUT (compare-and-swap, as
``tokenmill.storage.versions.swap_pointer`` locally): ``If-Match`` its fetched ETag, or
``If-None-Match: *``. When another writer moved it meanwhile, the push raises ConflictError (the
immutable files are uploaded; the pointer keeps the other version). A pointer never fetched is
written unconditionally (the sole writer of a tree), except after :meth:`S3Stage.mirror`, which
listed the whole root: one it did not find was not there.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.atomic import is_temp, write_bytes
from tokenmill.errors import ConflictError, InputError
from tokenmill.formats.dataset_manifest import read_dataset_manifest
from tokenmill.formats.nanoset_cache import segment_files
from tokenmill.formats.virtual_merge import is_virtual
from tokenmill.paths import relative_path_problem
from tokenmill.storage import layout
from tokenmill.storage.publish import delete_first, is_pointer, publish
from tokenmill.storage.run_cache import RunCache
from tokenmill.storage.s3 import (
    S3Object,
    delete,
    download,
    list_objects,
    read_object,
    s3_errors,
    shared_client,
    split_uri,
    upload,
)
from tokenmill.storage.versions import pointer_version, version_named

# S3's answers to a conditional PUT whose condition failed: the object changed (412), another
# conditional write to it is in flight (409), or an If-Match object is gone.
CONFLICT_CODES = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey")


@dataclass(frozen=True)
class ReadPointer:
    """A pointer as a step fetched it: its ETag (None: it was not there) and version."""

    etag: str | None
    version: str | None


def put_pointer(client: Any, path: Path, bucket: str, key: str, read: ReadPointer) -> str | None:
    """Compare-and-swap ``path`` (a pointer file) to ``s3://bucket/key``: one PUT, ``If-Match``
    the ETag ``read`` names (``If-None-Match: *`` when there was none); the new ETag, or None when
    the object already named this version (our own PUT, retried after a lost answer, gets 412).
    ConflictError when the object moved to another version meanwhile."""
    from botocore.exceptions import ClientError

    uri = f"s3://{bucket}/{key}"
    data = path.read_bytes()
    condition = {"IfNoneMatch": "*"} if read.etag is None else {"IfMatch": f'"{read.etag}"'}

    with s3_errors(f"uploading pointer {path.name} to {uri}"):
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


def local_name(bucket: str, key: str, base: str) -> str:
    """The part of a listed ``key`` below ``base``, to join under a local folder; InputError when
    it could land outside the folder (our root never holds such a key: tampering, not data)."""
    name = key[len(base) :]
    if problem := relative_path_problem(name):
        uri, root = f"s3://{bucket}/{key}", f"s3://{bucket}/{base}"  # repr: no raw control chars
        raise InputError(f"{uri!r}: its key below {root!r} {problem}; refusing to copy it locally")
    return name


def fetch_shard(
    client: Any, cache: RunCache | None, uri: str, fingerprint: str, path: Path
) -> None:
    """An S3 source shard (``uri``) to ``path``: through the run cache when its fingerprint
    (``<size>:<ETag>``, as the source listing records it) names the object."""
    bucket, key = split_uri(uri)
    size, _, etag = fingerprint.partition(":")
    if cache is not None and size.isdigit() and etag:
        cache.fetch(client, bucket, S3Object(key, int(size), etag), path)
    else:
        download(client, bucket, key, path)


def _same_content(stored: bytes, ours: bytes) -> bool:
    """Whether two dataset manifests vouch for the same bytes (equal ``files`` and
    ``content_hash``; a setting such as the engine may differ)."""
    try:
        old, new = json.loads(stored), json.loads(ours)
    except ValueError:  # not JSON (UnicodeDecodeError included): not a dataset manifest
        return False
    if not (isinstance(old, dict) and isinstance(new, dict)) or "content_hash" not in new:
        return False
    return all(old.get(key) == new[key] for key in ("content_hash", "files"))


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
    listed: set[str] | None = None  # every path of the root, when ``mirror`` listed it whole

    @classmethod
    def open(
        cls, root: str, endpoint_url: str | None, local: Path, cache: RunCache | None = None
    ) -> S3Stage:
        """The stage of ``s3://bucket/prefix`` in ``local``, through the shared client."""
        bucket, prefix = split_uri(root)
        return cls(shared_client(endpoint_url), bucket, prefix, local, cache)

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
        wanted: dict[str, S3Object] = {}
        listed: dict[str, S3Object] = {}
        for rel in inputs:
            folder = rel.endswith("/")
            for name, obj in self.listing(rel).items():
                listed[name] = obj
                if folder or name == rel or name.startswith(rel + "."):
                    wanted[local_name(self.bucket, obj.key, self.key(""))] = obj
        for name, obj in wanted.items():
            self.get(obj, name)
        for rel in inputs:
            if is_pointer(rel) and rel not in self.pointers:
                self._read_pointer(rel, listed.get(rel))

    def _read_pointer(self, rel: str, listed: S3Object | None) -> None:
        """Remember a staged pointer's listed ETag (None: absent) for :meth:`push`'s CAS."""
        etag = None if listed is None else listed.etag
        self.pointers[rel] = ReadPointer(etag, pointer_version(self.local / rel))

    def mirror(self, wanted: Callable[[str], bool]) -> None:
        """Stage every object of the root whose relative path ``wanted`` accepts (one LIST, one
        GET each, no run cache; one removed since the listing is left out). A pointer the root
        did not hold is then pushed only if it still does not (``If-None-Match: *``)."""
        found = self.listing("")
        self.listed = set(found)
        for rel, obj in found.items():
            if not wanted(rel):
                continue
            data = read_object(self.client, self.bucket, obj.key)
            if data is None:
                continue
            write_bytes(self.local / rel, data)
            self.fetched[rel] = _stamp(self.local / rel)
            if is_pointer(rel):
                self._read_pointer(rel, obj)

    def listing(self, rel_prefix: str) -> dict[str, S3Object]:
        """``{path relative to the root: object}`` of every object whose path starts with
        ``rel_prefix`` (one LIST request), temp names left out."""
        base = self.key("")
        found = list_objects(self.client, self.bucket, self.key(rel_prefix), recursive=True)
        return {o.key[len(base) :]: o for o in found if not is_temp(o.key[len(base) :])}

    def get(self, obj: S3Object, rel: str) -> None:
        """One listed object to ``rel`` in the stage (through the run cache), unless staged."""
        if rel in self.fetched:
            return
        path = self.local / rel
        if self.cache is None:
            download(self.client, self.bucket, obj.key, path)
        else:
            self.cache.fetch(self.client, self.bucket, obj, path)
        self.fetched[rel] = _stamp(path)

    def rel(self, path: str | Path) -> str:
        """A path in the stage, relative to it (posix)."""
        return Path(path).resolve().relative_to(self.local.resolve()).as_posix()

    def fetch_entry(self, rels: Mapping[str, str]) -> bool:
        """Stage an index-cache entry's files (``{name: root-relative path}``, one ``description``,
        fetched last) when all are stored; True if it did (one LIST, a GET per file not staged)."""
        found = self.listing(rels["description"].removesuffix("description.json"))
        if not all(rel in found for rel in rels.values()):
            return False
        for _, rel in sorted(rels.items(), key=lambda item: item[0] == "description"):
            self.get(found[rel], rel)
        description = json.loads((self.local / rels["description"]).read_bytes())
        segments = segment_files(description if isinstance(description, dict) else {})
        if segments:  # a growing entry that extends: its earlier entries' files too
            folder = posixpath.dirname(rels["description"])
            self.fetch([posixpath.join(folder, name) for name in segments])
        return True

    def stored_entry(
        self, rels: Mapping[str, str], key: dict[str, Any], digest: str
    ) -> dict[str, Any] | None:
        """The description of a stored index-cache entry (``rels`` as for ``fetch_entry``) that
        describes exactly ``key`` and ``digest``, every array there at its recorded size; else
        None. One LIST and one small GET: the arrays are neither downloaded nor uploaded again."""
        found = self.listing(rels["description"].removesuffix("description.json"))
        if rels["description"] not in found:
            return None
        self.get(found[rels["description"]], rels["description"])
        try:
            description = json.loads((self.local / rels["description"]).read_bytes())
            if description["key"] != key or description["hash"] != digest:
                return None
            for name, rel in rels.items():
                if name == "description":
                    continue
                record = description["files"][name]
                if record["file"] != posixpath.basename(rel) or found.get(rel) is None:
                    return None
                if found[rel].size != record["bytes"]:
                    return None
        except (ValueError, KeyError, TypeError):  # not JSON, or not a description
            return None
        return dict(description)

    def fetch_index(self, rel: str) -> None:
        """Stage what reading the sequence lengths of the dataset at ``rel`` needs: its manifest
        and ``.idx`` or, for a virtual merge, every shard pair's ``.idx`` (never a ``.bin``)."""
        self.fetch([f"{rel}.idx", layout.dataset_manifest(rel)])
        manifest_file = self.local / layout.dataset_manifest(rel)
        if manifest_file.is_file() and not (self.local / f"{rel}.idx").is_file():
            manifest = read_dataset_manifest(self.local / rel)
            if is_virtual(manifest):
                folder = posixpath.dirname(rel)
                idx = [posixpath.join(folder, f"{s['prefix']}.idx") for s in manifest["shards"]]
                self.fetch([posixpath.normpath(p) for p in idx])

    def _written(self) -> Iterator[str]:
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel = path.relative_to(self.local).as_posix()
            if is_temp(rel) or rel.endswith(".lock"):
                continue
            if self.fetched.get(rel) != _stamp(path):
                yield rel

    def push(self) -> list[str]:
        """Upload new and changed files in commit order and delete fetched files the step removed;
        the paths uploaded, in order. A marker the step did not fetch is compared with the stored
        one (one GET): the same bytes are not uploaded again, and one vouching for the same
        content is not deleted first, so a second run of one shard never takes it away."""
        written, replaced = [], set()
        for rel in self._written():
            if delete_first(rel) and rel not in self.fetched:
                stored = read_object(self.client, self.bucket, self.key(rel))
                ours = (self.local / rel).read_bytes()
                if stored == ours:
                    continue
                if stored is not None and not _same_content(stored, ours):
                    replaced.add(rel)
            elif delete_first(rel):
                replaced.add(rel)
            written.append(rel)
        for rel in sorted(replaced):
            delete(self.client, self.bucket, self.key(rel))

        def put(rel: str) -> str:
            if self.listed is not None and is_pointer(rel) and rel not in self.listed:
                self.pointers.setdefault(rel, ReadPointer(None, None))  # absent when listed
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
