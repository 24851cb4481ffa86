"""Owns ``tokenmill gc``'s plan (its pass 2): given the listing, the pointers and what the caller
asked to keep, which blend versions, merged versions and Nanoset cache entries may go, and why
each kept version stays (the rules are in ``tokenmill.storage.gc``'s docstring)."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tokenmill.formats.nanoset_cache import segment_files
from tokenmill.storage.gc_listing import (
    DESCRIPTION,
    Listing,
    Pointers,
    Removal,
    blend_version_manifest,
    merged_manifest,
    newest,
    read_json,
    referenced,
)
from tokenmill.storage.layout import VERSION_CHARS
from tokenmill.storage.store import Store, StoredFile

__all__ = ["Rules", "matches", "plan"]


def matches(version: str, pins: list[str]) -> bool:
    """True when a pin (a full hash or a prefix of at least 16 hex digits) names ``version``."""
    return any(k[:VERSION_CHARS] == version for k in pins)


@dataclass(frozen=True)
class Rules:
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
            reasons = (
                (version in current, "current"),
                (matches(version, self.pins), "--keep-version"),
                (rank < self.keep, f"among the {self.keep} newest"),
                (self.recent(mtime), "newer than --older-than"),
            )
            why = next((reason for holds, reason in reasons if holds), None)
            if why:
                kept.add(version)
                lines.append(f"{kind} {name} {version} ({why})")
        return kept, lines


def plan(
    store: Store, listing: Listing, pointers: Pointers, rules: Rules
) -> tuple[list[Removal], list[str]]:
    """What may go given these pointers (blends, then the merged versions and Nanoset entries
    nothing kept needs), and why each kept version stays."""
    blends, protected, kept = _plan_blends(store, listing, pointers, rules)
    merged, kept_content, kept_merged = _plan_merged(store, listing, pointers, rules, protected)
    entries = _plan_entries(store, listing, rules, protected, kept_content)
    return blends + merged + entries, kept + kept_merged


@dataclass(frozen=True)
class _Artifact:
    """One blend or merged dataset with its complete versions, as the plan walks it."""

    kind: str
    name: str
    versions: dict[str, list[StoredFile]]
    current: set[str]
    commits: dict[str, str]  # version -> the key of its commit file
    read_by: str  # why a version the rules let go stays when a kept one reads it


def _sweep(
    artifact: _Artifact, rules: Rules, protected: set[str], lines: list[str], doomed: list[Removal]
) -> Iterator[str]:
    """The kept versions of ``artifact``, newest first; the others go to ``doomed``. A version
    the rules let go stays when ``protected`` (which the caller grows between versions: a
    version reads only older ones) holds one of its files."""
    kind, name = artifact.kind, artifact.name
    dated = newest(artifact.versions, artifact.commits)
    kept, why = rules.choose(kind, name, dated, artifact.current)
    lines += why
    for version, mtime in dated:
        files = artifact.versions[version]
        if version not in kept and protected & {f.key for f in files}:
            kept.add(version)
            lines.append(f"{kind} {name} {version} ({artifact.read_by})")
        if version in kept:
            yield version
        else:
            doomed.append(Removal.of(kind, name, version, files, artifact.commits[version], mtime))


def _plan_blends(
    store: Store, listing: Listing, pointers: Pointers, rules: Rules
) -> tuple[list[Removal], set[str], list[str]]:
    """The blend versions that may go, every file the pointers and kept versions reference,
    and the kept lines."""
    protected: set[str] = set()
    doomed: list[Removal] = []
    lines: list[str] = []
    for name, record in pointers.blends.items():
        protected |= referenced(record, f"blends/{name}")
    for name, versions in sorted(listing.blends.items()):
        pointer = pointers.blends.get(name)
        current = {str(pointer.get("version", ""))[:VERSION_CHARS]} if pointer else set()
        commits = {v: blend_version_manifest(f"blends/{name}", v) for v in versions}
        reads = "a kept version reads its arrays"
        blend = _Artifact("blend", name, versions, current, commits, reads)
        for version in _sweep(blend, rules, protected, lines, doomed):
            manifest = commits[version]
            protected |= referenced(read_json(store, manifest) or {}, posixpath.dirname(manifest))
    return doomed, protected, lines


def _plan_merged(
    store: Store, listing: Listing, pointers: Pointers, rules: Rules, protected: set[str]
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
        commits = {v: merged_manifest(files) for v, files in versions.items()}
        reads = "a kept blend version reads it"
        merged = _Artifact("merged", name, versions, current, commits, reads)
        for version in _sweep(merged, rules, protected, lines, doomed):
            kept_content |= _content_hash(store, commits[version])
    return doomed, kept_content, lines


def _content_hash(store: Store, key: str) -> set[str]:
    """The content hash a dataset manifest records, as a set (empty when there is none)."""
    manifest = read_json(store, key)
    if manifest and isinstance(manifest.get("content_hash"), str):
        return {manifest["content_hash"]}
    return set()


def _plan_entries(
    store: Store, listing: Listing, rules: Rules, protected: set[str], kept_content: set[str]
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
        new = _segment_stems(descriptions.get(queue.pop()) or {}) - keep_stems
        keep_stems |= new
        queue += new
    doomed = []
    for stem, files in entries:
        if stem not in keep_stems:
            mtime, commit = max(f.mtime for f in files), f"nanoset/{stem}{DESCRIPTION}"
            doomed.append(Removal.of("nanoset", stem, stem.split("-", 1)[0], files, commit, mtime))
    return doomed


def _segment_stems(description: dict[str, Any]) -> set[str]:
    """The entry stems (``<hash>-Nanoset-<split>``) of a description's segment files (earlier
    entries' arrays this entry reads)."""
    return {name.rsplit("-", 1)[0] for name in segment_files(description) if "-" in name}
