"""The two small JSON records a shard's steps leave: raw stats and the export record.

``raw/<ds>/<shard>.stats.json`` (written last by the validating step: ``raw_jsonl``, or
``hf_dataset`` for an HF dataset on disk)::

    {format_version, shard, input: {uri, bytes, sha256}, config: {text_key, on_bad_record},
     lines, documents, blank, quarantined, ... (IngestStats counts),
     quarantine: null | {file, bytes, sha256}}

``hf/<ds>/shards/<shard>.json`` (written by ``hf_dataset`` after the Parquet)::

    {format_version, shard, file, num_rows, num_bytes, size, sha256, schema (base64 Arrow IPC),
     input, counts: {lines, documents, blank, quarantined}, config}

``raw/<ds>/<shard>.dochash.npy`` (written by ``raw_jsonl`` before the stats): each document's
:func:`text_digest`, uint8 ``[documents, 32]`` in document order, for ``tokenmill find sha256:``.

Nothing in them depends on when or where a run happened (same shard and config, same bytes).
Writers are atomic (temp → fsync → rename); readers name the file on damage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import atomic_open, file_sha256, load_json, write_json
from tokenmill.errors import FormatError

FORMAT_VERSION = 1  # of both records; bump on a change of their fields (independent of manifests)

INFO_COUNTS = ("lines", "documents", "blank", "quarantined")


@dataclass
class IngestStats:
    """Counts for one input file; invariant: ``lines == documents + quarantined + blank``."""

    path: str
    lines: int = 0
    documents: int = 0
    empty_documents: int = 0
    blank: int = 0
    quarantined: int = 0
    bytes_read: int = 0
    bom: bool = False
    crlf_lines: int = 0
    missing_final_newline: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form for manifests, metadata and stats files."""
        return dataclasses.asdict(self)


def shard_config(text_key: str, on_bad_record: str) -> dict[str, str]:
    """The config both records carry: what a reader compares with the current recipe."""
    return {"text_key": text_key, "on_bad_record": on_bad_record}


def raw_stats_record(
    shard: str,
    input_record: dict[str, Any],
    config: dict[str, str],
    stats: IngestStats,
    quarantine_path: Path | None,
) -> dict[str, Any]:
    """A shard's raw stats (module docstring); ``quarantine`` is None when no file was written
    (fail mode, or nothing quarantined)."""
    counts = stats.to_dict()
    del counts["path"]  # the input's uri says where it lives
    record: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "shard": shard,
        "input": input_record,
        "config": config,
        **counts,
        "quarantine": None,
    }
    if quarantine_path is not None and quarantine_path.is_file():
        record["quarantine"] = {
            "file": quarantine_path.name,
            "bytes": quarantine_path.stat().st_size,
            "sha256": file_sha256(quarantine_path),
        }
    return record


def export_record(
    shard: str, parquet: dict[str, Any], raw: dict[str, Any], config: dict[str, str]
) -> dict[str, Any]:
    """A shard's export record: its ``export.parquet_record`` and, from its raw stats, the
    input and the counts ``dataset_info.json`` sums."""
    return {
        "format_version": FORMAT_VERSION,
        "shard": shard,
        **parquet,
        "input": raw["input"],
        "counts": {k: raw[k] for k in INFO_COUNTS},
        "config": config,
    }


def write_record(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Write either record atomically (sorted keys, so the bytes are deterministic)."""
    write_json(path, record)


def read_record(path: str | os.PathLike[str], *, shown: str | None = None) -> dict[str, Any]:
    """Either record; FileNotFoundError if absent, FormatError naming ``shown`` (default: the
    path, e.g. its ``s3://`` URI instead) if it is not a JSON object."""
    return parse_record(Path(path).read_bytes(), shown or str(path))


def parse_record(data: bytes, shown: str) -> dict[str, Any]:
    """:func:`read_record` of bytes already read (e.g. from S3); errors name ``shown``."""
    record = load_json(data, shown)
    if not isinstance(record, dict):
        raise FormatError(shown, "json", f"not a shard record: {record!r:.80}")
    return record


def is_current(record: dict[str, Any], config: dict[str, str]) -> bool:
    """Whether a record was written by this format version under ``config``."""
    return record.get("format_version") == FORMAT_VERSION and record.get("config") == config


def text_digest(text: str) -> bytes:
    """sha256 of ``text`` NFC-normalized: a document's identity across Unicode forms. Whitespace
    is kept (collapsing it cost ~20 % of tokenize CPU): ``text:`` queries find re-wrapped copies."""
    if not unicodedata.is_normalized("NFC", text):  # most text is: skip the copy
        text = unicodedata.normalize("NFC", text)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def write_dochash(path: str | os.PathLike[str], digests: list[bytes]) -> None:
    """Write a shard's document hashes (``text_digest`` of each, in order) atomically."""
    array = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), 32)
    with atomic_open(path) as fh:
        np.save(fh, array, allow_pickle=False)


def read_dochash(path: str | os.PathLike[str], documents: int) -> np.ndarray:
    """A shard's document hashes, uint8 ``[documents, 32]``; FormatError naming the file when
    it is not that."""
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise FormatError(path, "dochash", f"not a readable .npy ({exc})") from exc
    if array.dtype != np.uint8 or array.shape != (documents, 32):
        raise FormatError(
            path, "dochash", f"expected uint8 [{documents}, 32], found {array.dtype} {array.shape}"
        )
    return array
