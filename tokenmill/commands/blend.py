"""``tokenmill blend``: build a blend (index caches + blend arrays + manifest) without Dagster."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from tokenmill.commands import add_index_options
from tokenmill.commands.blend_report import describe_blend
from tokenmill.commands.verify import classify
from tokenmill.errors import ConfigError
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.blend_plan import skipped_warnings
from tokenmill.indices.settings import BlendSettings, NanosetSettings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``blend`` subcommand."""
    p = sub.add_parser(
        "blend",
        help="build a blend of merged datasets (indices, blend arrays, manifest.json)",
        description="Build each dataset's Nanoset index caches and the blend of them in "
        "OUTPUT (the blends/<name> directory; the name is its last component), then print "
        "the realized proportions. Weights are per dataset (--weight) or by token-count "
        "temperature (--temperature). A dataset whose split is empty is left out of that "
        "split with a warning (a split every dataset is empty in is absent).",
    )
    p.add_argument(
        "--dataset",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a merged .bin/.idx prefix, a merged dataset's version pointer (current.json) or "
        "its folder holding one (e.g. data/merged/docs: its current version), repeated; the "
        "order is the blend order",
    )
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--weight",
        action="append",
        metavar="NAME=W",
        help="weight of a dataset, repeated (normalized; need not sum to 1)",
    )
    group.add_argument(
        "--temperature", type=float, metavar="T", help="weights proportional to tokens**(1/T)"
    )
    p.add_argument("--output", required=True, metavar="DIR", help="the blends/<name> directory")
    p.add_argument(
        "--cache-dir", metavar="DIR", help="Nanoset index cache directory (default: OUTPUT/cache)"
    )
    add_index_options(
        p, train_help="train size; required unless --semantics growing (there: a cap, default none)"
    )
    for split in ("valid", "test"):
        help_text = f"default: one epoch of every dataset's {split} split"
        p.add_argument(f"--{split}-samples", type=int, metavar="N", help=help_text)
    p.add_argument(
        "--add-extra-token",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="samples of S+1 tokens overlapping by one (Megatron add_extra_token_to_sequence; "
        "--no-add-extra-token: S tokens; default: on)",
    )
    p.add_argument(
        "--drop-last-partial-validation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="drop the last partial valid sample (Megatron drop_last_partial_validation_"
        "sequence; --no-drop-last-partial-validation keeps it padded; train and test always "
        "drop; default: on)",
    )


def dataset_prefix(path: str) -> Path:
    """The ``.bin``/``.idx`` prefix a ``--dataset`` path names (any dataset path ``tokenmill
    verify`` takes: a prefix or either file, its manifest, a merged dataset's pointer or folder)."""
    kind, prefix = classify(path)
    if kind != "dataset":
        raise ConfigError(f"--dataset {path}: names a {kind}, not a .bin/.idx dataset")
    return prefix


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    """``["a=x", "b=y"]`` -> ``{"a": "x", "b": "y"}``; ConfigError if malformed or repeated."""
    out: dict[str, str] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name or not rest:
            raise ConfigError(f"{flag} expects NAME=VALUE, got {value!r}")
        if name in out:
            raise ConfigError(f"{flag} names {name!r} twice")
        out[name] = rest
    return out


def _weights(values: list[str]) -> dict[str, float]:
    """Parse ``--weight NAME=W`` values into floats."""
    weights = {}
    for name, text in _pairs(values, "--weight").items():
        try:
            weights[name] = float(text)
        except ValueError as exc:
            raise ConfigError(f"--weight {name}={text}: not a number") from exc
    return weights


def _settings(args: argparse.Namespace) -> BlendSettings:
    """The blend's settings as the command line gives them (an option per setting, ``--split``
    for ``split_spec``)."""
    same = [f.name for f in dataclasses.fields(NanosetSettings) if f.name != "split_spec"]
    nanoset = NanosetSettings(split_spec=args.split, **{name: getattr(args, name) for name in same})
    weights = _weights(args.weight) if args.weight else None
    return BlendSettings(nanoset, weights=weights, temperature=args.temperature)


def run(args: argparse.Namespace) -> int:
    """Build the blend and print its proportions table."""
    output = Path(args.output)
    manifest = build_blend(
        output.resolve().name,
        {n: dataset_prefix(p) for n, p in _pairs(args.dataset, "--dataset").items()},
        output,
        Path(args.cache_dir) if args.cache_dir else output / "cache",
        _settings(args),
    )
    for warning in skipped_warnings(manifest):
        print(f"warning: {warning}", file=sys.stderr)
    print(describe_blend(output))
    print(f"\nversion {manifest['version']} (versions/{manifest['version'][:16]}/)")
    if manifest["semantics"] == "growing":
        print(f"extends {manifest.get('extends') or 'nothing (built from scratch)'}")
    return 0
