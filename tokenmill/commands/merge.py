"""``tokenmill merge``: concatenate .bin/.idx datasets (Megatron merge_datasets.py, faster), or
make a merged version of tokenized shards as the pipeline does (``--versions``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.commands import throughput
from tokenmill.errors import ConfigError
from tokenmill.formats.merge import ORDERS, merge_datasets, resolve_inputs
from tokenmill.paths import document_stem
from tokenmill.tokenize.merged_versions import MERGE_MODES, merge_version


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``merge`` subcommand."""
    p = sub.add_parser(
        "merge",
        help="merge .bin/.idx datasets into one",
        description="Concatenate datasets in the order given (directories expand to their "
        "pairs in sorted order). Output dtype = first input's; mismatches are errors. With "
        "--versions DIR, tokenized shards become an immutable version DIR/<version>/ and "
        "DIR/current.json names it, as the pipeline's merged/<ds>/ (unchanged shards reuse "
        "their version; appended shards extend the current one).",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="DIR_OR_PREFIX")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--output-prefix", metavar="P")
    out.add_argument("--versions", metavar="DIR", help="a versions folder, as merged/<ds>/")
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="given",
        help="given (default), lexicographic (Megatron's sorted()), natural (part_2 < part_10)",
    )
    p.add_argument("--name", help="--versions: the dataset name in file names (default: DIR's)")
    p.add_argument("--text-key", help="--versions: the inputs' text key (default: text)")
    p.add_argument("--merge", choices=MERGE_MODES, help="--versions: the mode (default: virtual)")


def run(args: argparse.Namespace) -> int:
    """Merge and print a one-line summary."""
    if args.versions is not None:
        return _run_versions(args)
    for flag in ("name", "text_key", "merge"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} applies to --versions only")
    res = merge_datasets(args.input, args.output_prefix, order=args.order)
    print(
        f"merged {len(res.inputs)} inputs -> {res.prefix}: {res.documents} documents, "
        f"{res.sequences} sequences, {res.tokens} tokens, {res.bytes} bytes "
        f"in {res.seconds:.2f}s ({throughput(res.bytes, res.seconds)})"
    )
    return 0


def _run_versions(args: argparse.Namespace) -> int:
    """Each input's shard key is its name without ``_<text_key>_document`` (the pipeline's
    ``tokens/<ds>/<shard>_<text_key>_document``), so the same shards give the pipeline's version."""
    folder = Path(args.versions)
    name = args.name or folder.resolve().name
    text_key, merge = args.text_key or "text", args.merge or "virtual"
    suffix = document_stem("", text_key)  # "_<text_key>_document"
    shards = [(q.name.removesuffix(suffix), q) for q in resolve_inputs(args.input, args.order)]
    made = merge_version(folder, name, text_key, shards, merge=merge)
    how = "unchanged shards, reused" if made.reused else f"{merge} merge"
    if made.extends:
        how += f", extends {made.extends[:16]}"
    print(f"version {made.version[:16]} ({how}) -> {made.prefix}; {folder}/current.json names it")
    return 0
