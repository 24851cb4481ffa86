"""``tokenmill gc``: remove old blend versions, merged versions and unreferenced index caches."""

from __future__ import annotations

import argparse

from tokenmill.commands import add_storage_options
from tokenmill.storage.gc import gc


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``gc`` subcommand."""
    p = sub.add_parser(
        "gc",
        help="remove old blend and merged versions and index caches nothing kept uses",
        description="Keep, per blend and per merged dataset, the current version, the --keep "
        "newest, those named by --keep-version, those newer than --older-than, and everything a "
        "kept blend version reads; remove the other versions and the Nanoset cache entries no "
        "kept version uses. Age is the modification time (local mtime, S3 LastModified).",
    )
    add_storage_options(p)
    p.add_argument(
        "--keep", type=int, required=True, metavar="N", help="newest versions kept per artifact"
    )
    p.add_argument(
        "--older-than",
        type=float,
        metavar="DAYS",
        help="remove only versions (and cache entries) modified more than DAYS days ago",
    )
    p.add_argument(
        "--keep-version",
        action="append",
        default=[],
        metavar="V",
        help="never remove this version (hash or first 16 hex digits), repeated",
    )
    p.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help="run even when a --keep-version matches no version (refused otherwise: a typo "
        "would remove the version meant to be kept)",
    )


def run(args: argparse.Namespace) -> int:
    """One line per removed version or cache entry, then the totals."""
    report = gc(
        args.root,
        keep=args.keep,
        older_than_days=args.older_than,
        keep_versions=args.keep_version,
        dry_run=args.dry_run,
        endpoint_url=args.endpoint_url,
        force=args.force,
    )
    for line in report.lines():
        print(line)
    return 0
