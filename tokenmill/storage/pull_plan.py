"""Owns the plan of a pull: which files a blend manifest needs, where they are in the source and
what each must hash to (``tokenmill pull`` and the loader's S3 reader share it).

Every file the blend manifest lists (path relative to its folder, bytes, sha256) comes, and the
datasets' sidecar manifests (``manifests/<name>.manifest.json``): each is checked against the
blend's record and gives its files' per-block sha256 lists; a ``.bin`` recorded by parts (a
merge) is verified part by part. Paths are laid out relative to the deepest folder holding all of
them (the storage root for a pipeline blend). A pointer's version manifest comes along, so
``open_blend(..., version=...)`` works on the copy. The source is a store: the file system rooted
at ``/``, or an ``s3://`` bucket.
"""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.atomic import load_json
from tokenmill.errors import ConfigError, FormatError, InputError
from tokenmill.formats.blend_manifest import MANIFEST_NAME, VERSIONS_DIR
from tokenmill.formats.dataset_manifest import parts_sha256
from tokenmill.formats.virtual_merge import block_list_digest, check_manifest, is_virtual
from tokenmill.paths import has_control_character, leading_parents
from tokenmill.storage.layout import dataset_manifest, version_dir_name
from tokenmill.storage.pull_blocks import Wanted
from tokenmill.storage.s3 import split_uri
from tokenmill.storage.store import LocalStore, S3Store, Store

__all__ = ["Plan", "open_source", "plan_blend"]

MALFORMED = (KeyError, TypeError, ValueError, AttributeError)  # what a malformed manifest raises


def open_source(uri: str, endpoint_url: str | None, jobs: int) -> tuple[Store, str]:
    """The source (the bucket, or the file system from ``/``) and the manifest's key in it; a
    folder (or S3 prefix) means its manifest.json."""
    if uri.startswith("s3://"):
        bucket, key = split_uri(uri)
        if not key.endswith(".json"):
            key = posixpath.join(key, MANIFEST_NAME)  # "": the bucket's top
        return S3Store(f"s3://{bucket}", endpoint_url, max_pool_connections=jobs + 2), key
    if "://" in uri:
        raise ConfigError(f"manifest URI {uri}: only local paths and s3:// URIs are supported")
    path = Path(uri).expanduser().resolve()
    if path.is_dir():
        path = path / MANIFEST_NAME
    return LocalStore(Path("/")), path.as_posix().lstrip("/")


def _source_key(manifest_dir: str, relative: object, uri: str) -> str:
    """A manifest path as a source key; FormatError for anything that could escape the root."""
    if (
        not isinstance(relative, str)
        or not relative
        or relative.startswith("/")
        or "\\" in relative
        or "\0" in relative
    ):
        raise FormatError(uri, "path", f"{relative!r} is not a relative path; refusing to pull")
    if has_control_character(relative):
        raise FormatError(uri, "path", f"{relative!r} has a control character; refusing to pull")
    leading = leading_parents(relative)
    if leading is None:
        raise FormatError(uri, "path", f"{relative!r}: '..' after a folder name; refusing to pull")
    if leading > (len(manifest_dir.split("/")) if manifest_dir else 0):
        raise FormatError(uri, "path", f"{relative!r} points outside the source root")
    return posixpath.normpath(posixpath.join(manifest_dir, relative))


def _blend_files(manifest: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(description, FILE entry)`` for every file the blend manifest lists."""
    for ds in manifest["datasets"]:
        for kind, entry in ds["files"].items():
            yield f"dataset {ds['name']!r} {kind}", entry
    for split, info in manifest["splits"].items():
        for array, entry in info["files"].items():
            yield f"split {split!r} {array}", entry
        for ds in info["datasets"]:
            for kind, entry in ds["index"]["files"].items():
                yield f"split {split!r} dataset {ds['name']!r} index {kind}", entry


@dataclass(frozen=True)
class Plan:
    """Destination-relative paths of everything a pull writes."""

    wanted: list[Wanted]  # the blend's files, deduplicated
    manifest_rel: str  # the blend manifest
    dataset_manifests: dict[str, bytes]  # the datasets' manifests (sidecar keys, source bytes)
    version_manifest: tuple[str, bytes] | None = None  # a pointer's versions/<v>/manifest.json


def _plan(
    manifest: dict[str, Any], manifest_key: str, source: Store, uri: str, *, shards: bool
) -> Plan:
    """What to pull, laid out relative to the deepest folder holding all of it (``shards``:
    with the dataset manifests of a virtual merge's shards, for their block lists)."""
    mdir = posixpath.dirname(manifest_key)
    files: dict[str, Wanted] = {}
    try:
        for what, entry in _blend_files(manifest):
            key = _source_key(mdir, entry["path"], uri)
            want = _wanted(key, entry, what, uri)
            known = files.setdefault(key, want)
            if (known.size, known.sha256, known.parts) != (want.size, want.sha256, want.parts):
                raise FormatError(uri, "files", f"{entry['path']} recorded twice, differently")
        prefixes = [_source_key(mdir, ds["prefix"], uri) for ds in manifest["datasets"]]
    except MALFORMED as exc:
        raise FormatError(uri, "manifest", f"malformed ({exc!r})") from exc
    dataset_manifests = {}
    for prefix in prefixes:
        key = dataset_manifest(prefix)
        if (raw := source.read(key)) is not None:
            dataset_manifests[key] = raw
            _attach_parts(files, posixpath.dirname(prefix), raw, source.where(key))
            found = _attach_shards(files, prefix, raw, source.where(key))
            if shards and found:
                dataset_manifests.update(_shard_blocks(files, found, source))
    version = _version_manifest(manifest, manifest_key, source)
    folders = [mdir, *(posixpath.dirname(k) for k in (*files, *dataset_manifests))]
    base = posixpath.commonpath(folders)  # the deepest folder holding all ("": the root)
    cut = len(base) + 1 if base else 0
    wanted = [dataclasses.replace(w, rel=w.key[cut:]) for w in files.values()]
    small = {k[cut:]: raw for k, raw in dataset_manifests.items()}
    own = None if version is None else (version[0][cut:], version[1])
    return Plan(wanted, manifest_key[cut:], small, own)


def _version_manifest(
    manifest: dict[str, Any], manifest_key: str, source: Store
) -> tuple[str, bytes] | None:
    """For a pointer (``blends/<name>/manifest.json``), its version's own manifest (key and
    exact bytes), so that the copy opens with ``open_blend(..., version=...)`` too."""
    version = manifest.get("version")
    mdir = posixpath.dirname(manifest_key)
    if not isinstance(version, str) or _in_versions(mdir):
        return None
    key = _version_key(mdir, version)
    if (raw := source.read(key)) is None:
        return None
    if _parse_manifest(raw, source.where(key)).get("version") != version:
        raise FormatError(source.where(key), "version", f"is not version {version}; not pulled")
    return key, raw


def _in_versions(folder: str) -> bool:
    """True for a version's folder (``<blend>/versions/<v16>``), not a pointer's."""
    return posixpath.basename(posixpath.dirname(folder)) == VERSIONS_DIR


def _version_key(folder: str, version: str) -> str:
    """``<folder>/versions/<v16>/manifest.json``: a version's own manifest beside a pointer."""
    return posixpath.join(folder, VERSIONS_DIR, version_dir_name(version), MANIFEST_NAME)


def _parts(entry: dict[str, Any]) -> tuple[tuple[int, str], ...]:
    """The ``(bytes, sha256)`` parts a manifest records for a file (a merge's ``.bin``)."""
    return tuple((int(p["bytes"]), str(p["sha256"])) for p in entry.get("parts", ()))


def _wanted(key: str, entry: dict[str, Any], what: str, uri: str) -> Wanted:
    """A FILE entry as a Wanted: ``{bytes, sha256}`` or ``{bytes, parts, sha256_of_parts}``."""
    parts = _parts(entry)
    if "parts" in entry:
        tree = parts_sha256(entry["parts"])
        if tree != entry.get("sha256_of_parts") or sum(n for n, _ in parts) != entry["bytes"]:
            raise FormatError(uri, "files", f"{entry['path']}: parts do not add up; not pulled")
    elif not isinstance(entry["sha256"], str):
        raise FormatError(uri, "files", f"{entry['path']}: sha256 is not a string")
    return Wanted(key, key, int(entry["bytes"]), str(entry.get("sha256", "")), parts, what=what)


def _attach_parts(files: dict[str, Wanted], folder: str, raw: bytes, uri: str) -> None:
    """Check a dataset manifest against the blend's entries; take its ``.bin`` parts."""
    try:
        recorded = load_json(raw, uri, "manifest")["files"]
        for name, info in recorded.items():
            key = posixpath.join(folder, name)
            if key not in files:
                continue
            want = files[key]
            parts = _parts(info)
            sha256 = str(info.get("sha256", want.sha256))
            if (
                int(info["bytes"]) != want.size
                or (want.sha256 and sha256 != want.sha256)
                or (want.parts and parts != want.parts)
            ):
                raise FormatError(
                    uri,
                    f"files.{name}",
                    f"records {info['bytes']} bytes / sha256 {info.get('sha256')}, the blend "
                    f"manifest {want.size} / {want.sha256 or 'by parts'}: the dataset changed "
                    "after the blend",
                )
            files[key] = dataclasses.replace(
                want,
                sha256=want.sha256 or sha256,
                parts=want.parts or parts,
                **_block_list(info, want.size, uri, name),
            )
    except MALFORMED as exc:
        raise FormatError(uri, "files", f"malformed dataset manifest ({exc!r})") from exc


def _attach_shards(files: dict[str, Wanted], prefix: str, raw: bytes, uri: str) -> dict[str, str]:
    """For a virtual merge's manifest: check it against the blend's record and add every shard
    pair it names, by its digests. Returns ``{shard .bin/.idx key: block_list_sha256}`` of the
    files whose block list a version-2 merge records by reference (in the shard's manifest)."""
    key = dataset_manifest(prefix)
    if key not in files:
        return {}
    manifest = load_json(raw, uri, "manifest")
    if not isinstance(manifest, dict) or not is_virtual(manifest):
        return {}
    check_manifest(Path(uri), manifest)
    if hashlib.sha256(raw).hexdigest() != files[key].sha256:
        raise FormatError(uri, "sha256", "differs from the blend's record: the merge changed")
    del files[key]
    folder = posixpath.dirname(prefix)
    by_reference = {}
    for shard in manifest["shards"]:
        pair = _source_key(folder, shard["prefix"], uri)
        for kind in ("bin", "idx"):
            info = shard["files"][kind]
            want = Wanted(
                f"{pair}.{kind}",
                f"{pair}.{kind}",
                int(info["bytes"]),
                str(info["sha256"]),
                what=f"shard {shard['key']!r} {kind}",
                **_block_list(info, int(info["bytes"]), uri, f"{shard['prefix']}.{kind}"),
            )
            files.setdefault(want.key, want)
            if "block_list_sha256" in info:
                by_reference[want.key] = str(info["block_list_sha256"])
    return by_reference


def _shard_blocks(
    files: dict[str, Wanted], by_reference: dict[str, str], source: Store
) -> dict[str, bytes]:
    """Give the shard files a version-2 merge records by reference their block lists, read in
    parallel from the shards' manifests and checked against the merge's digests. Returns those
    manifests (key: bytes): the pulled copy holds them, so it streams and resumes alike."""
    keys = sorted({dataset_manifest(k.rsplit(".", 1)[0]) for k in by_reference})
    with ThreadPoolExecutor(8, thread_name_prefix="tokenmill-pull-plan") as pool:
        found = dict(zip(keys, pool.map(source.read, keys), strict=True))
    for key, digest in by_reference.items():
        mkey = dataset_manifest(key.rsplit(".", 1)[0])
        raw, uri = found[mkey], source.where(mkey)
        if raw is None:
            raise FormatError(uri, "manifest", f"missing; it holds the block list of {key}")
        info = load_json(raw, uri, "manifest").get("files", {}).get(posixpath.basename(key))
        if not isinstance(info, dict) or block_list_digest(info.get("block_sha256", ())) != digest:
            raise FormatError(
                uri, "block_sha256", f"not the block list of {key} the merge recorded"
            )
        want = files[key]
        files[key] = dataclasses.replace(
            want, **_block_list(info, want.size, uri, posixpath.basename(key))
        )
    return {k: raw for k, raw in found.items() if raw is not None}


def _block_list(info: dict[str, Any], size: int, uri: str, name: str) -> dict[str, Any]:
    """The ``block_bytes`` and ``block_sha256`` of a Wanted, as a manifest records them for a
    file (none: ``{}``); a list that does not cover the file is a FormatError."""
    if "block_sha256" not in info:
        return {}
    block_bytes, digests = int(info["block_bytes"]), tuple(str(d) for d in info["block_sha256"])
    if block_bytes <= 0 or len(digests) != -(-size // block_bytes):
        raise FormatError(
            uri, f"files.{name}.block_sha256", f"{len(digests)} blocks do not cover {size} bytes"
        )
    return {"block_bytes": block_bytes, "block_sha256": digests}


def plan_blend(
    uri: str,
    *,
    version: str | None = None,
    endpoint_url: str | None = None,
    jobs: int = 1,
    shards: bool = False,
) -> tuple[Store, bytes, Plan]:
    """The source, the blend manifest's bytes and the plan of every file the blend needs.
    ``shards`` (``pull``): also the manifests of virtual merges' shards, which hold the block
    lists the merges refer to (the S3 reader reads those lazily: a GET per shard slows an open)."""
    if jobs < 1:
        raise ConfigError(f"jobs must be >= 1, got {jobs}")
    source, manifest_key = open_source(uri, endpoint_url, jobs)
    if version is not None:
        folder = posixpath.dirname(manifest_key)
        if _in_versions(folder):
            folder = posixpath.dirname(posixpath.dirname(folder))
        manifest_key = _version_key(folder, version)
    raw, where = source.read(manifest_key), source.where(manifest_key)
    if raw is None:
        what = "no blend manifest" if version is None else f"no version {version} of the blend"
        raise InputError(f"{where}: {what} there")
    manifest = _parse_manifest(raw, where)
    return source, raw, _plan(manifest, manifest_key, source, where, shards=shards)


def _parse_manifest(raw: bytes, uri: str) -> dict[str, Any]:
    """The blend manifest's JSON object (full schema checks happen on the local copy)."""
    manifest = load_json(raw, uri, "manifest")
    if not isinstance(manifest, dict) or manifest.get("kind") != "blend":
        raise FormatError(uri, "kind", "expected 'blend': this is not a blend manifest")
    return manifest
