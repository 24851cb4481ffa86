"""``tokenmill pull``: copy exactly the files a blend manifest needs, verified by hash, resumable.

The blend manifest lists every file a blend reads (blend arrays, Nanoset index caches with their
descriptions, each dataset's ``.bin``/``.idx``), each as ``{path relative to the manifest's
directory, bytes, sha256}``; the datasets' own manifests are copied too (the sidecar
``manifests/<name>.manifest.json`` beside each pair), and a ``.bin`` they record by parts (a
merge) is also verified part by part. The relative layout is
kept under the destination, rooted at the deepest folder holding all of them (the storage root
for a pipeline blend), so ``open_blend(<dest>/blends/<name>/manifest.json)`` works. A pointer's
version manifest (``versions/<v16>/manifest.json``) comes along, so ``open_blend(...,
version=...)`` works on the copy too; ``version=`` pulls a named version instead of the current.

Files are fetched in parallel threads, block by block into a partial file
(``<folder>/.tmp/<name>.partial``), each block checked against the per-block sha256 list of its
dataset manifest (a ``.bin`` or ``.idx``; other files are one block, or the parts a merge
records) and the whole file against its sha256, then renamed into place. The destination's
ledger (``tokenmill.storage.pull_ledger``) records each verified block of a partial and each
complete file, so a resumed pull trusts complete files without re-hashing them, continues a
partial file at its first missing block, and fetches by range GET only blocks that are missing
or fail their hash (a complete file changed since it was recorded is re-checked block by block,
and only its bad blocks are fetched again, into a new file renamed over it). They arrive in the
commit order the pipeline uploads in (``tokenmill.storage.publish``: data, then index-cache
descriptions and dataset manifests once all data is complete), and the blend manifest is written
last (and a different one already in the destination is removed first), so its presence means
"complete". The source is a store (``tokenmill.storage.store``): the local file system rooted at
``/``, or an ``s3://`` bucket through the shared client (credentials only from the environment,
endpoint from ``endpoint_url`` or ``$AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import posixpath
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.atomic import atomic_open, load_json, write_bytes
from tokenmill.errors import CacheError, ConfigError, FormatError, InputError
from tokenmill.formats.blend_manifest import (
    MANIFEST_NAME,
    VERSIONS_DIR,
    read_blend_manifest,
    verify_manifest,
)
from tokenmill.formats.virtual_merge import block_list_digest, check_manifest, is_virtual
from tokenmill.paths import has_control_character, leading_parents
from tokenmill.storage.layout import dataset_manifest, version_dir_name
from tokenmill.storage.publish import publish
from tokenmill.storage.pull_blocks import PARTIAL_SUFFIX, Wanted, sync
from tokenmill.storage.pull_ledger import LEDGER_NAME, Ledger
from tokenmill.storage.s3 import split_uri
from tokenmill.storage.store import LocalStore, S3Store, Store

__all__ = [
    "LEDGER_NAME",
    "PARTIAL_SUFFIX",
    "PullReport",
    "Wanted",
    "plan_blend",
    "pull",
    "sync_file",
]

DEFAULT_JOBS = 8
MALFORMED = (KeyError, TypeError, ValueError, AttributeError)  # what a malformed manifest raises


@dataclass
class PullReport:
    """What a pull did: the local manifest to open, files fetched and skipped (relative paths)."""

    manifest: Path
    fetched: list[str] = field(default_factory=list)  # files (re)written, in full or in part
    skipped: list[str] = field(default_factory=list)
    bytes_fetched: int = 0  # bytes downloaded (blocks already there are not counted)


def _open_source(uri: str, endpoint_url: str | None, jobs: int) -> tuple[Store, str]:
    """The source (the bucket, or the file system from ``/``) and the manifest's key in it; a
    folder (or S3 prefix) means its manifest.json."""
    if uri.startswith("s3://"):
        bucket, key = split_uri(uri)
        if not key.endswith(".json"):
            key = posixpath.join(key, MANIFEST_NAME) if key else MANIFEST_NAME
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
class _Plan:
    """Destination-relative paths of everything a pull writes."""

    wanted: list[Wanted]  # the blend's files, deduplicated
    manifest_rel: str  # the blend manifest
    dataset_manifests: dict[str, bytes]  # the datasets' manifests (sidecar keys, source bytes)
    version_manifest: tuple[str, bytes] | None = None  # a pointer's versions/<v>/manifest.json


def _plan(
    manifest: dict[str, Any], manifest_key: str, source: Store, uri: str, *, shards: bool
) -> _Plan:
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
        raw = source.read(key)
        if raw is not None:
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
    return _Plan(wanted, manifest_key[cut:], small, own)


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
    raw = source.read(key)
    if raw is None:
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
        tree = hashlib.sha256("".join(d for _, d in parts).encode()).hexdigest()
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
    """For a virtual merge's manifest: check it against the blend's record (it is written with
    the small manifests, last) and add every shard pair it names, by the digests it records.
    Returns ``{shard .bin/.idx key: block_list_sha256}`` of the files whose block list the
    merge records by reference (a version-2 merge: the shard's dataset manifest holds it)."""
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
    """Give the shard files a version-2 merge records by reference their block lists, read
    from the shards' dataset manifests (in parallel; each list checked against the merge's
    digest, FormatError naming the manifest otherwise). Returns those manifests (key: bytes):
    the pulled copy holds them, so it streams and resumes as the source does."""
    from concurrent.futures import ThreadPoolExecutor

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


class _Progress:
    """A byte counter shown as a tqdm bar on a TTY (tqdm imported only then)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.lock = threading.Lock()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="pull", file=sys.stderr)

    def advance(self, n: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def pull(
    uri: str,
    dest: str | os.PathLike[str],
    *,
    endpoint_url: str | None = None,
    jobs: int = DEFAULT_JOBS,
    progress: bool | None = None,
    version: str | None = None,
) -> PullReport:
    """Copy the blend at ``uri`` (manifest or its folder, local or ``s3://``) into ``dest``.

    Returns what was fetched and skipped and the local manifest path to pass to ``open_blend``.
    ``version`` (a full version hash or its first 16 hex digits) pulls that version,
    ``versions/<v16>/manifest.json`` beside the pointer ``uri``, and its files, instead of the
    current one. ``progress=None`` shows a bar when stderr is a TTY.
    """
    source, raw, plan = plan_blend(
        uri, version=version, endpoint_url=endpoint_url, jobs=jobs, shards=True
    )
    root = Path(dest).resolve()
    root.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(root)  # held (the folder locked) until the blend manifest is in place
    try:
        return _pull_into(root, source, raw, plan, ledger, jobs=jobs, progress=progress)
    finally:
        ledger.release()


def _pull_into(
    root: Path,
    source: Store,
    raw: bytes,
    plan: _Plan,
    ledger: Ledger,
    *,
    jobs: int,
    progress: bool | None,
) -> PullReport:
    """``pull`` once the plan is made and the destination's ledger held."""
    final_manifest = root / plan.manifest_rel
    if final_manifest.is_file() and final_manifest.read_bytes() != raw:
        final_manifest.unlink()  # another version: never leave it claiming new files
    report = PullReport(manifest=final_manifest)
    by_rel = {w.rel: w for w in plan.wanted}
    total = sum(w.size for w in plan.wanted)
    bar = _Progress(total, sys.stderr.isatty() if progress is None else progress)

    def transfer(rel: str) -> tuple[Wanted, int | None] | None:
        if rel in by_rel:
            return by_rel[rel], sync(source, by_rel[rel], root, bar.advance, ledger)
        path, data = root / rel, plan.dataset_manifests[rel]
        if not (path.is_file() and path.read_bytes() == data):
            write_bytes(path, data)
        return None

    try:
        # Commit order (tokenmill.storage.publish): data, then index descriptions and dataset
        # manifests, each rank only once the one before is complete; the blend manifest last.
        results = publish([*by_rel, *plan.dataset_manifests], transfer, jobs=jobs)
    finally:
        bar.close()
    ledger.compact(by_rel)  # one record per complete file of this pull
    for result in results:
        if result is not None:
            want, fetched = result
            (report.fetched if fetched is not None else report.skipped).append(want.rel)
            report.bytes_fetched += fetched or 0
    if plan.version_manifest is not None:  # checked against its files like the pointer
        _commit_manifest(root / plan.version_manifest[0], plan.version_manifest[1])
    _commit_manifest(final_manifest, raw)
    return report


def plan_blend(
    uri: str,
    *,
    version: str | None = None,
    endpoint_url: str | None = None,
    jobs: int = 1,
    shards: bool = False,
) -> tuple[Store, bytes, _Plan]:
    """The source, the blend manifest's bytes and the plan of every file the blend needs
    (``pull`` and the loader's S3 reader share it: the dataset manifests checked against the
    blend's records, every file with its size and sha256). ``shards`` (``pull``): also the
    dataset manifests of virtual merges' shards, whose block lists the merges refer to (the
    S3 reader fetches those lazily: one GET per shard would slow its open)."""
    if jobs < 1:
        raise ConfigError(f"jobs must be >= 1, got {jobs}")
    source, manifest_key = _open_source(uri, endpoint_url, jobs)
    if version is not None:
        folder = posixpath.dirname(manifest_key)
        if _in_versions(folder):
            folder = posixpath.dirname(posixpath.dirname(folder))
        manifest_key = _version_key(folder, version)
    raw = source.read(manifest_key)
    if raw is None:
        what = "no blend manifest" if version is None else f"no version {version} of the blend"
        raise InputError(f"{source.where(manifest_key)}: {what} there")
    manifest = _parse_manifest(raw, source.where(manifest_key))
    return (
        source,
        raw,
        _plan(manifest, manifest_key, source, source.where(manifest_key), shards=shards),
    )


def sync_file(source: Store, want: Wanted, root: Path) -> bool:
    """Make ``root / want.rel`` complete and checked against its sha256; True if fetched."""
    return sync(source, want, root, lambda n: None) is not None


def _parse_manifest(raw: bytes, uri: str) -> dict[str, Any]:
    """The blend manifest's JSON object (full schema checks happen on the local copy)."""
    manifest = load_json(raw, uri, "manifest")
    if not isinstance(manifest, dict) or manifest.get("kind") != "blend":
        raise FormatError(uri, "kind", "expected 'blend': this is not a blend manifest")
    return manifest


def _commit_manifest(final: Path, raw: bytes) -> None:
    """Write the blend manifest last, once the pulled files check against it (one already in
    place with these bytes is checked and left as it is)."""
    if final.is_file() and final.read_bytes() == raw:
        _check_pulled(final, final)
        return
    with atomic_open(final) as fh:
        fh.write(raw)
        fh.flush()
        _check_pulled(Path(fh.name), final)


def _check_pulled(manifest: Path, final: Path) -> None:
    """CacheError unless the files ``manifest`` lists (relative to ``final``'s folder) match."""
    read_blend_manifest(manifest)
    problems = verify_manifest(manifest, at=final)
    if problems:
        raise CacheError(f"{final}: pulled files do not match:\n  " + "\n  ".join(problems))
