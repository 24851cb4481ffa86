"""Resources: where artifacts live (``StorageResource``) and the tokenizer (``TokenizerResource``).

Assets resolve every path through ``StorageResource`` so the artifact layout (DESIGN §1) is
written down once. Only local roots are implemented; an ``s3://`` root is refused with a clear
message, and the methods return local paths so an S3 variant can stage files in and out later.
"""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource

from pipelines.partitions import check_partition_key
from tokenmill.errors import ConfigError
from tokenmill.tokenizer import TokenizerInfo, inspect_tokenizer


class StorageResource(ConfigurableResource):
    """The storage root (local directory) and the artifact layout under it."""

    root: str
    s3_endpoint_url: str | None = None

    def local_root(self) -> Path:
        """The root as a local directory; ConfigError for an S3 root (not in this build)."""
        if self.root.startswith("s3://"):
            raise ConfigError(
                f"storage.root {self.root}: S3 storage is not supported by this build yet; "
                "use a local directory"
            )
        return Path(self.root)

    def raw_stats_path(self, dataset: str, shard: str) -> Path:
        """``raw/<ds>/<shard>.stats.json``: validation counts of one shard."""
        return self.local_root() / "raw" / dataset / f"{check_partition_key(shard)}.stats.json"

    def quarantine_path(self, dataset: str, shard: str) -> Path:
        """``raw/<ds>/<shard>.quarantine.jsonl``: the shard's bad lines with line numbers."""
        key = check_partition_key(shard)
        return self.local_root() / "raw" / dataset / f"{key}.quarantine.jsonl"

    def hf_dir(self, dataset: str) -> Path:
        """``hf/<ds>``: the HF Parquet layout (``data/<shard>.parquet`` + ``dataset_info.json``)."""
        return self.local_root() / "hf" / dataset

    def parquet_path(self, dataset: str, shard: str) -> Path:
        """``hf/<ds>/data/<shard>.parquet``."""
        return self.hf_dir(dataset) / "data" / f"{check_partition_key(shard)}.parquet"

    def tokens_output_prefix(self, dataset: str, shard: str) -> Path:
        """``tokens/<ds>/<shard>``; the files are ``<that>_<text_key>_document.{bin,idx}``."""
        return self.local_root() / "tokens" / dataset / check_partition_key(shard)

    def tokens_prefix(self, dataset: str, shard: str, text_key: str) -> Path:
        """``tokens/<ds>/<shard>_<text_key>_document``: one shard's ``.bin``/``.idx`` prefix."""
        return Path(f"{self.tokens_output_prefix(dataset, shard)}_{text_key}_document")

    def merged_prefix(self, dataset: str, text_key: str) -> Path:
        """``merged/<ds>_<text_key>_document``: the dataset's merged ``.bin``/``.idx`` prefix."""
        return self.local_root() / "merged" / f"{dataset}_{text_key}_document"

    def nanoset_dir(self) -> Path:
        """``nanoset/``: the content-addressed index cache shared by datasets and blends."""
        return self.local_root() / "nanoset"

    def blend_dir(self, blend: str) -> Path:
        """``blends/<name>``: a blend's ``manifest.json`` and index arrays."""
        return self.local_root() / "blends" / blend


class TokenizerResource(ConfigurableResource):
    """A local tokenizer directory or ``tokenizer.json`` and how to run it."""

    path: str
    append_eod: bool = True
    workers: int = 1

    def info(self) -> TokenizerInfo:
        """Facts about the tokenizer (fingerprint, vocab, dtype); verified once, then cached."""
        return inspect_tokenizer(self.path)
