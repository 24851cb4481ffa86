"""``tokenmill verify``: check a dataset (prefix or ``P.manifest.json``) or a blend manifest."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.verify import verify_dataset

_DATASET_MANIFEST = ".manifest.json"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``verify`` subcommand."""
    p = sub.add_parser(
        "verify",
        help="check a dataset or blend for consistency (exit 1 on any problem)",
    )
    p.add_argument("target", metavar="PREFIX_OR_MANIFEST")
    p.add_argument(
        "--fast",
        action="store_true",
        help="no hashing: sizes (and for a blend its manifest's own hash, schema and index "
        "records, as open_blend's default check); without it every file is hashed and, for a "
        "blend, every index value checked",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print each problem; exit 1 if there is any."""
    target = args.target
    if target.endswith(_DATASET_MANIFEST):
        problems = verify_dataset(target[: -len(_DATASET_MANIFEST)], full=not args.fast)
    elif target.endswith(".json"):
        from tokenmill.blend_manifest import verify_blend

        problems = verify_blend(target, full=not args.fast)
    else:
        p = Path(target)
        prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
        problems = verify_dataset(prefix, full=not args.fast)
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        return 1
    print(f"OK {target}")
    return 0
