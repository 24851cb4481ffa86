"""``<ds>/hf_dataset``: one shard exported to ``hf/<ds>/data/<shard>.parquet`` (every field kept).

A JSONL dataset's shard must be the file ``<ds>/raw_jsonl`` validated: same place, size, sha256
and config as its ``raw/<ds>/<shard>.stats.json`` records. Its bad lines are skipped and counted,
never written again: the raw stage is the only writer of the quarantine file. An ``hf``-format
dataset (Parquet/Arrow files of an HF dataset on disk) enters here: it has no raw stage, so this
step validates its shard (a null text is a bad record) and writes the shard's quarantine and
stats itself, in the same form, stats last. Each shard step then writes its small export record
``hf/<ds>/shards/<shard>.json`` (rows, bytes, sha256, Arrow schema, input, counts) and touches no
other shard's files. A backfill run exports a range of shards in one step (``assets/shards.py``).

``<ds>/dataset_info`` (unpartitioned) assembles ``hf/<ds>/dataset_info.json`` for the dataset's
current shards that are exported (the others are left out and named) from those records alone, so
``datasets.load_dataset("parquet", data_files="hf/<ds>/data/*.parquet")`` sees the same data; its
``tokenmill`` key records the inputs, config and counts.
"""

import json
from pathlib import Path
from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    AutomationCondition,
    MaterializeResult,
    asset,
)

from assets.metadata import path_value
from assets.raw import stamp, stats_record
from assets.shards import process_shards, shard_asset, shard_result, source_fingerprint
from assets.support.complete import left_out_reasons, report_left_out
from assets.support.partitions import shard_keys, shard_partitions
from assets.support.pointers import DATASET_INFO_POOL
from assets.support.resources import StorageResource, Workspace, display_path
from assets.support.sources import ShardFile, find_shard
from assets.support.staleness import SOURCE_FINGERPRINT
from tokenmill.atomic import file_sha256
from tokenmill.errors import InputError
from tokenmill.formats.dataset_manifest import input_sha256
from tokenmill.formats.shard_records import (
    FORMAT_VERSION,
    export_record,
    is_current,
    read_record,
    shard_config,
    write_record,
)
from tokenmill.ingest.dataset_info import dataset_info_from_records, parquet_record, tokenmill_info
from tokenmill.ingest.export import ExportResult, export_shard
from tokenmill.recipe import DatasetConfig
from tokenmill.storage import layout


def read_raw_stats(storage: StorageResource, ds: DatasetConfig, key: str) -> dict[str, Any] | None:
    """A shard's stats as ``raw_jsonl`` writes them under the dataset's current config; None if
    the file is missing, written by an older tokenmill or under another config."""
    path = storage.raw_stats_path(ds.name, key)
    try:
        record = read_record(path, shown=display_path(path))
    except FileNotFoundError:
        return None
    return record if is_current(record, shard_config(ds.text_key, ds.on_bad_record)) else None


def validated_shard(
    ws: Workspace, ds: DatasetConfig, shard: ShardFile
) -> tuple[Path, dict[str, Any]]:
    """The shard as a local file and its raw stats; InputError unless ``raw_jsonl`` validated
    exactly this file under the current config."""
    stats_path = display_path(ws.storage.raw_stats_path(ds.name, shard.key))
    again = f"materialize {ds.name}/raw_jsonl for shard {shard.key} (again)"
    raw = read_raw_stats(ws.storage, ds, shard.key)
    if raw is None:
        raise InputError(
            f"{stats_path}: missing, written by an older tokenmill or under another config "
            f"than text_key={ds.text_key!r}, on_bad_record={ds.on_bad_record!r}; {again}"
        )
    local = Path(ws.shard(shard).path)  # type: ignore[arg-type]
    found = {"uri": shard.location, "bytes": local.stat().st_size, "sha256": input_sha256(local)}
    if found != raw["input"]:
        raise InputError(
            f"{shard.location}: {found['bytes']} bytes, sha256 {found['sha256']}, but "
            f"{stats_path} validated {raw['input']}: the shard changed since; {again}"
        )
    return local, raw


def write_export_record(
    storage: StorageResource, ds: DatasetConfig, key: str, parquet: Path, raw: dict[str, Any]
) -> dict[str, Any]:
    """Write ``hf/<ds>/shards/<shard>.json`` (the shard's Parquet record, input and counts from
    its raw stats) for the dataset's ``dataset_info.json``, which is assembled from these."""
    config = shard_config(ds.text_key, ds.on_bad_record)
    record = export_record(key, parquet_record(parquet, storage.hf_dir(ds.name)), raw, config)
    write_record(storage.export_record_path(ds.name, key), record)
    return record


def read_export_record(storage: StorageResource, ds: DatasetConfig, key: str) -> dict[str, Any]:
    """A shard's export record under the dataset's current config; InputError naming the file
    and what to run when it is missing, written by another tokenmill or under another config."""
    path = storage.export_record_path(ds.name, key)
    again = f"materialize {ds.name}/hf_dataset for shard {key}"
    try:
        record = read_record(path, shown=display_path(path))
    except FileNotFoundError:
        raise InputError(f"{display_path(path)}: missing; {again}") from None
    if record.get("format_version") != FORMAT_VERSION:
        raise InputError(f"{display_path(path)}: written by another tokenmill; {again}")
    if not is_current(record, shard_config(ds.text_key, ds.on_bad_record)) or (
        record.get("shard") != key
    ):
        raise InputError(f"{display_path(path)}: made under another config; {again}")
    return record


def write_dataset_info(storage: StorageResource, ds: DatasetConfig, keys: list[str]) -> Path:
    """``hf/<ds>/dataset_info.json`` for the shards ``keys`` (in that order), assembled from
    their export records alone (no Parquet is opened)."""
    records = [read_export_record(storage, ds, key) for key in keys]
    inputs = [{"shard": r["shard"], **r["input"], "counts": r["counts"]} for r in records]
    extra = tokenmill_info(inputs, text_key=ds.text_key, on_bad_record=ds.on_bad_record)
    return dataset_info_from_records(storage.hf_dir(ds.name), records, extra=extra)


def export_table_shard(
    ws: Workspace, ds: DatasetConfig, shard: ShardFile
) -> tuple[ExportResult, dict[str, Any]]:
    """Validate and export one shard of an ``hf``-format dataset: its Parquet, then its
    quarantine (in quarantine mode, even empty) and raw stats, the stats last; the old stats go
    first, so they never vouch for a new Parquet."""
    stats_path = ws.storage.raw_stats_path(ds.name, shard.key)
    stats_path.unlink(missing_ok=True)
    local = Path(ws.shard(shard).path)  # type: ignore[arg-type]
    before = stamp(local)
    size, sha256 = local.stat().st_size, input_sha256(local)
    quarantine = None
    if ds.on_bad_record == "quarantine":
        quarantine = ws.storage.quarantine_path(ds.name, shard.key)
    result = export_shard(
        local,
        ws.storage.hf_dir(ds.name),
        text_key=ds.text_key,
        on_bad_record=ds.on_bad_record,
        quarantine_path=quarantine,
        shard=shard.key,
        source_name=shard.location,
    )
    if stamp(local) != before:
        raise InputError(f"{shard.location}: changed while being exported; run again")
    record = stats_record(ds, shard, size, sha256, result.stats, quarantine)
    write_record(stats_path, record)
    return result, record


def export_one(
    context: AssetExecutionContext,
    ws: Workspace,
    ds: DatasetConfig,
    shard: ShardFile,
) -> dict[str, Any]:
    """Export one shard into the workspace (a JSONL shard once ``raw_jsonl`` validated it) and
    write its export record; its metadata."""
    ws.storage.export_record_path(ds.name, shard.key).unlink(missing_ok=True)
    if not ds.has_raw_stage:
        result, raw = export_table_shard(ws, ds, shard)
        bad = result.stats.quarantined
        if bad:
            context.log.warning(f"{shard.location}: {bad} bad rows quarantined")
    else:
        local, raw = validated_shard(ws, ds, shard)
        result = export_shard(
            local,
            ws.storage.hf_dir(ds.name),
            text_key=ds.text_key,
            on_bad_record=ds.on_bad_record,
            shard=shard.key,
            write_quarantine=False,
        )
    write_export_record(ws.storage, ds, shard.key, result.parquet_path, raw)
    return {
        "documents": result.rows,
        "quarantined": result.stats.quarantined,
        "bytes": result.bytes,
        "content_hash": file_sha256(result.parquet_path),
        "source_sha256": raw["input"]["sha256"],
        SOURCE_FINGERPRINT: shard.fingerprint,
        "path": path_value(result.parquet_path),
    }


def build_hf_dataset(ds: DatasetConfig) -> AssetsDefinition:
    """The ``<ds>/hf_dataset`` asset of one dataset."""

    description = f"{ds.name} shards as Parquet in the Hugging Face datasets layout."
    if not ds.has_raw_stage:
        description = f"{ds.name}: the HF dataset in {ds.source}, validated, as Parquet shards."

    @shard_asset(
        "hf_dataset",
        key=AssetKey([ds.name, "hf_dataset"]),
        deps=[AssetKey([ds.name, "raw_jsonl"])] if ds.has_raw_stage else [],
        partitions_def=shard_partitions(ds.name),
        group_name=ds.name,
        kinds={"parquet"},
        description=description,
    )
    def hf_dataset(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        keys = context.partition_keys
        endpoint = storage.s3_endpoint_url
        stats = [layout.raw_stats(ds.name, key) for key in keys] if ds.has_raw_stage else []
        with storage.workspace(stats) as ws:  # uploads the good shards' files, then fails
            done, failed = process_shards(
                context,
                lambda key: export_one(context, ws, ds, find_shard(ds, key, endpoint)),
                fingerprint=lambda key: source_fingerprint(ds, key, endpoint),
            )
        return shard_result(context, done, failed)

    return hf_dataset


def build_dataset_info(
    ds: DatasetConfig, automation_condition: AutomationCondition
) -> AssetsDefinition:
    """The ``<ds>/dataset_info`` asset: ``hf/<ds>/dataset_info.json`` from the export records."""

    @asset(
        key=AssetKey([ds.name, "dataset_info"]),
        deps=[AssetKey([ds.name, "hf_dataset"])],
        group_name=ds.name,
        kinds={"json"},
        automation_condition=automation_condition,
        description=f"hf/{ds.name}/dataset_info.json of the current shards (from their records).",
        pool=DATASET_INFO_POOL,
    )
    def dataset_info(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        registered = shard_keys(context.instance, ds)
        with storage.workspace([f"{layout.hf_dir(ds.name)}/shards/"]) as ws:
            # Shards not exported yet (new, in progress, failed) are left out and named.
            keys = [k for k in registered if ws.storage.export_record_path(ds.name, k).is_file()]
            missing = [k for k in registered if k not in set(keys)]
            report_left_out(context, ds, keys, left_out_reasons(context.instance, ds, missing))
            path = write_dataset_info(ws.storage, ds, keys)
            info = json.loads(path.read_text(encoding="utf-8"))
            return MaterializeResult(
                metadata={
                    "shards": len(keys),
                    "rows": info["splits"]["train"]["num_examples"],
                    "bytes": info["download_size"],
                    "path": path_value(path),
                }
            )

    return dataset_info
