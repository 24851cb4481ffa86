"""``<ds>/tokens``: one shard's Parquet export tokenized into a Megatron ``.bin``/``.idx`` pair.

Reads the validated Parquet (so bad lines were already quarantined upstream) and writes
``tokens/<ds>/<shard>_<text_key>_document.{bin,idx}`` + ``.manifest.json``, byte-identical to
Megatron ``preprocess_data.py`` on the shard's good lines. A backfill run tokenizes a range of
shards in one step (``assets/shards.py``), loading the engine and the reference checker once
for the range (``TokenizeSession``), not once per shard. A shard whose pair already records its
Parquet and settings is kept as it is (``kept``: a second run of one shard writes nothing).
"""

from typing import Any

from dagster import AssetExecutionContext, AssetKey, AssetsDefinition, MaterializeResult

from assets.metadata import token_dataset_metadata
from assets.shards import process_shards, shard_asset, shard_result, source_fingerprint
from assets.support.partitions import shard_partitions
from assets.support.resources import StorageResource, TokenizerResource, display_path
from assets.support.staleness import CONTENT_HASH, SETTINGS, tokens_settings
from tokenmill.recipe import DatasetConfig
from tokenmill.storage import layout
from tokenmill.tokenize.run import TokenizeSession, tokenize_files


def build_tokens(ds: DatasetConfig) -> AssetsDefinition:
    """The ``<ds>/tokens`` asset of one dataset."""

    @shard_asset(
        "tokens",
        key=AssetKey([ds.name, "tokens"]),
        deps=[AssetKey([ds.name, "hf_dataset"])],
        partitions_def=shard_partitions(ds.name),
        group_name=ds.name,
        kinds={"megatron"},
        description=f"{ds.name} shards tokenized (Megatron .bin/.idx, one sequence per document).",
    )
    def tokens(
        context: AssetExecutionContext, storage: StorageResource, tokenizer: TokenizerResource
    ) -> MaterializeResult:
        keys = context.partition_keys
        endpoint = storage.s3_endpoint_url

        def one(key: str) -> dict[str, Any]:
            result = tokenize_files(
                [ws.storage.parquet_path(ds.name, key)],
                ws.storage.tokens_output_prefix(ds.name, key),
                tokenizer.path,
                text_key=ds.text_key,
                append_eod=tokenizer.append_eod,
                workers=tokenizer.workers,
                on_bad_record="fail",
                progress=False,
                input_uri=display_path,
                session=session,
            )
            fingerprint = str(result.manifest["config"]["tokenizer_fingerprint"])
            seconds = None if result.reused else result.seconds  # no rate for a kept pair
            metadata = token_dataset_metadata(result.prefix, seconds=seconds, tokenizer=fingerprint)
            settings = tokens_settings(fingerprint, tokenizer.append_eod, ds)
            return {**metadata, "engine": result.engine, "kept": result.reused, SETTINGS: settings}

        parquets = [layout.parquet(ds.name, key) for key in keys]
        with (
            TokenizeSession() as session,
            storage.workspace(parquets) as ws,  # uploads the good shards' files, then fails
        ):
            done, failed = process_shards(
                context, one, fingerprint=lambda key: source_fingerprint(ds, key, endpoint)
            )
        return shard_result(context, done, failed, version=CONTENT_HASH)

    return tokens
