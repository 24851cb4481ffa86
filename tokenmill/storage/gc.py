"""``tokenmill gc``: remove old blend versions, merged versions and unreferenced Nanoset caches.

On a storage root (a local folder, or ``s3://bucket/prefix``) laid out as
``tokenmill.storage.layout``
describes::

    blends/<name>/manifest.json                   pointer: the current version's manifest
    blends/<name>/versions/<v16>/...              one blend version (manifest.json + arrays)
    merged/<ds>/current.json                      pointer: {"version", "target"}
    merged/<ds>/<v16>/...                         one merged version (pair + manifests/)
    nanoset/<hash>-Nanoset-<split>-*              index cache entries (description last)

What stays:

- every current version (the pointers' targets) and every version named by ``keep_versions``
  (a full hash or a prefix of at least 16 hex digits);
- per blend and per merged dataset, the ``keep`` newest versions (by modification time: local
  mtime, S3 ``LastModified`` of the version's manifest), and with ``older_than_days`` every
  version modified more recently than that;
- every file a kept blend version references (its index caches, its merged datasets: such a
  merged version is kept whatever its age);
- every Nanoset cache entry referenced by a kept blend version or built for the content of a
  kept merged version (its description records the dataset's content hash), or, with
  ``older_than_days``, modified more recently than that.

Anything that is not a complete version (no manifest yet: a build or an upload in progress, a
temp folder, a ``.tmp/`` folder) is left alone (a removed version's folder goes, with its empty
``.tmp/``), and so are files outside these layouts (e.g. an unversioned
``merged/<ds>_text_document.*`` pair, whose content hash also keeps its Nanoset caches).

Concurrent refreshes: the pointers are read after the last listing (a refresh that moved one
meanwhile has what it references protected), read again before anything is removed (what the
new pointers need stays), and once more before each version goes; anything modified after gc
started stays. A blend pointer that is missing beside versions, or damaged, stops gc before
anything is removed (it names the version that must stay), as a damaged merged pointer does. A
version's manifest (an entry's description) is removed first, so a half-removed version never
looks complete. A tombstone (``gc-removing.json`` in a version's folder,
``<entry>-gc-removing.json`` beside a cache entry) is written before that and removed last, so
the next gc finishes, and reports, a removal that was killed half-way. A version folder with
neither manifest nor tombstone is reported as left alone.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.atomic import load_json
from tokenmill.errors import ConfigError, FormatError
from tokenmill.formats.blend_manifest import MANIFEST_NAME, VERSIONS_DIR, parse_blend_manifest
from tokenmill.formats.nanoset_cache import segment_files
from tokenmill.storage.layout import (
    DATASET_MANIFEST_SUFFIX,
    DATASET_MANIFESTS,
    POINTER_NAME,
    VERSION_CHARS,
    dataset_manifests,
)
from tokenmill.storage.store import Store, StoredFile, open_store
from tokenmill.storage.versions import parse_pointer

__all__ = ["GcReport", "Removal", "gc"]

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

    def line(self, dry_run: bool) -> str:
        verb = "would remove" if dry_run else "removed"
        age = (time.time() - self.mtime) / DAY
        return (
            f"{verb} {self.kind} {self.name} {self.version}: {len(self.keys)} files, "
            f"{self.bytes} bytes, modified {age:.1f} days ago"
        )


@dataclass
class GcReport:
    """What gc removed (or would remove), and what it kept."""

    removed: list[Removal] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # "<kind> <name> <version> (why)"
    dry_run: bool = False
    finished: list[Removal] = field(default_factory=list)  # half-removed by an interrupted gc
    incomplete: list[str] = field(default_factory=list)  # version folders without a manifest

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.removed)

    def lines(self) -> list[str]:
        verb = "would finish removing" if self.dry_run else "finished removing"
        out = [
            f"{verb} {r.kind} {r.name} {r.version} (an interrupted gc left it half-removed): "
            f"{len(r.keys)} files, {r.bytes} bytes"
            for r in self.finished
        ]
        out += [f"left alone: {line}" for line in self.incomplete]
        out += [r.line(self.dry_run) for r in self.removed]
        verb = "would remove" if self.dry_run else "removed"
        versions = sum(r.kind != "nanoset" for r in self.removed)
        entries = len(self.removed) - versions
        files = sum(len(r.keys) for r in self.removed)
        out.append(
            f"total: {verb} {versions} versions and {entries} index cache entries, "
            f"{files} files, {self.bytes} bytes; kept {len(self.kept)}"
        )
        return out


def _json(store: Store, key: str) -> dict[str, Any] | None:
    """A JSON object gc only reads for hints (a cache description, a dataset manifest): None
    when it is missing or damaged (what it would protect is a rebuildable cache)."""
    raw = store.read(key)
    if raw is None:
        return None
    try:
        value = load_json(raw, key)
    except FormatError:
        return None
    return value if isinstance(value, dict) else None


def _blend_pointer(store: Store, name: str, versions: int) -> dict[str, Any] | None:
    """The blend pointer ``blends/<name>/manifest.json``, checked like any blend manifest; None
    when there is none and no version either. A damaged or missing pointer beside versions
    stops gc: it names the current version, and guessing would remove it."""
    key = f"blends/{name}/{MANIFEST_NAME}"
    raw = store.read(key)
    if raw is None:
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


def _pointer(store: Store, key: str) -> dict[str, Any] | None:
    """A merged pointer, checked as ``tokenmill.storage.versions.read_pointer`` checks one."""
    raw = store.read(key)
    return None if raw is None else parse_pointer(raw, key)


def _groups(files: list[StoredFile], version_at: int) -> dict[tuple[str, str], list[StoredFile]]:
    """Files grouped by (name, version): ``parts[1]`` is the name, ``parts[version_at]`` a
    version folder (16 hex digits; anything else, e.g. a temp folder, is not grouped)."""
    out: dict[tuple[str, str], list[StoredFile]] = {}
    for f in files:
        parts = f.key.split("/")
        if len(parts) > version_at + 1 and HEX16.match(parts[version_at]):
            out.setdefault((parts[1], parts[version_at]), []).append(f)
    return out


def _matches(version: str, keep: list[str]) -> bool:
    return any(k[:VERSION_CHARS] == version for k in keep)


def _referenced(manifest: dict[str, Any], folder: str) -> set[str]:
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
    keys |= {m for p in prefixes for m in dataset_manifests(p)}
    return keys


def _blend_version_manifest(folder: str, version: str) -> str:
    """The manifest key of a blend version (its commit file)."""
    return f"{folder}/{VERSIONS_DIR}/{version}/{MANIFEST_NAME}"


def _merged_version_manifest(versions: dict[str, list[StoredFile]], version: str) -> str:
    """The dataset manifest key of a merged version (its commit file)."""
    return _merged_manifest(versions[version])


def _newest(
    versions: dict[str, list[StoredFile]], commit: Callable[[str], str]
) -> list[tuple[str, float]]:
    """Versions with their modification time (of the commit file, else the newest file),
    newest first."""
    dated = []
    for version, files in versions.items():
        by_key = {f.key: f for f in files}
        mark = by_key.get(commit(version))
        dated.append((version, mark.mtime if mark else max(f.mtime for f in files)))
    return sorted(dated, key=lambda item: (-item[1], item[0]))


@dataclass
class _Listing:
    """What gc saw under the root: complete versions and cache entries, grouped."""

    blends: dict[str, dict[str, list[StoredFile]]]  # name -> version -> files (with manifest)
    pointers: set[str]  # blend names with a pointer file
    merged: dict[str, dict[str, list[StoredFile]]]  # dataset -> version -> files (with manifest)
    unversioned: list[str]  # manifests of pairs outside any version
    entries: dict[str, list[StoredFile]]  # Nanoset entry stem -> files (with description)
    halves: list[Removal]  # left half-removed by an interrupted gc (a tombstone, no manifest)
    incomplete: list[str]  # version folders without manifest nor tombstone, described


@dataclass
class _Pointers:
    """The pointers as read once everything was listed: what is current."""

    blends: dict[str, dict[str, Any]]  # name -> the pointer manifest
    merged: dict[str, set[str]]  # dataset -> current version folders

    def same(self, other: _Pointers) -> bool:
        current = {n: p.get("version") for n, p in self.blends.items()}
        return current == {n: p.get("version") for n, p in other.blends.items()} and (
            self.merged == other.merged
        )


def _list(store: Store) -> _Listing:
    """List ``blends/``, ``merged/`` and ``nanoset/`` (names and sizes only)."""
    blend_files = list(store.files("blends"))
    pointers = {
        f.key.split("/")[1]
        for f in blend_files
        if f.key.count("/") == 2 and f.key.endswith(f"/{MANIFEST_NAME}")
    }
    blend_versions = _groups([f for f in blend_files if f.key.split("/")[2:3] == [VERSIONS_DIR]], 3)
    by_blend: dict[str, dict[str, list[StoredFile]]] = {}
    halves: list[Removal] = []
    incomplete: list[str] = []

    def half(kind: str, name: str, version: str, files: list[StoredFile], commit: str) -> None:
        """A group without its commit file: half-removed (tombstone) or still being written."""
        keys = sorted(f.key for f in files)
        size, mtime = sum(f.size for f in files), max(f.mtime for f in files)
        removal = Removal(kind, name, version, keys, size, mtime, commit)
        tomb = next((f for f in files if f.key == _tombstone(removal)), None)
        if tomb is not None and all(f.mtime <= tomb.mtime for f in files):
            halves.append(removal)
        elif tomb is not None:  # written after the tombstone: a rebuild of it is under way
            incomplete.append(f"{kind} {name} {version}: being rebuilt after a removal")
        elif kind != "nanoset":
            age = (time.time() - mtime) / DAY
            incomplete.append(
                f"{kind} {name} {version}: no manifest (a build or upload in progress, or a "
                f"removal interrupted before gc wrote tombstones), {len(keys)} files, "
                f"modified {age:.1f} days ago"
            )

    for (name, version), files in sorted(blend_versions.items()):
        commit = f"blends/{name}/{VERSIONS_DIR}/{version}/{MANIFEST_NAME}"
        if any(f.key == commit for f in files):
            by_blend.setdefault(name, {})[version] = files
        else:
            half("blend", name, version, files, commit)
    merged_files = list(store.files("merged"))
    unversioned = []
    for f in merged_files:  # unversioned pairs (merged/<ds>_..._document.*): never removed
        parts = f.key.split("/")
        flat = len(parts) == 2 or (len(parts) == 3 and parts[1] == DATASET_MANIFESTS)
        if flat and f.key.endswith(DATASET_MANIFEST_SUFFIX):
            unversioned.append(f.key)
    by_dataset: dict[str, dict[str, list[StoredFile]]] = {}
    for (name, version), files in sorted(_groups(merged_files, 2).items()):
        if any(f.key.endswith(DATASET_MANIFEST_SUFFIX) for f in files):
            by_dataset.setdefault(name, {})[version] = files
        else:
            pairs = [f.key[: -len(".bin")] for f in files if f.key.count("/") == 3]
            pairs = [p for p in pairs if f"{p}.bin" in {f.key for f in files}]
            half("merged", name, version, files, dataset_manifests(pairs[0])[0] if pairs else "")
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
    return _Listing(by_blend, pointers, by_dataset, unversioned, complete, halves, incomplete)


def _tombstone(removal: Removal) -> str:
    """The key of the tombstone of a version (in its folder) or a cache entry (beside it)."""
    if removal.kind == "nanoset":
        return f"nanoset/{removal.name}-{TOMBSTONE}"
    if removal.kind == "blend":
        return f"blends/{removal.name}/{VERSIONS_DIR}/{removal.version}/{TOMBSTONE}"
    return f"merged/{removal.name}/{removal.version}/{TOMBSTONE}"


def _remove(store: Store, removal: Removal) -> None:
    """Tombstone, commit file (the version stops looking complete), the rest, tombstone: a gc
    killed anywhere in between leaves a tombstone the next run finds and finishes."""
    tombstone = _tombstone(removal)
    record = {"kind": removal.kind, "name": removal.name, "version": removal.version}
    store.write(tombstone, (json.dumps(record, sort_keys=True) + "\n").encode())
    store.delete([removal.commit])
    store.delete([k for k in removal.keys if k not in (removal.commit, tombstone)])
    store.delete([tombstone])


def _read_pointers(store: Store, listing: _Listing) -> _Pointers:
    """Every pointer, read after the last listing: a refresh that moved one meanwhile is seen,
    and what it references is protected."""
    blends = {}
    for name in sorted(listing.pointers | set(listing.blends)):
        pointer = _blend_pointer(store, name, len(listing.blends.get(name, {})))
        if pointer is not None:
            blends[name] = pointer
    merged = {name: _merged_current(store, f"merged/{name}") for name in sorted(listing.merged)}
    return _Pointers(blends, merged)


def gc(
    root: str | os.PathLike[str],
    *,
    keep: int,
    older_than_days: float | None = None,
    keep_versions: list[str] | None = None,
    dry_run: bool = False,
    endpoint_url: str | None = None,
    force: bool = False,
) -> GcReport:
    """Remove (or with ``dry_run`` list) what the module docstring says may go. A pin
    (``keep_versions``) that matches no version is a ConfigError unless ``force``: a typo would
    otherwise remove the version it meant to keep."""
    if keep < 0:
        raise ConfigError(f"--keep must be >= 0, got {keep}")
    if older_than_days is not None and not older_than_days >= 0:
        raise ConfigError(f"--older-than must be >= 0 days, got {older_than_days}")
    pins = list(keep_versions or [])
    for pin in pins:
        if len(pin) < VERSION_CHARS or any(c not in "0123456789abcdef" for c in pin):
            raise ConfigError(f"--keep-version {pin!r}: expected >= 16 lowercase hex digits")
    store = open_store(root, endpoint_url)
    started = time.time()
    listing = _list(store)
    if not force:
        _check_pins(pins, listing, os.fspath(root))
    pointers = _read_pointers(store, listing)
    rules = _Rules(keep, None if older_than_days is None else started - older_than_days * DAY, pins)
    report = GcReport(dry_run=dry_run, incomplete=listing.incomplete)
    for removal in listing.halves:
        if not dry_run:
            if removal.commit and store.read(removal.commit) is not None:
                continue  # rebuilt meanwhile: complete again
            store.delete([k for k in removal.keys if k != _tombstone(removal)])
            store.delete([_tombstone(removal)])
        report.finished.append(removal)
    doomed, report.kept = _plan(store, listing, pointers, rules)
    if not dry_run:
        again = _read_pointers(store, listing)
        if not again.same(pointers):  # a refresh moved a pointer: what both plans remove goes
            still, report.kept = _plan(store, listing, again, rules)
            commits = {r.commit for r in still}
            doomed = [r for r in doomed if r.commit in commits]
    for removal in doomed:
        if removal.mtime >= started:  # written while gc ran: a refresh in flight owns it
            report.kept.append(f"{removal.kind} {removal.name} {removal.version} (new)")
            continue
        if not dry_run:
            if removal.kind == "blend" and _still_old(store, removal):
                continue
            if removal.kind == "merged" and removal.version in _merged_current(
                store, f"merged/{removal.name}"
            ):
                continue
            _remove(store, removal)
        report.removed.append(removal)
    return report


def _check_pins(pins: list[str], listing: _Listing, root: str) -> None:
    """ConfigError naming the known versions when a pin matches none of them."""
    known = [
        (kind, name, version)
        for kind, groups in (("blend", listing.blends), ("merged", listing.merged))
        for name, versions in sorted(groups.items())
        for version in sorted(versions)
    ]
    missing = [pin for pin in pins if not any(_matches(v, [pin]) for _, _, v in known)]
    if missing:
        shown = "; ".join(f"{kind} {name} {version}" for kind, name, version in known[:30])
        more = f"; and {len(known) - 30} more" if len(known) > 30 else ""
        raise ConfigError(
            f"--keep-version {', '.join(missing)}: matches no blend or merged version under "
            f"{root} (known: {shown or 'none'}{more}); nothing was removed. Fix the version, or "
            "pass --force to run gc anyway"
        )


@dataclass(frozen=True)
class _Rules:
    """What the caller asked to keep."""

    keep: int
    cutoff: float | None  # versions modified after this stay (--older-than)
    pins: list[str]

    def recent(self, mtime: float) -> bool:
        return self.cutoff is not None and mtime > self.cutoff


def _plan(
    store: Store, listing: _Listing, pointers: _Pointers, rules: _Rules
) -> tuple[list[Removal], list[str]]:
    """What may go given these pointers, and why each kept version stays."""
    kept_lines: list[str] = []

    def choose(kind: str, name: str, dated: list[tuple[str, float]], current: set[str]) -> set[str]:
        kept = set()
        for rank, (version, mtime) in enumerate(dated):
            why = (
                "current"
                if version in current
                else "--keep-version"
                if _matches(version, rules.pins)
                else f"among the {rules.keep} newest"
                if rank < rules.keep
                else "newer than --older-than"
                if rules.recent(mtime)
                else None
            )
            if why:
                kept.add(version)
                kept_lines.append(f"{kind} {name} {version} ({why})")
        return kept

    # Blends: keep, then collect what the kept versions and every pointer reference.
    protected: set[str] = set()
    doomed: list[Removal] = []
    for name, record in pointers.blends.items():
        protected |= _referenced(record, f"blends/{name}")
    for name, versions in sorted(listing.blends.items()):
        folder = f"blends/{name}"
        pointer = pointers.blends.get(name)
        current = {str(pointer.get("version", ""))[:VERSION_CHARS]} if pointer else set()
        dated = _newest(versions, functools.partial(_blend_version_manifest, folder))
        kept = choose("blend", name, dated, current)
        for version, mtime in dated:
            vdir = f"{folder}/{VERSIONS_DIR}/{version}"
            if version in kept:
                kept_manifest = _json(store, f"{vdir}/{MANIFEST_NAME}") or {}
                protected |= _referenced(kept_manifest, vdir)
                continue
            files = versions[version]
            doomed.append(
                Removal(
                    "blend",
                    name,
                    version,
                    sorted(f.key for f in files),
                    sum(f.size for f in files),
                    mtime,
                    f"{vdir}/{MANIFEST_NAME}",
                )
            )

    # Merged datasets: versions under merged/<ds>/<v16>/ with a dataset manifest.
    kept_content: set[str] = set()
    for key in listing.unversioned:
        manifest = _json(store, key)
        if manifest and isinstance(manifest.get("content_hash"), str):
            kept_content.add(manifest["content_hash"])
    for name, versions in sorted(listing.merged.items()):
        current = pointers.merged.get(name, set())
        dated = _newest(versions, functools.partial(_merged_version_manifest, versions))
        kept = choose("merged", name, dated, current)
        for version, mtime in dated:
            files = versions[version]
            if version not in kept and protected & {f.key for f in files}:
                kept.add(version)
                kept_lines.append(f"merged {name} {version} (a kept blend version reads it)")
            if version in kept:
                manifest = _json(store, _merged_manifest(files))
                if manifest and isinstance(manifest.get("content_hash"), str):
                    kept_content.add(manifest["content_hash"])
                continue
            doomed.append(
                Removal(
                    "merged",
                    name,
                    version,
                    sorted(f.key for f in files),
                    sum(f.size for f in files),
                    mtime,
                    _merged_manifest(files),
                )
            )

    # Nanoset cache entries (complete ones: a description) nothing kept needs; a kept entry
    # keeps the earlier entries whose files are its segments (a growing entry that extends).
    entries = sorted(listing.entries.items())
    descriptions = {stem: _json(store, f"nanoset/{stem}{DESCRIPTION}") or {} for stem, _ in entries}
    keep_stems = set()
    for stem, files in entries:
        content = (descriptions[stem].get("key") or {}).get("dataset_content_hash")
        mtime = max(f.mtime for f in files)
        if {f.key for f in files} & protected or content in kept_content or rules.recent(mtime):
            keep_stems.add(stem)
    queue = list(keep_stems)
    while queue:
        for stem in _segment_stems(descriptions.get(queue.pop()) or {}):
            if stem not in keep_stems:
                keep_stems.add(stem)
                queue.append(stem)
    for stem, files in entries:
        if stem in keep_stems:
            continue
        doomed.append(
            Removal(
                "nanoset",
                stem,
                stem.split("-", 1)[0],
                sorted(f.key for f in files),
                sum(f.size for f in files),
                max(f.mtime for f in files),
                f"nanoset/{stem}{DESCRIPTION}",
            )
        )
    return doomed, kept_lines


def _segment_stems(description: dict[str, Any]) -> set[str]:
    """The entry stems (``<hash>-Nanoset-<split>``) of a description's segment files (earlier
    entries' arrays this entry reads)."""
    return {name.rsplit("-", 1)[0] for name in segment_files(description) if "-" in name}


def _still_old(store: Store, removal: Removal) -> bool:
    """True when a concurrent build made this blend version current again (then it stays)."""
    pointer = _blend_pointer(store, removal.name, 1) or {}
    return str(pointer.get("version", ""))[:VERSION_CHARS] == removal.version


def _merged_current(store: Store, folder: str) -> set[str]:
    """The current merged version folder named by ``merged/<ds>/current.json``."""
    try:
        pointer = _pointer(store, f"{folder}/{POINTER_NAME}")
    except (FormatError, ConfigError) as exc:
        raise FormatError(f"{folder}/{POINTER_NAME}", "pointer", f"{exc}; gc stops") from exc
    if pointer is None:
        return set()
    current = {pointer["version"][:VERSION_CHARS]}
    target = posixpath.normpath(pointer["target"]).split("/")[0]
    return current | ({target} if HEX16.match(target) else set())


def _merged_manifest(files: list[StoredFile]) -> str:
    """The dataset manifest of a merged version (its commit file)."""
    found = sorted(f.key for f in files if f.key.endswith(DATASET_MANIFEST_SUFFIX))
    return found[0] if found else files[0].key
