"""``tokenmill find``: every blend version and sample holding a document (by id, source line or
text)."""

from __future__ import annotations

import argparse

from tokenmill.errors import ConfigError
from tokenmill.provenance import find, query_lines, resolve_queries
from tokenmill.storage.mirror import local_root


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``find`` subcommand."""
    p = sub.add_parser(
        "find",
        help="find the blend versions and samples that hold a document",
        description="Queries: id:<id> (the record's id field), line:<file>:<line> (1-based "
        "source line), text:<exact substring>, sha256:<hex> (sha256 of the text NFC-normalized, "
        "whitespace kept). Lists each matching document "
        "with every blend version under ROOT/blends/*/versions that holds it and the samples of "
        "each split. Exit 1 when a query matches no document.",
    )
    p.add_argument(
        "root", metavar="ROOT", help="the storage root (raw/, tokens/, blends/): a folder or s3://"
    )
    p.add_argument(
        "query", nargs="*", metavar="QUERY", help="id:..., line:FILE:N, text:..., sha256:..."
    )
    p.add_argument("--queries", metavar="FILE", help="a file of queries, one a line")


def run(args: argparse.Namespace) -> int:
    """Print each matching document and where it is; 1 when a query matched nothing."""
    queries = list(args.query) + (query_lines(args.queries) if args.queries else [])
    if not queries:
        raise ConfigError("give at least one QUERY or --queries FILE")
    with local_root(args.root) as root:  # an s3:// root: mirrored once for both
        refs = resolve_queries(root, queries)
        hits = find(root, queries, refs=refs)
    for ref in refs:
        doc_id = f" id={ref.doc_id}" if ref.doc_id is not None else ""
        print(
            f"{ref.query}: {ref.dataset}/{ref.shard} document {ref.document} "
            f"{ref.source}:{ref.line}{doc_id}"
        )
        mine = [h for h in hits if h.document == ref]
        for hit in mine:
            splits = "; ".join(f"{s} {ids}" for s, ids in hit.samples.items())
            print(f"  blend {hit.blend} version {hit.version[:16]}: {splits}")
        if not mine:
            print("  in no sample of any blend version on this root")
    missing = [q for q in dict.fromkeys(queries) if q not in {r.query for r in refs}]
    for query in missing:
        print(f"{query}: no document")
    return 1 if missing else 0
