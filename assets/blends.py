"""``blend/<name>``: a blend of merged datasets, ``blends/<name>/manifest.json`` + index arrays.

``tokenmill.loader.open_blend(".../blends/<name>/manifest.json", split="train")`` opens it. The
metadata compares each dataset's requested share with the realized share of every split.
"""

import contextlib
import hashlib
from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    AutomationCondition,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.metadata import path_value
from assets.nanoset import merged_version
from assets.support.pointers import BLEND_POOL, rerun_superseded
from assets.support.resources import StorageResource, Workspace
from assets.support.staleness import blend_data_version, nanoset_data_version
from tokenmill.errors import ConfigError, FormatError
from tokenmill.formats.blend_manifest import read_blend_manifest
from tokenmill.formats.takedown_records import blend_takedowns
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.blend_plan import skipped_warnings
from tokenmill.indices.blend_versioning import prepare_blend
from tokenmill.recipe import BlendConfig, DatasetConfig, NanosetConfig
from tokenmill.storage import layout
from tokenmill.storage.versions import pointer_version
from tokenmill.verify import Share, realized_shares

# What a blend stages of a merged dataset: its index and manifest, never the .bin.


def shares_markdown(shares: list[Share]) -> str:
    """The requested-vs-realized table (exhaustive splits follow dataset sizes by design)."""
    rows = ["| split | dataset | requested | realized | samples |", "|---|---|---:|---:|---:|"]
    for s in shares:
        split = s.split if s.weighted else f"{s.split} (exhaustive)"
        rows.append(
            f"| {split} | {s.dataset} | {s.requested:.4f} | {s.realized:.4f} | {s.samples} |"
        )
    return "\n".join(rows)


def stage_current_blend(ws: Workspace, name: str) -> None:
    """Growing semantics: stage the blend's current manifest and its version's arrays (a new
    version may extend it; a temperature blend continues its arrays). Nothing if there is none;
    a damaged pointer is left to the build, which then extends nothing."""
    ws.fetch([layout.blend_manifest(name)])
    mpath = ws.storage.path(layout.blend_manifest(name))
    if mpath.is_file():
        with contextlib.suppress(FormatError):
            version = str(read_blend_manifest(mpath)["version"])
            ws.fetch([f"{layout.blend_version_dir(name, version)}/"])


def refuse_vanishing(blend: BlendConfig, skips: dict[str, dict[str, str]]) -> None:
    """Fail the blend when a dataset it weights would get no sample in a split (its share
    would silently go to the others) unless the recipe allows it (``allow_empty_splits``)."""
    weights = blend.weight_map()
    lost = [
        f"{name} from split {split!r} ({reason})"
        for split, out in skips.items()
        for name, reason in out.items()
        if weights is None or weights[name] > 0
    ]
    if lost:
        raise Failure(
            description=f"blend {blend.name}: weighted datasets would get no sample: "
            f"{'; '.join(lost)}. Fix the data (e.g. a dataset left with 0 documents) or the "
            f"split, or set blends.{blend.name}.allow_empty_splits: true to build it anyway",
            metadata={"vanishing": MetadataValue.json(skips)},
        )


def build_blend_asset(
    blend: BlendConfig,
    cfg: NanosetConfig,
    datasets: list[DatasetConfig],
    automation_condition: AutomationCondition,
) -> AssetsDefinition:
    """The ``blend/<name>`` asset of one blend."""

    @asset(
        key=AssetKey(["blend", blend.name]),
        deps=[AssetKey([ds.name, "nanoset"]) for ds in datasets],
        group_name="blends",
        kinds={"numpy", "json"},
        automation_condition=automation_condition,
        description=f"Blend {blend.name} of {', '.join(blend.datasets)} ({cfg.semantics}).",
        pool=BLEND_POOL,
    )
    @rerun_superseded
    def blend_asset(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        if cfg.train_samples is None and cfg.semantics != "growing":
            raise ConfigError(f"blend {blend.name}: nanoset.train_samples must be set")
        pointers = [layout.merged_pointer(ds.name) for ds in datasets]
        with storage.workspace([layout.blend_manifest(blend.name), *pointers]) as ws:
            read = pointer_version(ws.storage.blend_dir(blend.name) / "manifest.json")
            keys = {ds.name: ws.storage.merged_key(ds.name, ds.text_key) for ds in datasets}
            for k in keys.values():
                ws.fetch_index(k)
            prefixes = {name: ws.storage.path(key) for name, key in keys.items()}
            members = [
                (ds.name, nanoset_data_version(merged_version(ws.storage, ds), cfg))
                for ds in datasets
            ]
            version = blend_data_version(blend, cfg, members)
            settings = blend.settings(cfg.settings())
            if cfg.semantics == "growing":  # the current version, which a new one may extend
                stage_current_blend(ws, blend.name)
            where = (prefixes, ws.storage.blend_dir(blend.name), ws.storage.nanoset_dir())
            prepared = prepare_blend(blend.name, *where, settings)
            if not blend.allow_empty_splits:
                refuse_vanishing(blend, prepared.skips())
            # An existing version is staged first, so an unchanged rebuild finds it complete
            # and neither rebuilds nor uploads it.
            ws.fetch([f"{layout.blend_version_dir(blend.name, prepared.version)}/"])
            manifest = build_blend(
                blend.name, *where, settings, fetch=ws.fetch_index_entry, expected=read
            )
            mpath = ws.storage.blend_dir(blend.name) / "manifest.json"
            shares = realized_shares(manifest, mpath)
            metadata: dict[str, Any] = {
                f"{split}_samples": info["size"] for split, info in manifest["splits"].items()
            }
            metadata.update(
                version=str(manifest["version"]),
                sequence_length=cfg.sequence_length,
                proportions=MetadataValue.md(shares_markdown(shares)),
                weights=MetadataValue.json(manifest["weighting"]),
                content_hash=hashlib.sha256(mpath.read_bytes()).hexdigest(),
                path=path_value(mpath),
            )
            taken = blend_takedowns(manifest)
            metadata["takedown_removed"] = taken["total"]
            if taken["records"]:  # the audit records: what was removed, when, why
                metadata["takedown"] = MetadataValue.json(taken)
                metadata["takedown_record"] = path_value(ws.storage.path(taken["records"][-1]))
            skipped = skipped_warnings(manifest)
            for warning in skipped:
                context.log.warning(warning)
            if skipped:
                metadata["skipped"] = MetadataValue.json(skipped)
            sizes = {split: info["size"] for split, info in manifest["splits"].items()}
            context.log.info(f"blend {blend.name}: samples per split {sizes}")
            return MaterializeResult(metadata=metadata, data_version=DataVersion(version))

    return blend_asset
