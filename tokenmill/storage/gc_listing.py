"""Owns what ``tokenmill gc`` reads before it decides: the storage root's listing grouped into
complete versions, cache entries and half-removed ones, and the pointers (what is current)."""

from __future__ import annotations

import posixpath
import re
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.atomic import load_json
from tokenmill.errors import ConfigError, FormatError
from tokenmill.formats.blend_manifest import MANIFEST_NAME, VERSIONS_DIR, parse_blend_manifest
from tokenmill.storage.layout import (
    DATASET_MANIFEST_SUFFIX,
    DATASET_MANIFESTS,
    POINTER_NAME,
    VERSION_CHARS,
    dataset_manifest,
)
from tokenmill.storage.store import Store, StoredFile
from tokenmill.storage.versions import parse_pointer

HEX16 = re.compile(r"^[0-9a-f]{16}$")
NANOSET_ENTRY = re.compile(r"^([0-9a-f]{32}-Nanoset-(?:train|valid|test))-.+$")
DESCRIPTION = "-description.json"
DAY = 86400.0
TOMBSTONE = "gc-removing.json"  # written before a version's manifest goes; removed last


@dataclass
class Removal:
    """One version (or cache entry) that gc removes (or would remove, in a dry run)."""

    kind: str  # "blend", "merged" or "nanoset"
    name: str  # blend or dataset name; for a cache entry its file stem
    version: str  # version folder (16 hex digits); for a cache entry its hash
    keys: list[str]  # the files, relative to the storage root
    bytes: int
    mtime: float
    commit: str  # the key removed first (manifest or description); "" when not known

    @classmethod
    def of(
        cls, kind: str, name: str, version: str, files: list[StoredFile], commit: str, mtime: float
    ) -> Removal:
        """The removal of ``files`` (sorted keys, total size)."""
        keys = sorted(f.key for f in files)
        return cls(kind, name, version, keys, sum(f.size for f in files), mtime, commit)

    def line(self, dry_run: bool) -> str:
        verb = "would remove" if dry_run else "removed"
        age = (time.time() - self.mtime) / DAY
        return (
            f"{verb} {self.kind} {self.name} {self.version}: {len(self.keys)} files, "
            f"{self.bytes} bytes, modified {age:.1f} days ago"
        )


def read_json(store: Store, key: str) -> dict[str, Any] | None:
    """A JSON object gc only reads for hints (a cache description, a dataset manifest): None
    when it is missing or damaged (what it would protect is a rebuildable cache)."""
    if (raw := store.read(key)) is None:
        return None
    try:
        value = load_json(raw, key)
    except FormatError:
        return None
    return value if isinstance(value, dict) else None


def blend_pointer(store: Store, name: str, versions: int) -> dict[str, Any] | None:
    """The blend pointer ``blends/<name>/manifest.json``, checked like any blend manifest; None
    when there is none and no version either. A damaged or missing pointer beside versions
    stops gc: it names the current version, and guessing would remove it."""
    key = f"blends/{name}/{MANIFEST_NAME}"
    if (raw := store.read(key)) is None:
        if not versions:
            return None
        raise FormatError(
            key,
            "pointer",
            f"missing while {versions} version(s) exist under {VERSIONS_DIR}/; gc stops and "
            "removes nothing: rebuild the blend (during its first build, run gc after it; a "
            "retired blend's folder is removed by hand)",
        )
    try:
        return parse_blend_manifest(raw, key)
    except FormatError as exc:
        raise FormatError(
            key, "pointer", f"{exc}; gc stops and removes nothing: rebuild the blend"
        ) from exc


def groups(files: list[StoredFile], version_at: int) -> dict[tuple[str, str], list[StoredFile]]:
    """Files grouped by (name, version): ``parts[1]`` is the name, ``parts[version_at]`` a
    version folder (16 hex digits; anything else, e.g. a temp folder, is not grouped)."""
    out: dict[tuple[str, str], list[StoredFile]] = {}
    for f in files:
        parts = f.key.split("/")
        if len(parts) > version_at + 1 and HEX16.match(parts[version_at]):
            out.setdefault((parts[1], parts[version_at]), []).append(f)
    return out


def referenced(manifest: dict[str, Any], folder: str) -> set[str]:
    """Root-relative keys of every file a blend manifest in ``folder`` names."""
    paths = [ds.get("prefix", "") for ds in manifest.get("datasets", [])]
    for ds in manifest.get("datasets", []):
        paths += [f.get("path", "") for f in ds.get("files", {}).values()]
    for info in manifest.get("splits", {}).values():
        paths += [f.get("path", "") for f in info.get("files", {}).values()]
        for ds in info.get("datasets", []):
            paths += [f.get("path", "") for f in ds.get("index", {}).get("files", {}).values()]
    keys = set()
    for path in paths:
        if isinstance(path, str) and path:
            key = posixpath.normpath(posixpath.join(folder, path))
            if not key.startswith(".."):
                keys.add(key)
    prefixes = {k for k in keys if not posixpath.splitext(k)[1]}
    keys |= {dataset_manifest(p) for p in prefixes}
    return keys


def blend_version_manifest(folder: str, version: str) -> str:
    """The manifest key of a blend version (its commit file)."""
    return f"{folder}/{VERSIONS_DIR}/{version}/{MANIFEST_NAME}"


def newest(
    versions: dict[str, list[StoredFile]], commits: dict[str, str]
) -> list[tuple[str, float]]:
    """Versions with their mtime (of their commit file, else their newest file), newest first."""
    dated = []
    for version, files in versions.items():
        mark = next((f for f in files if f.key == commits[version]), None)
        dated.append((version, mark.mtime if mark else max(f.mtime for f in files)))
    return sorted(dated, key=lambda item: (-item[1], item[0]))


@dataclass
class Listing:
    """What gc saw under the root: complete versions and cache entries, grouped."""

    blends: dict[str, dict[str, list[StoredFile]]]  # name -> version -> files (with manifest)
    pointers: set[str]  # blend names with a pointer file
    merged: dict[str, dict[str, list[StoredFile]]]  # dataset -> version -> files (with manifest)
    unversioned: list[str]  # manifests of pairs outside any version
    entries: dict[str, list[StoredFile]]  # Nanoset entry stem -> files (with description)
    halves: list[Removal]  # left half-removed by an interrupted gc (a tombstone, no manifest)
    incomplete: list[str]  # version folders without manifest nor tombstone, described


@dataclass
class Pointers:
    """The pointers as read once everything was listed: what is current."""

    blends: dict[str, dict[str, Any]]  # name -> the pointer manifest
    merged: dict[str, set[str]]  # dataset -> current version folders

    def same(self, other: Pointers) -> bool:
        current = {n: p.get("version") for n, p in self.blends.items()}
        return current == {n: p.get("version") for n, p in other.blends.items()} and (
            self.merged == other.merged
        )


def list_root(store: Store) -> Listing:
    """List ``blends/``, ``merged/`` and ``nanoset/`` (names and sizes only)."""
    blend_files = list(store.files("blends"))
    pointers = {
        f.key.split("/")[1]
        for f in blend_files
        if f.key.count("/") == 2 and f.key.endswith(f"/{MANIFEST_NAME}")
    }
    blend_versions = groups([f for f in blend_files if f.key.split("/")[2:3] == [VERSIONS_DIR]], 3)
    by_blend: dict[str, dict[str, list[StoredFile]]] = {}
    halves: list[Removal] = []
    incomplete: list[str] = []

    def half(kind: str, name: str, version: str, files: list[StoredFile], commit: str) -> None:
        """A group without its commit file: half-removed (tombstone) or still being written."""
        mtime = max(f.mtime for f in files)
        removal = Removal.of(kind, name, version, files, commit, mtime)
        tomb = next((f for f in files if f.key == tombstone(removal)), None)
        if tomb is not None and all(f.mtime <= tomb.mtime for f in files):
            halves.append(removal)
        elif tomb is not None:  # written after the tombstone: a rebuild of it is under way
            incomplete.append(f"{kind} {name} {version}: being rebuilt after a removal")
        elif kind != "nanoset":
            age = (time.time() - mtime) / DAY
            incomplete.append(
                f"{kind} {name} {version}: no manifest (a build or upload in progress, or a "
                f"removal interrupted before gc wrote tombstones), {len(removal.keys)} files, "
                f"modified {age:.1f} days ago"
            )

    for (name, version), files in sorted(blend_versions.items()):
        commit = blend_version_manifest(f"blends/{name}", version)
        if any(f.key == commit for f in files):
            by_blend.setdefault(name, {})[version] = files
        else:
            half("blend", name, version, files, commit)
    merged_files = list(store.files("merged"))
    unversioned = [  # unversioned pairs (merged/<ds>_..._document.*): never removed
        f.key
        for f in merged_files
        if f.key.split("/")[1:-1] == [DATASET_MANIFESTS] and f.key.endswith(DATASET_MANIFEST_SUFFIX)
    ]
    by_dataset: dict[str, dict[str, list[StoredFile]]] = {}
    for (name, version), files in sorted(groups(merged_files, 2).items()):
        if any(f.key.endswith(DATASET_MANIFEST_SUFFIX) for f in files):
            by_dataset.setdefault(name, {})[version] = files
        else:
            pairs = [f.key[: -len(".bin")] for f in files if f.key.count("/") == 3]
            pairs = [p for p in pairs if f"{p}.bin" in {f.key for f in files}]
            half("merged", name, version, files, dataset_manifest(pairs[0]) if pairs else "")
    entries: dict[str, list[StoredFile]] = {}
    for f in store.files("nanoset"):
        match = NANOSET_ENTRY.match(posixpath.basename(f.key))
        if f.key.count("/") == 1 and match:
            entries.setdefault(match.group(1), []).append(f)
    complete = {}
    for stem, files in sorted(entries.items()):
        description = f"nanoset/{stem}{DESCRIPTION}"
        if description in {f.key for f in files}:
            complete[stem] = files
        else:
            half("nanoset", stem, stem.split("-", 1)[0], files, description)
    return Listing(by_blend, pointers, by_dataset, unversioned, complete, halves, incomplete)


def tombstone(removal: Removal) -> str:
    """The key of the tombstone of a version (in its folder) or a cache entry (beside it)."""
    if removal.kind == "nanoset":
        return f"nanoset/{removal.name}-{TOMBSTONE}"
    if removal.kind == "blend":
        return f"blends/{removal.name}/{VERSIONS_DIR}/{removal.version}/{TOMBSTONE}"
    return f"merged/{removal.name}/{removal.version}/{TOMBSTONE}"


def read_pointers(store: Store, listing: Listing) -> Pointers:
    """Every pointer, read after the last listing: a refresh that moved one meanwhile is seen,
    and what it references is protected."""
    blends = {}
    for name in sorted(listing.pointers | set(listing.blends)):
        pointer = blend_pointer(store, name, len(listing.blends.get(name, {})))
        if pointer is not None:
            blends[name] = pointer
    merged = {name: merged_current(store, f"merged/{name}") for name in sorted(listing.merged)}
    return Pointers(blends, merged)


def merged_current(store: Store, folder: str) -> set[str]:
    """The current merged version folder named by ``merged/<ds>/current.json`` (checked as
    ``tokenmill.storage.versions.read_pointer`` checks one)."""
    key = f"{folder}/{POINTER_NAME}"
    raw = store.read(key)
    try:
        pointer = None if raw is None else parse_pointer(raw, key)
    except (FormatError, ConfigError) as exc:
        raise FormatError(key, "pointer", f"{exc}; gc stops") from exc
    if pointer is None:
        return set()
    current = {pointer["version"][:VERSION_CHARS]}
    target = posixpath.normpath(pointer["target"]).split("/")[0]
    return current | ({target} if HEX16.match(target) else set())


def merged_manifest(files: list[StoredFile]) -> str:
    """The dataset manifest of a merged version (its commit file)."""
    found = sorted(f.key for f in files if f.key.endswith(DATASET_MANIFEST_SUFFIX))
    return found[0] if found else files[0].key
