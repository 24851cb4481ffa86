"""The closing summary of ``tokenmill materialize``: counts from the records the steps left in
the Dagster instance (the same records the staleness model reads; no artifact is opened, so an
S3 root costs nothing here), where the blends are, how to open one (after ``tokenmill pull``
for an S3 root), and how to start the UI."""

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagster import AssetKey, DagsterInstance, EventLogRecord

from assets.support.partitions import shard_keys
from assets.support.staleness import latest_records
from pipelines.instance import DEFAULT_HOME, REPO_ROOT
from pipelines.jobs import shard_stages
from tokenmill.indices.nanoset import SPLITS
from tokenmill.recipe import DEFAULT_RECIPE, RECIPE_ENV, DatasetConfig, NanosetConfig, Recipe


@dataclass
class DatasetOutcome:
    """What happened to one dataset's shards."""

    name: str
    shards: list[str]
    processed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


def shown(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the caller's directory (``tokenmill materialize`` passes it in
    ``$TOKENMILL_DISPLAY_DIR``; default the current one) when it is below it."""
    base = Path(os.environ.get("TOKENMILL_DISPLAY_DIR") or Path.cwd())
    try:
        return str(Path(path).resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


def _metadata(record: EventLogRecord | None) -> dict[str, Any]:
    materialization = record.asset_materialization if record else None
    return {k: v.value for k, v in materialization.metadata.items()} if materialization else {}


def dataset_line(ds: DatasetConfig, outcome: DatasetOutcome, instance: DagsterInstance) -> str:
    """One line per dataset: shards, documents, quarantined lines and tokens."""
    keys = shard_keys(instance, ds)
    first = AssetKey([ds.name, shard_stages(ds)[0]])
    documents = quarantined = 0
    for record in latest_records(instance, first, keys).values():
        meta = _metadata(record)
        documents += int(meta.get("documents", 0))
        quarantined += int(meta.get("quarantined", 0))
    merged = _metadata(instance.get_latest_data_version_record(AssetKey([ds.name, "merged"])))
    tokens = f"{merged['tokens']:,} tokens" if "tokens" in merged else "not merged"
    fresh = len(outcome.shards) - len(outcome.processed) - len(outcome.failed)
    text = (
        f"  {ds.name}: {len(outcome.shards)} shards ({len(outcome.processed)} processed, "
        f"{fresh} up to date, {len(outcome.failed)} failed, {len(outcome.removed)} removed) · "
        f"{documents:,} documents · {tokens} · {quarantined:,} quarantined lines"
    )
    notes = [f"    removed (gone from the source): {outcome.removed}"] if outcome.removed else []
    notes += [f"    failed: {outcome.failed}"] if outcome.failed else []
    notes += [f"    not a shard: {r}" for r in outcome.rejected]
    return "\n".join([text, *notes])


def blend_line(name: str, cfg: NanosetConfig, instance: DagsterInstance) -> tuple[str, str] | None:
    """One line per blend (samples per split, where its manifest is) and that place; None when
    the blend was never built."""
    meta = _metadata(instance.get_latest_data_version_record(AssetKey(["blend", name])))
    if "path" not in meta:
        return None
    where = str(meta["path"]) if str(meta["path"]).startswith("s3://") else shown(meta["path"])
    sizes = " · ".join(f"{s} {meta[f'{s}_samples']:,}" for s in SPLITS if f"{s}_samples" in meta)
    extra = " (+1 for the labels)" if cfg.add_extra_token else ""
    line = f"  blend {name}: {sizes} samples, sequence length {cfg.sequence_length}{extra}"
    return f"{line} -> {where}", where


def open_hint(manifest: str, name: str, endpoint_url: str | None = None) -> list[str]:
    """How training code opens a blend: directly, or after pulling it from S3 (through
    ``endpoint_url`` when the recipe's storage names one)."""
    lines = ["", "Open a blend from training code:"]
    if manifest.startswith("s3://"):
        endpoint = f" --endpoint-url {endpoint_url}" if endpoint_url else ""
        lines.append(f"    tokenmill pull {manifest} blend-{name}{endpoint}")
        manifest = f"blend-{name}/blends/{name}/manifest.json"
    lines += [
        "    from tokenmill.loader import open_blend",
        f'    ds = open_blend("{manifest}", split="train")',
    ]
    return lines


def dev_hint(recipe: Path, dagster_home: Path) -> str:
    """How to browse this run in the UI: ``make dev``, with ``TOKENMILL_RECIPE`` and
    ``DAGSTER_HOME`` set when either differs from the default (else the UI shows the demo)."""
    env = ""
    if recipe.resolve() != (REPO_ROOT / DEFAULT_RECIPE).resolve() or (
        dagster_home.resolve() != DEFAULT_HOME.resolve()
    ):
        quoted = shlex.quote(str(recipe)), shlex.quote(str(dagster_home))
        env = f"{RECIPE_ENV}={quoted[0]} DAGSTER_HOME={quoted[1]} "
    return f"Browse assets, runs, checks and metadata: {env}make dev  (then http://127.0.0.1:3000)"


def print_summary(
    recipe: Recipe,
    outcomes: Sequence[DatasetOutcome],
    rebuilt: Sequence[AssetKey],
    instance: DagsterInstance,
) -> None:
    """Print the summary block."""
    print("\nSummary")
    for ds, outcome in zip(recipe.datasets, outcomes, strict=True):
        print(dataset_line(ds, outcome, instance))
    print(f"  downstream rebuilt: {', '.join(k.to_user_string() for k in rebuilt) or 'nothing'}")
    built = []
    for blend in recipe.blends:
        found = blend_line(blend.name, recipe.nanoset, instance)
        print(found[0] if found else f"  blend {blend.name}: not built")
        if found:
            built.append((blend.name, found[1]))
    if built:
        name, where = built[0]
        print("\n".join(open_hint(where, name, recipe.storage.s3_endpoint_url)))
    home = Path(os.environ.get("DAGSTER_HOME") or DEFAULT_HOME)
    print("\n" + dev_hint(recipe.path, home))
