"""Owns ``tokenmill migrate``: the one-off move of tokenmill 0.1.0 dataset manifests
(``<prefix>.manifest.json`` beside the pair) into the ``manifests/`` sidecar folder readers use.

Each move writes the sidecar copy first and removes the old file last, so a run killed half-way
leaves both, which the next run finishes. A pair that already has a sidecar manifest keeps it and
its stale 0.1.0 copy is removed.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

from tokenmill.storage.layout import DATASET_MANIFEST_SUFFIX, dataset_manifest
from tokenmill.storage.store import open_store

__all__ = ["Move", "migrate"]


@dataclass(frozen=True)
class Move:
    """One 0.1.0 manifest: where it was, where it goes, and whether a sidecar was already there."""

    old: str  # key of ``<prefix>.manifest.json``
    new: str  # key of ``<dir>/manifests/<name>.manifest.json``
    stale: bool  # the sidecar existed: the old copy is only removed

    def line(self, dry_run: bool) -> str:
        if self.stale:
            return (
                f"{'would remove' if dry_run else 'removed'} {self.old} (stale: {self.new} exists)"
            )
        return f"{'would move' if dry_run else 'moved'} {self.old} -> {self.new}"


def migrate(
    root: str | os.PathLike[str], *, dry_run: bool = False, endpoint_url: str | None = None
) -> list[Move]:
    """Move (``dry_run``: list) every 0.1.0 dataset manifest under ``root`` into its sidecar folder:
    each ``<prefix>.manifest.json`` listed beside a ``<prefix>.idx``."""
    store = open_store(root, endpoint_url)
    keys = {f.key for f in store.files("")}
    moves = []
    for key in sorted(keys):
        prefix = key.removesuffix(DATASET_MANIFEST_SUFFIX)
        if prefix != key and posixpath.basename(prefix) and f"{prefix}.idx" in keys:
            new = dataset_manifest(prefix)
            moves.append(Move(key, new, stale=new in keys))
    if dry_run:
        return moves
    for move in moves:
        if not move.stale:
            data = store.read(move.old)
            if data is None:  # removed meanwhile (another migrate): nothing to move
                continue
            store.write(move.new, data)
        store.delete([move.old])
    return moves
