"""``tokenmill takedown``: mask listed documents out of every merged dataset and blend, with an
audit record."""

from __future__ import annotations

import argparse

from tokenmill.takedown import takedown


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``takedown`` subcommand."""
    p = sub.add_parser(
        "takedown",
        help="remove documents from every merged dataset and blend (masks, no re-tokenizing)",
        description="The list holds `tokenmill find` queries, one a line: id:<id>, "
        "line:<file>:<line>, text:<exact substring>, sha256:<hex of the NFC text>. Writes the "
        "audit record ROOT/takedowns/<id>.json (what, from which versions, when, why), then new "
        "virtual merged versions that mask the documents and new versions of every blend "
        "reading them, and moves the pointers. Older versions stay (pinned jobs keep reading "
        "them) until `tokenmill gc`. Physical merges are refused. A list already recorded is "
        "applied again (nothing new is made). Exit 1 when a query matches no document.",
    )
    p.add_argument(
        "--root",
        default="data",
        help="the storage root: a folder or s3://bucket/prefix ($AWS_ENDPOINT_URL)",
    )
    p.add_argument("--list", required=True, metavar="FILE", help="the takedown list")
    p.add_argument("--reason", required=True, metavar="TEXT", help="why (kept in the record)")


def run(args: argparse.Namespace) -> int:
    """Print what was masked and which versions were made; 1 when a query matched nothing."""
    report = takedown(args.root, args.list, args.reason)
    for line in report.lines():
        print(line)
    return 1 if report.record["unmatched"] else 0
