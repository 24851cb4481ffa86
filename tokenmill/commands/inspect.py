"""``tokenmill inspect``: counts, dtype, length histogram and decoded samples of a dataset;
for a blend ``manifest.json``, realized proportions against the weights."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.errors import ConfigError
from tokenmill.formats.indexed import IndexedDataset
from tokenmill.stats import histogram_text, length_histogram, summarize


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``inspect`` subcommand."""
    p = sub.add_parser("inspect", help="describe a .bin/.idx dataset or a blend manifest")
    p.add_argument("target", metavar="PREFIX_OR_MANIFEST")
    p.add_argument(
        "--decode",
        type=int,
        action="append",
        default=[],
        metavar="K",
        help="decode sequence K (repeatable; needs --tokenizer)",
    )
    p.add_argument("--tokenizer", metavar="DIR_OR_FILE")
    p.set_defaults(func=run)


def _prefix(target: str) -> Path:
    p = Path(target)
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def run(args: argparse.Namespace) -> int:
    """Print the description."""
    if args.target.endswith(".json"):
        from tokenmill.blend_manifest import describe_blend

        print(describe_blend(args.target))
        return 0
    if args.decode and not args.tokenizer:
        raise ConfigError("--decode needs --tokenizer DIR_OR_FILE")
    with IndexedDataset(_prefix(args.target)) as ds:
        ds.check_pointers()
        info = summarize(ds)
        width = max(len(k) for k in info)
        print(f"{ds.prefix}")
        for key, value in info.items():
            print(
                f"  {key:<{width}}  {value:.1f}"
                if isinstance(value, float)
                else f"  {key:<{width}}  {value}"
            )
        print("  sequence length histogram:")
        print(
            "    " + histogram_text(length_histogram(ds.sequence_lengths)).replace("\n", "\n    ")
        )
        if args.decode:
            from tokenizers import Tokenizer

            from tokenmill.tokenizer import resolve_tokenizer_path

            tok = Tokenizer.from_file(str(resolve_tokenizer_path(args.tokenizer)[1]))
            for k in args.decode:
                if not 0 <= k < len(ds):
                    raise ConfigError(f"--decode {k}: the dataset has sequences 0..{len(ds) - 1}")
                ids = ds.get(k).tolist()
                print(f"--- sequence {k} ({len(ids)} tokens) ---")
                print(tok.decode(ids, skip_special_tokens=False))
    return 0
