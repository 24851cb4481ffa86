"""Any supported input file or folder to record batches: JSONL shards or Parquet/Arrow tables.

The one entry point the stages call (tokenize, export): it dispatches on the name to the JSONL
reader (``records``) or the table reader (``tables``), which both build on ``records``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from tokenmill.errors import ConfigError
from tokenmill.formats.shard_records import IngestStats
from tokenmill.ingest.records import (
    JSONL_SUFFIXES,
    SUPPORTED_INPUTS,
    TABLE_SUFFIXES,
    Batch,
    Quarantine,
    read_jsonl_batches,
)
from tokenmill.ingest.tables import read_table_batches


def read_input_batches(
    path: str | os.PathLike[str],
    *,
    text_key: str = "text",
    on_bad_record: str = "fail",
    quarantine: Quarantine | None = None,
    stats: IngestStats | None = None,
    keep_records: bool = False,
    source_name: str | None = None,
) -> Iterator[Batch]:
    """Batches from any supported input: JSONL shards, or Parquet/Arrow files and folders;
    ``source_name`` (default: ``path``) is how bad records name their file."""
    name = os.fspath(path)
    options: dict[str, Any] = {
        "text_key": text_key,
        "on_bad_record": on_bad_record,
        "quarantine": quarantine,
        "stats": stats,
        "keep_records": keep_records,
        "source_name": source_name,
    }
    if name.endswith(JSONL_SUFFIXES):
        return read_jsonl_batches(name, **options)
    if name.endswith(TABLE_SUFFIXES) or os.path.isdir(name):
        return read_table_batches(name, **options)
    raise ConfigError(f"{name}: unsupported input; expected a name ending in {SUPPORTED_INPUTS}")
