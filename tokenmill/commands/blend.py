"""``tokenmill blend``: build a blend (index caches + blend arrays + manifest) without Dagster."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.blend_manifest import SEMANTICS, build_blend, describe_blend
from tokenmill.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``blend`` subcommand."""
    p = sub.add_parser(
        "blend",
        help="build a blend of merged datasets (indices, blend arrays, manifest.json)",
        description="Build each dataset's Nanoset index caches and the blend of them in "
        "OUTPUT (the blends/<name> directory; the name is its last component), then print "
        "the realized proportions. Weights are per dataset (--weight) or by token-count "
        "temperature (--temperature).",
    )
    p.add_argument(
        "--dataset",
        action="append",
        required=True,
        metavar="NAME=PREFIX",
        help="a merged .bin/.idx prefix, repeated; the order is the blend order",
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
    p.add_argument("--sequence-length", type=int, required=True, metavar="S")
    p.add_argument(
        "--split", default="949,50,1", help="train,valid,test split (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--train-samples", type=int, required=True, metavar="N")
    p.add_argument(
        "--valid-samples",
        type=int,
        metavar="N",
        help="default: one epoch of every dataset's valid split",
    )
    p.add_argument(
        "--test-samples",
        type=int,
        metavar="N",
        help="default: one epoch of every dataset's test split",
    )
    p.add_argument("--semantics", choices=SEMANTICS, default="megatron")
    p.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    """Build the blend and print its proportions table."""
    output = Path(args.output)
    manifest = build_blend(
        output.resolve().name,
        _pairs(args.dataset, "--dataset"),
        output,
        Path(args.cache_dir) if args.cache_dir else output / "cache",
        weights=_weights(args.weight) if args.weight else None,
        temperature=args.temperature,
        sequence_length=args.sequence_length,
        split_spec=args.split,
        seed=args.seed,
        train_samples=args.train_samples,
        valid_samples=args.valid_samples,
        test_samples=args.test_samples,
        semantics=args.semantics,
    )
    print(describe_blend(output))
    print(f"\nversion {manifest['version']} (versions/{manifest['version'][:16]}/)")
    return 0
