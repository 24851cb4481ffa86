"""``tokenmill pull``: copy exactly the files a blend manifest needs, verified by hash, resumable.

What to copy is :func:`~tokenmill.storage.pull_plan.plan_blend`'s plan, laid out relatively under
the destination, so ``open_blend(<dest>/blends/<name>/manifest.json)`` works. Files are fetched
in parallel threads, block by block, each checked against its sha256
(``tokenmill.storage.pull_blocks``); the destination's ledger (``tokenmill.storage.pull_ledger``)
lets a resumed pull trust complete files and fetch only the missing or bad blocks. Files arrive in
the pipeline's commit order (``tokenmill.storage.publish``) and the blend manifest last (a
different one already there is removed first), so its presence means "complete".
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.atomic import atomic_open, fsync_dir, write_bytes
from tokenmill.errors import CacheError
from tokenmill.formats.blend_manifest import read_blend_manifest, verify_manifest
from tokenmill.storage.publish import publish
from tokenmill.storage.pull_blocks import PARTIAL_SUFFIX, Wanted, sync
from tokenmill.storage.pull_ledger import LEDGER_NAME, Ledger
from tokenmill.storage.pull_plan import Plan, plan_blend
from tokenmill.storage.store import Store

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


@dataclass
class PullReport:
    """What a pull did: the local manifest to open, files fetched and skipped (relative paths)."""

    manifest: Path
    fetched: list[str] = field(default_factory=list)  # files (re)written, in full or in part
    skipped: list[str] = field(default_factory=list)
    bytes_fetched: int = 0  # bytes downloaded (blocks already there are not counted)


def pull(
    uri: str,
    dest: str | os.PathLike[str],
    *,
    endpoint_url: str | None = None,
    jobs: int = DEFAULT_JOBS,
    progress: bool | None = None,
    version: str | None = None,
) -> PullReport:
    """Copy the blend at ``uri`` (manifest or its folder, local or ``s3://``) into ``dest``; what
    was fetched and skipped, and the local manifest to pass to ``open_blend``. ``version`` (a
    version hash or its first 16 hex digits) pulls that version (``versions/<v16>/`` beside the
    pointer ``uri``) instead of the current one. ``progress=None``: a bar when stderr is a TTY."""
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
    plan: Plan,
    ledger: Ledger,
    *,
    jobs: int,
    progress: bool | None,
) -> PullReport:
    """``pull`` once the plan is made and the destination's ledger held."""
    final_manifest = root / plan.manifest_rel
    if final_manifest.is_file() and final_manifest.read_bytes() != raw:
        final_manifest.unlink()  # another version: never leave it claiming new files
        fsync_dir(final_manifest.parent)  # gone on disk before any file it names changes
    report = PullReport(manifest=final_manifest)
    by_rel = {w.rel: w for w in plan.wanted}
    bar, lock = None, threading.Lock()
    if sys.stderr.isatty() if progress is None else progress:
        from tqdm import tqdm  # the pipeline extra: imported only for a bar

        total = sum(w.size for w in plan.wanted)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="pull", file=sys.stderr)

    def advance(n: int) -> None:
        if bar is not None:
            with lock:
                bar.update(n)

    def transfer(rel: str) -> tuple[Wanted, int | None] | None:
        if rel in by_rel:
            return by_rel[rel], sync(source, by_rel[rel], root, advance, ledger)
        path, data = root / rel, plan.dataset_manifests[rel]
        if not (path.is_file() and path.read_bytes() == data):
            write_bytes(path, data)
        return None

    try:
        # Commit order (tokenmill.storage.publish); the blend manifests go last, below.
        results = publish([*by_rel, *plan.dataset_manifests], transfer, jobs=jobs)
    finally:
        if bar is not None:
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


def sync_file(source: Store, want: Wanted, root: Path) -> bool:
    """Make ``root / want.rel`` complete and checked against its sha256; True if fetched."""
    return sync(source, want, root, lambda n: None) is not None


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
    if problems := verify_manifest(manifest, at=final):
        raise CacheError(f"{final}: pulled files do not match:\n  " + "\n  ".join(problems))
