"""``tokenmill index``: build (or reuse) the Nanoset index caches of one dataset's splits."""

from __future__ import annotations

import argparse

from tokenmill.commands import add_index_options
from tokenmill.errors import ConfigError
from tokenmill.indices.nanoset import SPLITS, build_or_load
from tokenmill.indices.settings import NanosetSettings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``index`` subcommand."""
    p = sub.add_parser(
        "index",
        help="build the train/valid/test document, sample and shuffle indices of a dataset",
        description="Build Megatron- or nanotron-compatible index caches for every non-empty "
        "split (valid and test cover one epoch), or growing ones (splits by document identity, "
        "extended as shards are appended). Existing caches with the same settings and data are "
        "reused.",
    )
    p.add_argument("--dataset", required=True, metavar="PREFIX", help=".bin/.idx prefix")
    p.add_argument("--cache-dir", required=True, metavar="DIR")
    add_index_options(p, train_help="default: one epoch")
    p.add_argument(
        "--no-extra-token",
        action="store_true",
        help="samples of S tokens instead of S+1 (megatron add_extra_token_to_sequence=False)",
    )
    p.add_argument(
        "--keep-last-partial-valid",
        action="store_true",
        help="keep the padded last valid sample (drop_last_partial_validation_sequence=False)",
    )


def run(args: argparse.Namespace) -> int:
    """Build each split's cache and print its samples, epochs, hash and files."""
    if args.train_samples is not None and args.train_samples < 1:
        raise ConfigError(
            f"--train-samples must be >= 1 (omit it for one epoch), got {args.train_samples}"
        )
    settings = NanosetSettings(
        sequence_length=args.sequence_length,
        split_spec=args.split,
        seed=args.seed,
        semantics=args.semantics,
        add_extra_token=not args.no_extra_token,
        drop_last_partial_validation=not args.keep_last_partial_valid,
        era_samples=args.era_samples,
        train_samples=args.train_samples,
    )
    for split in SPLITS:
        index = build_or_load(
            args.dataset, args.cache_dir, split, settings, settings.sizes()[split]
        )
        if index is None:
            print(f"{split}: empty split, no index")
            continue
        counts = index.description["counts"]
        if "num_epochs" in counts:
            how = f"{counts['num_epochs']} epoch(s)"
        else:  # growing: no epochs; the partial era waits for more data
            how = f"{counts['held_back_samples']} held back until the era fills"
        print(f"{split}: {len(index)} samples, {how}, cache {index.cache_hash}")
        for name, path in index.paths.items():
            print(f"  {name}: {path}")
    return 0
