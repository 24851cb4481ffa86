"""The closing summary of ``tokenmill materialize``: counts from the artifacts (on disk, or the
mirror of an S3 root), where the blends are, how to open one (after ``tokenmill pull`` for an
S3 root), and how to start the UI."""

import contextlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dagster import AssetKey, DagsterInstance

from assets.support.partitions import shard_keys
from assets.support.resources import StorageResource
from tokenmill.errors import ConfigError
from tokenmill.formats.shard_records import read_record
from tokenmill.manifest import dataset_manifest_path, read_dataset_manifest
from tokenmill.nanoset import SPLITS
from tokenmill.recipe import DatasetConfig, Recipe


@dataclass
class DatasetOutcome:
    """What happened to one dataset's shards."""

    name: str
    shards: list[str]
    processed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


def shown(path: Path) -> str:
    """``path`` relative to the caller's directory (``tokenmill materialize`` passes it in
    ``$TOKENMILL_DISPLAY_DIR``; default the current one) when it is below it."""
    base = Path(os.environ.get("TOKENMILL_DISPLAY_DIR") or Path.cwd())
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


def dataset_line(
    recipe_ds: DatasetConfig,
    storage: StorageResource,
    outcome: DatasetOutcome,
    instance: DagsterInstance,
) -> str:
    """One line per dataset: shards, documents, quarantined lines and tokens."""
    documents = quarantined = 0
    for key in shard_keys(instance, recipe_ds):
        stats_path = storage.raw_stats_path(recipe_ds.name, key)
        if stats_path.is_file():
            stats = read_record(stats_path)
            documents += int(stats["documents"])
            quarantined += int(stats["quarantined"])
    tokens = "not merged"
    with contextlib.suppress(ConfigError):  # no pointer yet: never merged
        prefix = storage.merged_prefix(recipe_ds.name, recipe_ds.text_key)
        if dataset_manifest_path(prefix).is_file():
            tokens = f"{read_dataset_manifest(prefix)['counts']['tokens']:,} tokens"
    fresh = len(outcome.shards) - len(outcome.processed) - len(outcome.failed)
    text = (
        f"  {recipe_ds.name}: {len(outcome.shards)} shards ({len(outcome.processed)} processed, "
        f"{fresh} up to date, {len(outcome.failed)} failed, {len(outcome.removed)} removed) · "
        f"{documents:,} documents · {tokens} · {quarantined:,} quarantined lines"
    )
    notes = [f"    removed (gone from the source): {outcome.removed}"] if outcome.removed else []
    notes += [f"    failed: {outcome.failed}"] if outcome.failed else []
    notes += [f"    not a shard: {r}" for r in outcome.rejected]
    return "\n".join([text, *notes])


def blend_line(name: str, storage: StorageResource, where: Callable[[Path], str]) -> str | None:
    """One line per blend: samples per split and where its manifest is (None: not built)."""
    mpath = storage.blend_dir(name) / "manifest.json"
    if not mpath.is_file():
        return None
    manifest = json.loads(mpath.read_text(encoding="utf-8"))
    splits = manifest["splits"]
    sizes = " · ".join(f"{s} {splits[s]['size']:,}" for s in SPLITS if s in splits)
    length = manifest["sequence_length"]
    extra = " (+1 for the labels)" if manifest["add_extra_token"] else ""
    return f"  blend {name}: {sizes} samples, sequence length {length}{extra} -> {where(mpath)}"


def open_hint(manifest: str, name: str) -> list[str]:
    """How training code opens a blend: directly, or after pulling it from S3."""
    lines = ["", "Open a blend from training code:"]
    if manifest.startswith("s3://"):
        lines.append(f"    tokenmill pull {manifest} blend-{name}")
        manifest = f"blend-{name}/blends/{name}/manifest.json"
    lines += [
        "    from tokenmill.loader import open_blend",
        f'    ds = open_blend("{manifest}", split="train")',
    ]
    return lines


def print_summary(
    recipe: Recipe,
    storage: StorageResource,
    outcomes: Sequence[DatasetOutcome],
    rebuilt: Sequence[AssetKey],
    instance: DagsterInstance,
    where: Callable[[Path], str] = shown,
) -> None:
    """Print the summary block; ``where`` says where a path under ``storage`` really is."""
    print("\nSummary")
    for ds, outcome in zip(recipe.datasets, outcomes, strict=True):
        print(dataset_line(ds, storage, outcome, instance))
    print(f"  downstream rebuilt: {', '.join(k.to_user_string() for k in rebuilt) or 'nothing'}")
    built = []
    for blend in recipe.blends:
        line = blend_line(blend.name, storage, where)
        print(line or f"  blend {blend.name}: not built")
        if line is not None:
            built.append(blend.name)
    if built:
        mpath = storage.blend_dir(built[0]) / "manifest.json"
        print("\n".join(open_hint(where(mpath), built[0])))
    print("\nBrowse assets, runs, checks and metadata: make dev  (then http://127.0.0.1:3000)")
