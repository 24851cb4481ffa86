"""``tokenmill merge``: concatenate .bin/.idx datasets (Megatron merge_datasets.py, faster)."""

from __future__ import annotations

import argparse

from tokenmill.commands import throughput
from tokenmill.formats.merge import ORDERS, merge_datasets


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``merge`` subcommand."""
    p = sub.add_parser(
        "merge",
        help="merge .bin/.idx datasets into one",
        description="Concatenate datasets in the order given (directories expand to their "
        "pairs in sorted order). Output dtype = first input's; mismatches are errors.",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="DIR_OR_PREFIX")
    p.add_argument("--output-prefix", required=True, metavar="P")
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="given",
        help="given (default), lexicographic (Megatron's sorted()), natural (part_2 < part_10)",
    )


def run(args: argparse.Namespace) -> int:
    """Merge and print a one-line summary."""
    res = merge_datasets(args.input, args.output_prefix, order=args.order)
    print(
        f"merged {len(res.inputs)} inputs -> {res.prefix}: {res.documents} documents, "
        f"{res.sequences} sequences, {res.tokens} tokens, {res.bytes} bytes "
        f"in {res.seconds:.2f}s ({throughput(res.bytes, res.seconds)})"
    )
    return 0
