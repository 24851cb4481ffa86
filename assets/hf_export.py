"""``<ds>/hf_dataset``: one shard exported to ``hf/<ds>/data/<shard>.parquet`` (every field kept).

``hf/<ds>/dataset_info.json`` is rewritten to describe the dataset's current shards, so
``datasets.load_dataset("parquet", data_files="hf/<ds>/data/*.parquet")`` sees the same data.
A backfill run exports a range of shards in one step (``assets/shards.py``).
"""

from typing import Any

from dagster import AssetExecutionContext, AssetKey, AssetsDefinition, MaterializeResult

from assets.metadata import path_value
from assets.shards import shard_asset, source_shards, step_result
from pipelines.partitions import partitions_name, shard_partitions
from pipelines.resources import StorageResource, Workspace
from pipelines.sources import ShardFile
from tokenmill._atomic import file_sha256
from tokenmill.export import export_shard, write_dataset_info
from tokenmill.recipe import DatasetConfig


def export_one(
    ws: Workspace, ds: DatasetConfig, shard: ShardFile, current: list[str]
) -> dict[str, Any]:
    """Export one shard into the workspace and rewrite ``dataset_info.json``; its metadata."""
    result = export_shard(
        ws.shard(shard).path,  # type: ignore[arg-type]
        ws.storage.hf_dir(ds.name),
        text_key=ds.text_key,
        on_bad_record=ds.on_bad_record,
        quarantine_path=ws.storage.quarantine_path(ds.name, shard.key),
        shard=shard.key,
    )
    # On S3 only the Parquet files of this step are at hand (fetching every sibling per shard
    # would be quadratic), so dataset_info.json lists the shards present; the merge rewrites it.
    parquets = [ws.storage.parquet_path(ds.name, k) for k in current]
    info = write_dataset_info(
        ws.storage.hf_dir(ds.name), features_from=[p for p in parquets if p.is_file()]
    )
    return {
        "documents": result.rows,
        "quarantined": result.stats.quarantined,
        "bytes": result.bytes,
        "content_hash": file_sha256(result.parquet_path),
        "path": path_value(result.parquet_path),
        "dataset_info": path_value(info),
    }


def build_hf_dataset(ds: DatasetConfig) -> AssetsDefinition:
    """The ``<ds>/hf_dataset`` asset of one dataset."""

    @shard_asset(
        "hf_dataset",
        key=AssetKey([ds.name, "hf_dataset"]),
        deps=[AssetKey([ds.name, "raw_jsonl"])],
        partitions_def=shard_partitions(ds.name),
        group_name=ds.name,
        kinds={"parquet"},
        description=f"{ds.name} shards as Parquet in the Hugging Face datasets layout.",
    )
    def hf_dataset(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        shards = source_shards(ds, context.partition_keys, storage.s3_endpoint_url)
        current = sorted(context.instance.get_dynamic_partitions(partitions_name(ds.name)))
        with storage.workspace() as ws:
            return step_result(
                {key: export_one(ws, ds, shard, current) for key, shard in shards.items()}
            )

    return hf_dataset
