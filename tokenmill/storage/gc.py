"""Owns ``tokenmill gc``, one function per pass (finish half-removals, plan, re-plan, remove):
old blend versions, merged versions and unreferenced Nanoset caches go.

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
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import ConfigError
from tokenmill.formats.blend_manifest import MANIFEST_NAME, VERSIONS_DIR
from tokenmill.formats.nanoset_cache import segment_files
from tokenmill.paths import is_lower_hex
from tokenmill.storage.gc_listing import (
    DAY,
    DESCRIPTION,
    Listing,
    Pointers,
    Removal,
    blend_pointer,
    blend_version_manifest,
    list_root,
    merged_current,
    merged_manifest,
    merged_version_manifest,
    newest,
    read_json,
    read_pointers,
    referenced,
    tombstone,
)
from tokenmill.storage.layout import VERSION_CHARS
from tokenmill.storage.store import Store, StoredFile, open_store

__all__ = ["GcReport", "Removal", "gc"]


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


def _remove(store: Store, removal: Removal) -> None:
    """Tombstone, commit file (the version stops looking complete), the rest, tombstone: a gc
    killed anywhere in between leaves a tombstone the next run finds and finishes."""
    mark = tombstone(removal)
    record = {"kind": removal.kind, "name": removal.name, "version": removal.version}
    store.write(mark, (json.dumps(record, sort_keys=True) + "\n").encode())
    store.delete([removal.commit])
    store.delete([k for k in removal.keys if k not in (removal.commit, mark)])
    store.delete([mark])


def _matches(version: str, keep: list[str]) -> bool:
    return any(k[:VERSION_CHARS] == version for k in keep)


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
    pins = _checked_arguments(keep, older_than_days, keep_versions)
    store = open_store(root, endpoint_url)
    started = time.time()
    listing = list_root(store)
    if not force:
        _check_pins(pins, listing, os.fspath(root))
    pointers = read_pointers(store, listing)
    rules = _Rules(keep, None if older_than_days is None else started - older_than_days * DAY, pins)
    report = GcReport(dry_run=dry_run, incomplete=listing.incomplete)
    report.finished = _finish_halves(store, listing, dry_run)
    doomed, report.kept = _plan(store, listing, pointers, rules)
    if not dry_run:
        doomed, report.kept = _replan(store, listing, pointers, rules, doomed, report.kept)
    report.removed = _remove_doomed(store, doomed, started, dry_run, report.kept)
    return report


def _checked_arguments(
    keep: int, older_than_days: float | None, keep_versions: list[str] | None
) -> list[str]:
    """The pins, after a ConfigError for any argument gc cannot use."""
    if keep < 0:
        raise ConfigError(f"--keep must be >= 0, got {keep}")
    if older_than_days is not None and not older_than_days >= 0:
        raise ConfigError(f"--older-than must be >= 0 days, got {older_than_days}")
    pins = list(keep_versions or [])
    for pin in pins:
        if len(pin) < VERSION_CHARS or not is_lower_hex(pin):
            raise ConfigError(f"--keep-version {pin!r}: expected >= 16 lowercase hex digits")
    return pins


def _finish_halves(store: Store, listing: Listing, dry_run: bool) -> list[Removal]:
    """Pass 1: finish the removals an interrupted gc left half-done (tombstone last)."""
    finished = []
    for removal in listing.halves:
        if not dry_run:
            if removal.commit and store.read(removal.commit) is not None:
                continue  # rebuilt meanwhile: complete again
            store.delete([k for k in removal.keys if k != tombstone(removal)])
            store.delete([tombstone(removal)])
        finished.append(removal)
    return finished


def _replan(
    store: Store,
    listing: Listing,
    pointers: Pointers,
    rules: _Rules,
    doomed: list[Removal],
    kept: list[str],
) -> tuple[list[Removal], list[str]]:
    """Pass 3: the pointers read again; when a refresh moved one, only what both plans remove
    goes."""
    again = read_pointers(store, listing)
    if again.same(pointers):
        return doomed, kept
    still, kept = _plan(store, listing, again, rules)
    commits = {r.commit for r in still}
    return [r for r in doomed if r.commit in commits], kept


def _remove_doomed(
    store: Store, doomed: list[Removal], started: float, dry_run: bool, kept: list[str]
) -> list[Removal]:
    """Pass 4: remove each planned version unless it was written since gc started or became
    current again (appended to ``kept``); the removed ones."""
    removed = []
    for removal in doomed:
        if removal.mtime >= started:  # written while gc ran: a refresh in flight owns it
            kept.append(f"{removal.kind} {removal.name} {removal.version} (new)")
            continue
        if not dry_run:
            if removal.kind == "blend" and _still_old(store, removal):
                continue
            if removal.kind == "merged" and removal.version in merged_current(
                store, f"merged/{removal.name}"
            ):
                continue
            _remove(store, removal)
        removed.append(removal)
    return removed


def _check_pins(pins: list[str], listing: Listing, root: str) -> None:
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

    def choose(
        self, kind: str, name: str, dated: list[tuple[str, float]], current: set[str]
    ) -> tuple[set[str], list[str]]:
        """The versions kept (newest first in ``dated``), each with a line saying why."""
        kept, lines = set(), []
        for rank, (version, mtime) in enumerate(dated):
            why = (
                "current"
                if version in current
                else "--keep-version"
                if _matches(version, self.pins)
                else f"among the {self.keep} newest"
                if rank < self.keep
                else "newer than --older-than"
                if self.recent(mtime)
                else None
            )
            if why:
                kept.add(version)
                lines.append(f"{kind} {name} {version} ({why})")
        return kept, lines


def _removal(
    kind: str, name: str, version: str, files: list[StoredFile], mtime: float, commit: str
) -> Removal:
    """A planned removal of ``files`` (sorted keys, total size)."""
    keys = sorted(f.key for f in files)
    return Removal(kind, name, version, keys, sum(f.size for f in files), mtime, commit)


def _plan(
    store: Store, listing: Listing, pointers: Pointers, rules: _Rules
) -> tuple[list[Removal], list[str]]:
    """Pass 2: what may go given these pointers (blends, then the merged versions and Nanoset
    entries nothing kept needs), and why each kept version stays."""
    blends, protected, kept = _plan_blends(store, listing, pointers, rules)
    merged, kept_content, kept_merged = _plan_merged(store, listing, pointers, rules, protected)
    entries = _plan_entries(store, listing, rules, protected, kept_content)
    return blends + merged + entries, kept + kept_merged


def _plan_blends(
    store: Store, listing: Listing, pointers: Pointers, rules: _Rules
) -> tuple[list[Removal], set[str], list[str]]:
    """The blend versions that may go, every file the pointers and kept versions reference,
    and the kept lines."""
    protected: set[str] = set()
    doomed: list[Removal] = []
    lines: list[str] = []
    for name, record in pointers.blends.items():
        protected |= referenced(record, f"blends/{name}")
    for name, versions in sorted(listing.blends.items()):
        folder = f"blends/{name}"
        pointer = pointers.blends.get(name)
        current = {str(pointer.get("version", ""))[:VERSION_CHARS]} if pointer else set()
        dated = newest(versions, functools.partial(blend_version_manifest, folder))
        kept, why = rules.choose("blend", name, dated, current)
        lines += why
        for version, mtime in dated:  # newest first: a version reads only older ones' arrays
            vdir = f"{folder}/{VERSIONS_DIR}/{version}"
            if version not in kept and protected & {f.key for f in versions[version]}:
                kept.add(version)  # a growing version reads its blend arrays as segments
                lines.append(f"blend {name} {version} (a kept version reads its arrays)")
            if version in kept:
                kept_manifest = read_json(store, f"{vdir}/{MANIFEST_NAME}") or {}
                protected |= referenced(kept_manifest, vdir)
            else:
                doomed.append(
                    _removal(
                        "blend", name, version, versions[version], mtime, f"{vdir}/{MANIFEST_NAME}"
                    )
                )
    return doomed, protected, lines


def _plan_merged(
    store: Store, listing: Listing, pointers: Pointers, rules: _Rules, protected: set[str]
) -> tuple[list[Removal], set[str], list[str]]:
    """The merged versions (``merged/<ds>/<v16>/``) that may go, the content hashes of the kept
    ones and of unversioned pairs (their Nanoset entries stay), and the kept lines."""
    kept_content: set[str] = set()
    doomed: list[Removal] = []
    lines: list[str] = []
    for key in listing.unversioned:
        kept_content |= _content_hash(store, key)
    for name, versions in sorted(listing.merged.items()):
        current = pointers.merged.get(name, set())
        dated = newest(versions, functools.partial(merged_version_manifest, versions))
        kept, why = rules.choose("merged", name, dated, current)
        lines += why
        for version, mtime in dated:
            files = versions[version]
            if version not in kept and protected & {f.key for f in files}:
                kept.add(version)
                lines.append(f"merged {name} {version} (a kept blend version reads it)")
            if version in kept:
                kept_content |= _content_hash(store, merged_manifest(files))
            else:
                doomed.append(
                    _removal("merged", name, version, files, mtime, merged_manifest(files))
                )
    return doomed, kept_content, lines


def _content_hash(store: Store, key: str) -> set[str]:
    """The content hash a dataset manifest records, as a set (empty when there is none)."""
    manifest = read_json(store, key)
    if manifest and isinstance(manifest.get("content_hash"), str):
        return {manifest["content_hash"]}
    return set()


def _plan_entries(
    store: Store, listing: Listing, rules: _Rules, protected: set[str], kept_content: set[str]
) -> list[Removal]:
    """The complete Nanoset cache entries (with a description) nothing kept needs; a kept entry
    keeps the earlier entries whose files are its segments (a growing entry that extends)."""
    entries = sorted(listing.entries.items())
    descriptions = {
        stem: read_json(store, f"nanoset/{stem}{DESCRIPTION}") or {} for stem, _ in entries
    }
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
    doomed = []
    for stem, files in entries:
        if stem not in keep_stems:
            mtime = max(f.mtime for f in files)
            description_key = f"nanoset/{stem}{DESCRIPTION}"
            doomed.append(
                _removal("nanoset", stem, stem.split("-", 1)[0], files, mtime, description_key)
            )
    return doomed


def _segment_stems(description: dict[str, Any]) -> set[str]:
    """The entry stems (``<hash>-Nanoset-<split>``) of a description's segment files (earlier
    entries' arrays this entry reads)."""
    return {name.rsplit("-", 1)[0] for name in segment_files(description) if "-" in name}


def _still_old(store: Store, removal: Removal) -> bool:
    """True when a concurrent build made this blend version current again (then it stays)."""
    pointer = blend_pointer(store, removal.name, 1) or {}
    return str(pointer.get("version", ""))[:VERSION_CHARS] == removal.version
