"""``tokenmill inspect``: counts, dtype, length histogram and decoded samples of a dataset;
for a blend, realized proportions against the weights and decoded samples of a split."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.commands.verify import classify
from tokenmill.errors import ConfigError
from tokenmill.formats.blend_manifest import SPLITS
from tokenmill.formats.dataset_manifest import open_dataset
from tokenmill.tokenize.stats import histogram_text, length_histogram, summarize

MAX_TOKENS = 2000  # --decode's default cut: a long document would flood the terminal


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``inspect`` subcommand."""
    p = sub.add_parser(
        "inspect",
        help="describe a .bin/.idx dataset or a blend",
        description="For a dataset (a .bin/.idx prefix or file, its manifest, a merged "
        "dataset's current.json or folder): documents, sequences, tokens, dtype and a sequence "
        "length histogram; --decode K prints sequence K as text. For a blend (its manifest.json "
        "or folder): each split's realized proportions against the weights; --decode K prints "
        "sample K of --split as text.",
    )
    p.add_argument("target", metavar="TARGET")
    p.add_argument(
        "--decode",
        type=int,
        action="append",
        default=[],
        metavar="K",
        help="decode sequence K of a dataset, or sample K of a blend's --split (repeatable; "
        "needs --tokenizer)",
    )
    p.add_argument("--tokenizer", metavar="DIR_OR_FILE", help="tokenizer for --decode")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=MAX_TOKENS,
        metavar="N",
        help="decode at most the first N tokens of each item, saying when it cut (0: all)",
    )
    p.add_argument("--split", choices=SPLITS, default="train", help="blend split for --decode")


def _decoder(path: str) -> Any:
    """A ``tokenizers.Tokenizer`` from a tokenizer folder or ``tokenizer.json``."""
    from tokenizers import Tokenizer

    from tokenmill.tokenize.tokenizer import resolve_tokenizer_path

    return Tokenizer.from_file(str(resolve_tokenizer_path(path)[1]))


def _print_decoded(
    args: argparse.Namespace, n: int, what: str, name: str, get: Callable[[int], Any]
) -> None:
    """Print the text of item ``get(k)`` (titled ``<name> k``) of each ``--decode k``, cut to
    ``--max-tokens``; ConfigError unless ``0 <= k < n`` (``what`` names the items)."""
    tok = _decoder(args.tokenizer)
    for k in args.decode:
        if not 0 <= k < n:
            raise ConfigError(f"--decode {k}: {what} " + (f"0..{n - 1}" if n else "none"))
        ids = get(k).tolist()
        print(f"--- {name} {k} ({len(ids)} tokens) ---")
        shown = ids[: args.max_tokens] if args.max_tokens > 0 else ids
        print(tok.decode(shown, skip_special_tokens=False))
        if len(shown) < len(ids):
            print(f"[... cut at {len(shown)} of {len(ids)} tokens; --max-tokens 0 prints all]")


def _blend(mpath: Path, args: argparse.Namespace) -> None:
    """Print the proportions table, then the decoded samples of ``--split``."""
    from tokenmill.commands.blend_report import describe_blend

    print(describe_blend(mpath))
    if not args.decode:
        return
    from tokenmill.loader import open_blend

    ds = open_blend(mpath, split=args.split)
    what = f"the blend's {args.split} split has samples"
    _print_decoded(args, len(ds), what, f"{args.split} sample", ds.__getitem__)


def _dataset(prefix: Path, args: argparse.Namespace) -> None:
    """Print counts, dtype and the length histogram, then the decoded sequences."""
    with open_dataset(prefix) as ds:
        ds.check_pointers()
        info = summarize(ds)
        width = max(len(k) for k in info)
        print(f"{ds.prefix}")
        for key, value in info.items():
            shown = f"{value:.1f}" if isinstance(value, float) else f"{value}"
            print(f"  {key:<{width}}  {shown}")
        print("  sequence length histogram:")
        print(
            "    " + histogram_text(length_histogram(ds.sequence_lengths)).replace("\n", "\n    ")
        )
        if args.decode:
            _print_decoded(args, len(ds), "the dataset has sequences", "sequence", ds.get)


def run(args: argparse.Namespace) -> int:
    """Print the description."""
    if args.decode and not args.tokenizer:
        raise ConfigError("--decode needs --tokenizer DIR_OR_FILE")
    if args.max_tokens < 0:
        raise ConfigError(f"--max-tokens {args.max_tokens}: expected >= 0 (0: no limit)")
    kind, path = classify(args.target)
    if kind == "hf":
        raise ConfigError(
            f"{args.target}: an HF export; inspect takes a .bin/.idx dataset or a blend "
            "(load the export with datasets.load_dataset('parquet', ...), check it with "
            "tokenmill verify)"
        )
    if kind == "blend":
        _blend(path, args)
    else:
        _dataset(path, args)
    return 0
