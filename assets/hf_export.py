"""``<ds>/hf_dataset``: one shard exported to ``hf/<ds>/data/<shard>.parquet`` (every field kept).

``hf/<ds>/dataset_info.json`` is rewritten to describe the dataset's current shards, so
``datasets.load_dataset("parquet", data_files="hf/<ds>/data/*.parquet")`` sees the same data.
"""

from dagster import AssetExecutionContext, AssetKey, AssetsDefinition, MaterializeResult, asset

from assets.metadata import path_value
from pipelines.partitions import partitions_name, shard_partitions
from pipelines.resources import StorageResource
from pipelines.sources import find_shard
from tokenmill._atomic import file_sha256
from tokenmill.export import export_shard, write_dataset_info
from tokenmill.recipe import DatasetConfig


def build_hf_dataset(ds: DatasetConfig) -> AssetsDefinition:
    """The ``<ds>/hf_dataset`` asset of one dataset."""

    @asset(
        key=AssetKey([ds.name, "hf_dataset"]),
        deps=[AssetKey([ds.name, "raw_jsonl"])],
        partitions_def=shard_partitions(ds.name),
        group_name=ds.name,
        kinds={"parquet"},
        description=f"{ds.name} shards as Parquet in the Hugging Face datasets layout.",
    )
    def hf_dataset(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        key = context.partition_key
        shard = find_shard(ds, key, storage.s3_endpoint_url)
        current = sorted(context.instance.get_dynamic_partitions(partitions_name(ds.name)))
        # On S3 only this shard's Parquet is at hand (fetching every sibling per shard would be
        # quadratic), so dataset_info.json lists the shards present; the merge rewrites it whole.
        with storage.workspace() as ws:
            result = export_shard(
                ws.shard(shard).path,  # type: ignore[arg-type]
                ws.storage.hf_dir(ds.name),
                text_key=ds.text_key,
                on_bad_record=ds.on_bad_record,
                quarantine_path=ws.storage.quarantine_path(ds.name, key),
                shard=key,
            )
            parquets = [ws.storage.parquet_path(ds.name, k) for k in current]
            info = write_dataset_info(
                ws.storage.hf_dir(ds.name), features_from=[p for p in parquets if p.is_file()]
            )
            return MaterializeResult(
                metadata={
                    "documents": result.rows,
                    "quarantined": result.stats.quarantined,
                    "bytes": result.bytes,
                    "content_hash": file_sha256(result.parquet_path),
                    "path": path_value(result.parquet_path),
                    "dataset_info": path_value(info),
                }
            )

    return hf_dataset
