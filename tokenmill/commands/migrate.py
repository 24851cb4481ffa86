"""``tokenmill migrate``: move tokenmill 0.1.0 dataset manifests into their sidecar folders."""

from __future__ import annotations

import argparse

from tokenmill.commands import add_storage_options
from tokenmill.storage.migrate import migrate


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``migrate`` subcommand."""
    p = sub.add_parser(
        "migrate",
        help="move 0.1.0 dataset manifests (P.manifest.json) to manifests/ (run once)",
        description="A storage root written by tokenmill 0.1.0 keeps each pair's manifest beside "
        "the pair (P.manifest.json); this version reads only P's sidecar "
        "(manifests/<name>.manifest.json). Run once per root; running again changes nothing.",
    )
    add_storage_options(p)
    p.add_argument("--dry-run", action="store_true", help="list the moves, change nothing")


def run(args: argparse.Namespace) -> int:
    """One line per moved (or stale, removed) manifest, then the count."""
    moves = migrate(args.root, dry_run=args.dry_run, endpoint_url=args.endpoint_url)
    for move in moves:
        print(move.line(args.dry_run))
    print(f"{len(moves)} manifest(s) {'to migrate' if args.dry_run else 'migrated'}")
    return 0
