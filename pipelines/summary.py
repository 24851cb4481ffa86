"""The closing summary of ``tokenmill materialize``: counts from the artifacts on disk, where
the blends are, the two lines of Python that open one, and how to start the UI."""

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dagster import AssetKey, DagsterInstance

from assets.merged import shard_keys
from pipelines.resources import StorageResource
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
            stats = json.loads(stats_path.read_text(encoding="utf-8"))
            documents += int(stats["documents"])
            quarantined += int(stats["quarantined"])
    prefix = storage.merged_prefix(recipe_ds.name, recipe_ds.text_key)
    tokens = "not merged"
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


def blend_line(name: str, storage: StorageResource) -> tuple[str, Path | None]:
    """One line per blend: samples per split and the manifest path."""
    mpath = storage.blend_dir(name) / "manifest.json"
    if not mpath.is_file():
        return f"  blend {name}: not built", None
    manifest = json.loads(mpath.read_text(encoding="utf-8"))
    splits = manifest["splits"]
    sizes = " · ".join(f"{s} {splits[s]['size']:,}" for s in SPLITS if s in splits)
    width = manifest["sequence_length"] + int(manifest["add_extra_token"])
    return f"  blend {name}: {sizes} samples of {width} tokens -> {shown(mpath)}", mpath


def print_summary(
    recipe: Recipe,
    storage: StorageResource,
    outcomes: Sequence[DatasetOutcome],
    rebuilt: Sequence[AssetKey],
    instance: DagsterInstance,
) -> None:
    """Print the summary block."""
    print("\nSummary")
    for ds, outcome in zip(recipe.datasets, outcomes, strict=True):
        print(dataset_line(ds, storage, outcome, instance))
    print(f"  downstream rebuilt: {', '.join(k.to_user_string() for k in rebuilt) or 'nothing'}")
    manifests = []
    for blend in recipe.blends:
        line, mpath = blend_line(blend.name, storage)
        print(line)
        if mpath is not None:
            manifests.append(mpath)
    if manifests:
        print("\nOpen a blend from training code:")
        print("    from tokenmill.loader import open_blend")
        print(f'    ds = open_blend("{shown(manifests[0])}", split="train")')
    print("\nBrowse assets, runs, checks and metadata: make dev  (then http://127.0.0.1:3000)")
