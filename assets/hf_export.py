"""``<ds>/hf_dataset``: one shard exported to ``hf/<ds>/data/<shard>.parquet`` (every field kept).

A JSONL dataset's shard must be the file ``<ds>/raw_jsonl`` validated: same place, size, sha256
and config as its ``raw/<ds>/<shard>.stats.json`` records. Its bad lines are skipped and counted,
never written again: the raw stage is the only writer of the quarantine file. An ``hf``-format
dataset (Parquet/Arrow files of an HF dataset on disk) enters here: it has no raw stage, so this
step validates its shard (a null text is a bad record) and writes the shard's quarantine and
stats itself, in the same form, stats last. ``hf/<ds>/dataset_info.json`` is rewritten to
describe the dataset's current shards, so
``datasets.load_dataset("parquet", data_files="hf/<ds>/data/*.parquet")`` sees the same data; its
``tokenmill`` key records the inputs, config and counts, taken from the raw stats files.
A backfill run exports a range of shards in one step (``assets/shards.py``).
"""

import json
from pathlib import Path
from typing import Any

from dagster import AssetExecutionContext, AssetKey, AssetsDefinition, MaterializeResult

from assets.metadata import path_value
from assets.raw import stamp, stats_record
from assets.shards import shard_asset, source_shards, step_result
from pipelines.partitions import partitions_name, shard_partitions
from pipelines.resources import StorageResource, Workspace, display_path
from pipelines.sources import ShardFile
from tokenmill._atomic import file_sha256, write_json
from tokenmill.errors import FormatError, InputError
from tokenmill.export import (
    INFO_COUNTS,
    ExportResult,
    export_shard,
    tokenmill_info,
    write_dataset_info,
)
from tokenmill.manifest import FORMAT_VERSION, input_sha256
from tokenmill.recipe import DatasetConfig


def read_raw_stats(storage: StorageResource, ds: DatasetConfig, key: str) -> dict[str, Any] | None:
    """A shard's stats as ``raw_jsonl`` writes them under the dataset's current config; None if
    the file is missing, written by an older tokenmill or under another config."""
    path = storage.raw_stats_path(ds.name, key)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise FormatError(display_path(path), "json", f"not a stats file: {exc}") from exc
    config = {"text_key": ds.text_key, "on_bad_record": ds.on_bad_record}
    if not isinstance(record, dict) or record.get("format_version") != FORMAT_VERSION:
        return None
    return record if record.get("config") == config else None


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


def write_export_info(
    storage: StorageResource, ds: DatasetConfig, keys: list[str]
) -> tuple[Path, list[str]]:
    """Rewrite ``hf/<ds>/dataset_info.json`` for the shards of ``keys`` (in that order) that
    have a Parquet file at hand, with each one's input and counts from its raw stats; the path,
    and the shards left out because their raw stats are not current (``read_raw_stats``)."""
    parquets, inputs, left_out = [], [], []
    for key in keys:
        parquet = storage.parquet_path(ds.name, key)
        if not parquet.is_file():
            continue
        raw = read_raw_stats(storage, ds, key)
        if raw is None:
            left_out.append(key)
            continue
        parquets.append(parquet)
        inputs.append({"shard": key, **raw["input"], "counts": {k: raw[k] for k in INFO_COUNTS}})
    extra = tokenmill_info(inputs, text_key=ds.text_key, on_bad_record=ds.on_bad_record)
    info = write_dataset_info(storage.hf_dir(ds.name), features_from=parquets, extra=extra)
    return info, left_out


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
    write_json(stats_path, record)
    return result, record


def export_one(
    context: AssetExecutionContext,
    ws: Workspace,
    ds: DatasetConfig,
    shard: ShardFile,
    current: list[str],
) -> dict[str, Any]:
    """Export one shard into the workspace (a JSONL shard once ``raw_jsonl`` validated it) and
    rewrite ``dataset_info.json``; its metadata."""
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
    # On S3 only the Parquet files of this step are at hand (fetching every sibling per shard
    # would be quadratic), so dataset_info.json lists the shards present; the merge rewrites it.
    info, left_out = write_export_info(ws.storage, ds, current)
    if left_out:
        context.log.warning(
            f"{display_path(info)} leaves out shards whose raw stats are not current: "
            f"{left_out}; materialize {ds.name}/raw_jsonl for them again"
        )
    return {
        "documents": result.rows,
        "quarantined": result.stats.quarantined,
        "bytes": result.bytes,
        "content_hash": file_sha256(result.parquet_path),
        "source_sha256": raw["input"]["sha256"],
        "path": path_value(result.parquet_path),
        "dataset_info": path_value(info),
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
        shards = source_shards(ds, keys, storage.s3_endpoint_url)
        current = sorted(context.instance.get_dynamic_partitions(partitions_name(ds.name)))
        stats = [f"raw/{ds.name}/{key}.stats.json" for key in keys] if ds.has_raw_stage else []
        with storage.workspace(stats) as ws:
            return step_result(
                {key: export_one(context, ws, ds, shard, current) for key, shard in shards.items()}
            )

    return hf_dataset
