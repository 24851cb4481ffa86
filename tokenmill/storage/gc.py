"""Owns ``tokenmill gc``, in passes (finish half-removals, plan, re-plan if a pointer moved,
remove): old blend versions, merged versions and unreferenced Nanoset caches under a root go.
What it reads is ``tokenmill.storage.gc_listing``'s, the plan ``tokenmill.storage.gc_plan``'s.

What stays: every current version and every version ``keep_versions`` names; per blend and per
merged dataset the ``keep`` newest (by their manifest's mtime) and, with ``older_than_days``, the
recent ones; every file a kept blend version references (its merged versions whatever their age,
its index caches); every Nanoset entry built for the content of a kept merged version or of an
unversioned pair, or recent. Incomplete versions (no manifest yet) and other files stay.

Beside a refresh, the pointers are read after the last listing, before removing and before each
version goes, and anything modified after gc started stays; a damaged pointer (or a blend pointer
missing beside versions) stops gc before it removes anything. A removal writes a tombstone
(``gc-removing.json``), removes the manifest (a half-removed version never looks complete), the
rest, then the tombstone: the next gc finishes, and reports, one killed half-way.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from tokenmill.errors import ConfigError
from tokenmill.paths import is_lower_hex
from tokenmill.storage.gc_listing import (
    DAY,
    Listing,
    Removal,
    blend_pointer,
    list_root,
    merged_current,
    read_pointers,
    tombstone,
)
from tokenmill.storage.gc_plan import Rules, matches, plan
from tokenmill.storage.layout import VERSION_CHARS
from tokenmill.storage.store import Store, open_store

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
    record = {"kind": removal.kind, "name": removal.name, "version": removal.version}
    store.write(tombstone(removal), (json.dumps(record, sort_keys=True) + "\n").encode())
    store.delete([removal.commit])
    _remove_rest(store, removal)


def _remove_rest(store: Store, removal: Removal) -> None:
    """A removal once its commit file is gone: the other files, then the tombstone."""
    mark = tombstone(removal)
    store.delete([k for k in removal.keys if k not in (removal.commit, mark)])
    store.delete([mark])


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
    """Remove (or with ``dry_run`` list) what the module docstring says may go. A pin matching no
    version is a ConfigError unless ``force``: a typo would remove the version it meant to keep."""
    pins = _checked_arguments(keep, older_than_days, keep_versions)
    store = open_store(root, endpoint_url)
    started = time.time()
    listing = list_root(store)
    if not force:
        _check_pins(pins, listing, os.fspath(root))
    pointers = read_pointers(store, listing)
    rules = Rules(keep, None if older_than_days is None else started - older_than_days * DAY, pins)
    report = GcReport(dry_run=dry_run, incomplete=listing.incomplete)
    report.finished = _finish_halves(store, listing, dry_run)
    doomed, report.kept = plan(store, listing, pointers, rules)
    again = pointers if dry_run else read_pointers(store, listing)  # pass 3: read them again
    if not again.same(pointers):  # a refresh moved one: only what both plans remove goes
        still, report.kept = plan(store, listing, again, rules)
        commits = {r.commit for r in still}
        doomed = [r for r in doomed if r.commit in commits]
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
            _remove_rest(store, removal)
        finished.append(removal)
    return finished


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
    missing = [pin for pin in pins if not any(matches(v, [pin]) for _, _, v in known)]
    if missing:
        shown = "; ".join(f"{kind} {name} {version}" for kind, name, version in known[:30])
        more = f"; and {len(known) - 30} more" if len(known) > 30 else ""
        raise ConfigError(
            f"--keep-version {', '.join(missing)}: matches no blend or merged version under "
            f"{root} (known: {shown or 'none'}{more}); nothing was removed. Fix the version, or "
            "pass --force to run gc anyway"
        )


def _still_old(store: Store, removal: Removal) -> bool:
    """True when a concurrent build made this blend version current again (then it stays)."""
    pointer = blend_pointer(store, removal.name, 1) or {}
    return str(pointer.get("version", ""))[:VERSION_CHARS] == removal.version
