"""``tokenmill verify``: check a dataset, a blend or an HF export, named by any path a user holds
(a prefix, a ``.bin``/``.idx``, a manifest, a pointer, a folder)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.errors import ConfigError
from tokenmill.formats.dataset_manifest import prefix_of_manifest
from tokenmill.storage.layout import BLEND_MANIFEST, DATASET_MANIFEST_SUFFIX, POINTER_NAME
from tokenmill.storage.versions import pointer_target
from tokenmill.verify import verify_dataset, verify_dataset_info

DATASET_INFO = "dataset_info.json"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``verify`` subcommand."""
    p = sub.add_parser(
        "verify",
        help="check a dataset, blend or HF export for consistency (exit 1 on any problem)",
        description="TARGET is a .bin/.idx prefix (or either file, or its manifests/"
        "<name>.manifest.json); a merged dataset's current.json or folder (its current "
        "version); a blend's manifest.json or folder (blends/<name>, as open_blend and pull "
        "take it); or an HF export's dataset_info.json or folder.",
    )
    p.add_argument("target", metavar="TARGET")
    p.add_argument(
        "--fast",
        action="store_true",
        help="no hashing: sizes (and for a blend its manifest's own hash, schema and index "
        "records, as open_blend's default check); without it every file is hashed and, for a "
        "blend, every index value checked",
    )


def classify(target: str) -> tuple[str, Path]:
    """What ``target`` names: ``("dataset", prefix)``, ``("blend", manifest)`` or
    ``("hf", dataset_info.json)``; ConfigError for a folder that holds none of them, or for an
    ``s3://`` URI (these commands read local files; a ``Path`` would mangle the URI)."""
    if "://" in target:
        raise ConfigError(
            f"{target}: a URI, but this command reads local files; copy a blend with "
            f"`tokenmill pull {target} DIR` first, then give DIR"
        )
    path = Path(target)
    if path.is_dir():  # a folder: the first of these files in it
        names = (BLEND_MANIFEST, DATASET_INFO, POINTER_NAME)
        inside = next((path / name for name in names if (path / name).is_file()), None)
        if inside is None:
            raise ConfigError(
                f"{target}: a folder without {BLEND_MANIFEST} (a blend), {POINTER_NAME} (a merged "
                f"dataset) or {DATASET_INFO} (an HF export); for a .bin/.idx pair give its prefix"
            )
        path = inside
    if path.name == DATASET_INFO:
        return "hf", path
    if path.name == POINTER_NAME:
        prefix = pointer_target(path)
        if prefix is None:
            raise ConfigError(f"{path}: no such pointer (materialize the merged dataset first)")
        return "dataset", prefix
    if path.name.endswith(DATASET_MANIFEST_SUFFIX):
        return "dataset", prefix_of_manifest(path)
    if path.suffix == ".json":
        return "blend", path
    return "dataset", path.with_suffix("") if path.suffix in (".bin", ".idx") else path


def run(args: argparse.Namespace) -> int:
    """Print each problem; exit 1 if there is any."""
    kind, path = classify(args.target)
    if kind == "blend":
        from tokenmill.verify import verify_blend

        problems = verify_blend(path, full=not args.fast)
    elif kind == "hf":
        problems = verify_dataset_info(path, full=not args.fast)
    else:
        problems = verify_dataset(path, full=not args.fast)
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        return 1
    print(f"OK {args.target}")
    return 0
