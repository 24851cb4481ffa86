"""Any supported input file or folder to record batches: JSONL shards or Parquet/Arrow tables.

The one entry point the stages call (tokenize, export): it dispatches on the name to the JSONL
reader (``records``) or the table reader (``tables``), which both build on ``records``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Unpack

from tokenmill.errors import ConfigError
from tokenmill.ingest.records import (
    JSONL_SUFFIXES,
    SUPPORTED_INPUTS,
    TABLE_SUFFIXES,
    Batch,
    ReadOptions,
    read_jsonl_batches,
)
from tokenmill.ingest.tables import read_table_batches


def read_input_batches(
    path: str | os.PathLike[str], **options: Unpack[ReadOptions]
) -> Iterator[Batch]:
    """Batches from any supported input: JSONL shards, or Parquet/Arrow files and folders."""
    name = os.fspath(path)
    if name.endswith(JSONL_SUFFIXES):
        return read_jsonl_batches(name, **options)
    if name.endswith(TABLE_SUFFIXES) or os.path.isdir(name):
        return read_table_batches(name, **options)
    raise ConfigError(f"{name}: unsupported input; expected a name ending in {SUPPORTED_INPUTS}")
