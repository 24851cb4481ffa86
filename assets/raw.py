"""``<ds>/raw_jsonl``: validate one raw JSONL shard, quarantine its bad lines, record its counts.

Writes, in quarantine mode, ``raw/<ds>/<shard>.quarantine.jsonl`` when a line was quarantined
(none for a clean shard: its counts say 0; this step is its only writer), then
``raw/<ds>/<shard>.stats.json`` last: format version, the input (where it lives, size, sha256),
config, counts and the quarantine file's size and sha256 (null without one). With
``on_bad_record: fail`` the first bad line fails the run with ``FILE:LINE: reason``. A backfill
run validates a range of shards in one step (``assets/shards.py``).
"""

import contextlib
import time
from pathlib import Path
from typing import Any

import numpy as np
from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    MaterializeResult,
    MetadataValue,
)

from assets.metadata import histogram_md, path_value
from assets.shards import shard_asset, shard_step, source_fingerprint
from assets.support.partitions import shard_partitions
from assets.support.resources import StorageResource
from assets.support.sources import ShardFile, find_shard
from tokenmill.errors import InputError
from tokenmill.formats.dataset_manifest import input_sha256
from tokenmill.formats.shard_records import (
    IngestStats,
    raw_stats_record,
    shard_config,
    text_digest,
    write_dochash,
    write_record,
)
from tokenmill.ingest.records import Quarantine, read_jsonl_batches
from tokenmill.recipe import DatasetConfig
from tokenmill.storage import layout


def validate_shard(
    ds: DatasetConfig,
    shard: ShardFile,
    stats_path: Path,
    quarantine_path: Path,
    dochash_path: Path | None = None,
) -> tuple[dict[str, Any], np.ndarray]:
    """Read the whole shard once; write its quarantine and document hashes (``dochash_path``,
    for ``tokenmill find``), then its stats file (last); return the stats and text lengths.
    Nothing in the stats depends on when or where the step ran."""
    local = Path(shard.path)  # type: ignore[arg-type]
    stats = IngestStats(path=shard.location)
    quarantine = Quarantine(quarantine_path) if ds.on_bad_record == "quarantine" else None
    lengths: list[int] = []
    digests: list[bytes] = []
    with quarantine if quarantine is not None else contextlib.nullcontext():
        before = stamp(local)
        batches = read_jsonl_batches(
            local,
            text_key=ds.text_key,
            on_bad_record=ds.on_bad_record,
            quarantine=quarantine,
            stats=stats,
            source_name=shard.location,
        )
        for batch in batches:
            lengths.extend(map(len, batch.texts))
            if dochash_path is not None:
                digests.extend(map(text_digest, batch.texts))
        size, sha256 = local.stat().st_size, input_sha256(local)
        if stamp(local) != before:
            raise InputError(f"{shard.location}: changed while being validated; run again")
    record = stats_record(
        ds, shard, size, sha256, stats, quarantine_path if quarantine is not None else None
    )
    if dochash_path is not None:
        write_dochash(dochash_path, digests)
    write_record(stats_path, record)
    return record, np.asarray(lengths, dtype=np.int64)


def stats_record(
    ds: DatasetConfig,
    shard: ShardFile,
    size: int,
    sha256: str,
    stats: IngestStats,
    quarantine_path: Path | None,
) -> dict[str, Any]:
    """A shard's ``raw/<ds>/<shard>.stats.json`` content (``tokenmill.formats.shard_records``),
    naming the shard where it lives."""
    return raw_stats_record(
        shard.key,
        {"uri": shard.location, "bytes": size, "sha256": sha256},
        shard_config(ds.text_key, ds.on_bad_record),
        stats,
        quarantine_path,
    )


def stamp(path: Path) -> tuple[int, int]:
    """Size and mtime: a local source rewritten while it is read changes them."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def shard_metadata(
    context: AssetExecutionContext, ds: DatasetConfig, storage: StorageResource, shard: ShardFile
) -> dict[str, Any]:
    """Validate one shard in a workspace of its own (uploaded when done); its metadata."""
    key = shard.key
    with storage.workspace() as ws:
        stats_path = ws.storage.raw_stats_path(ds.name, key)
        quarantine_path = ws.storage.quarantine_path(ds.name, key)
        local = ws.shard(shard)
        start = time.perf_counter()
        dochash_path = ws.storage.path(layout.dochash(ds.name, key))
        record, lengths = validate_shard(ds, local, stats_path, quarantine_path, dochash_path)
        seconds = round(time.perf_counter() - start, 3)
        if record["quarantined"]:
            context.log.warning(f"{shard.location}: {record['quarantined']} bad lines quarantined")
        empty = not record["documents"]
        if empty:
            context.log.warning(f"{shard.location}: empty shard ({empty_reason(record)})")
        metadata: dict[str, Any] = {
            name: record[name]
            for name in ("lines", "documents", "blank", "quarantined", "empty_documents")
        }
        metadata.update(
            bytes=record["bytes_read"],
            source=MetadataValue.path(shard.uri) if shard.uri else path_value(shard.location),
            source_fingerprint=shard.fingerprint,
            source_sha256=record["input"]["sha256"],
            path=path_value(stats_path),
            length_histogram=histogram_md(lengths, "characters"),
            empty_shard=empty,
            seconds=seconds,
        )
        if record["quarantine"]:
            metadata["quarantine"] = path_value(quarantine_path)
        return metadata


def empty_reason(stats: dict[str, Any]) -> str:
    """Why a shard without documents is empty, from its stats: 0 bytes, or its lines."""
    if not stats["input"]["bytes"]:
        return "0 bytes"
    return f"0 documents in {stats['lines']} lines ({stats['blank']} blank, " + (
        f"{stats['quarantined']} quarantined)"
    )


def build_raw_jsonl(ds: DatasetConfig) -> AssetsDefinition:
    """The ``<ds>/raw_jsonl`` asset of one dataset."""

    @shard_asset(
        "raw_jsonl",
        key=AssetKey([ds.name, "raw_jsonl"]),
        partitions_def=shard_partitions(ds.name),
        group_name=ds.name,
        kinds={"jsonl"},
        description=f"Raw JSONL shards of {ds.name} from {ds.source}, validated; bad lines "
        f"{'quarantined' if ds.on_bad_record == 'quarantine' else 'fail the run'}.",
    )
    def raw_jsonl(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        endpoint = storage.s3_endpoint_url
        return shard_step(
            context,
            lambda key: shard_metadata(context, ds, storage, find_shard(ds, key, endpoint)),
            fingerprint=lambda key: source_fingerprint(ds, key, endpoint),
        )

    return raw_jsonl
