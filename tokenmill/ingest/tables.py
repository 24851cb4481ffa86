"""Parquet/Arrow inputs (single files, folders, HF ``data/`` and ``save_to_disk`` layouts) as
text batches, with the same bad-record handling and counts as the JSONL reader."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenmill.errors import BadRecordError, ConfigError, FormatError, InputError
from tokenmill.formats.shard_records import IngestStats
from tokenmill.ingest.records import TABLE_SUFFIXES, Batch, Quarantine, check_bad_record_mode


def _table_files(path: str) -> list[Path]:
    """The Parquet/Arrow files of a table input, sorted by name (HF layouts included)."""
    p = Path(path)
    if not p.is_dir():
        if not p.is_file():
            raise InputError(f"{p}: no such file or folder")
        return [p]
    if (p / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in p.iterdir() if d.is_dir())
        raise ConfigError(
            f"{p}: holds several splits ({', '.join(splits)}); pass one split's folder instead"
        )
    for folder in (p, p / "data"):
        if folder.is_dir():
            files = [f for f in folder.iterdir() if f.is_file() and f.name.endswith(TABLE_SUFFIXES)]
            if files:
                return sorted(files)
    raise InputError(f"{p}: no .parquet or .arrow files in the folder or in its data/ subfolder")


def _check_text_column(path: str, schema: Any, text_key: str) -> None:
    import pyarrow as pa

    if schema.get_field_index(text_key) < 0:
        raise FormatError(path, text_key, f"no such column (columns: {schema.names})")
    kind = schema.field(text_key).type
    if not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"
    ):
        raise FormatError(path, text_key, f"column has type {kind}, expected a string column")


def _file_batches(
    path: Path, name: str, text_key: str, columns: list[str] | None, batch_rows: int
) -> Iterator[Any]:
    """Record batches of one Parquet or Arrow (IPC file or stream format) file; errors call
    it ``name``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.name.endswith(".parquet"):
            pf = pq.ParquetFile(path)
            _check_text_column(name, pf.schema_arrow, text_key)
            yield from pf.iter_batches(batch_size=batch_rows, columns=columns)
            return
        with pa.memory_map(str(path)) as source:
            is_file_format = source.read(6) == b"ARROW1"
            source.seek(0)
            reader = pa.ipc.open_file(source) if is_file_format else pa.ipc.open_stream(source)
            _check_text_column(name, reader.schema, text_key)
            if is_file_format:
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = iter(reader)
            for batch in batches:
                part = batch.select(columns) if columns else batch
                for offset in range(0, part.num_rows, batch_rows):
                    yield part.slice(offset, batch_rows)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{name}: cannot read table: {exc}") from exc


def read_table_batches(
    path: str | os.PathLike[str],
    *,
    text_key: str = "text",
    batch_rows: int = 8192,
    keep_records: bool = False,
    on_bad_record: str = "fail",
    quarantine: Quarantine | None = None,
    stats: IngestStats | None = None,
    source_name: str | None = None,
) -> Iterator[Batch]:
    """Stream a Parquet file, an Arrow file, or a folder of them (HF layouts) as batches.

    The text column must be a string column (``FormatError`` otherwise); a null text is a bad
    record named by file and 1-based row (quarantined as the row's JSON). ``Batch.first_line``
    counts rows across a folder's files. ``source_name`` (default: ``path``): how bad records
    name the input (a folder's files as ``<source_name>/<file name>``).
    """
    check_bad_record_mode(on_bad_record, quarantine)
    files = _table_files(os.fspath(path))
    st = stats if stats is not None else IngestStats(path=os.fspath(path))
    project = None if keep_records or on_bad_record == "quarantine" else [text_key]
    names = {f: str(f) for f in files}
    if source_name is not None:
        one = len(files) == 1 and not os.path.isdir(path)
        names = {f: source_name if one else f"{source_name.rstrip('/')}/{f.name}" for f in files}
    batch_rows = max(batch_rows, 1)

    def batches() -> Iterator[Batch]:
        import pyarrow.compute as pc

        row_base = 0
        for file in files:
            file_row = 0
            for batch in _file_batches(file, names[file], text_key, project, batch_rows):
                column = batch.column(text_key)
                texts = column.to_pylist()
                records = batch.to_pylist() if keep_records else None
                first_good = 0
                if column.null_count:
                    nulls = [i for i, t in enumerate(texts) if t is None]
                    for i in nulls:
                        _bad_row(names[file], file_row + i + 1, batch, i, on_bad_record, quarantine)
                    first_good = next(i for i, t in enumerate([*texts, ""]) if t is not None)
                    texts = [t for t in texts if t is not None]
                    if records is not None:
                        records = [r for r in records if r[text_key] is not None]
                    st.quarantined += len(nulls)
                st.lines += batch.num_rows
                st.documents += len(texts)
                st.empty_documents += texts.count("")
                st.bytes_read += pc.sum(pc.binary_length(column)).as_py() or 0
                if texts:
                    yield Batch(texts, records, row_base + file_row + first_good + 1)
                file_row += batch.num_rows
            row_base += file_row

    return batches()


def _bad_row(
    file: str, row: int, batch: Any, index: int, on_bad_record: str, quarantine: Quarantine | None
) -> None:
    if on_bad_record == "fail" or quarantine is None:
        raise BadRecordError(file, row, "text is null")
    record = batch.slice(index, 1).to_pylist()[0]
    raw = json.dumps(record, sort_keys=True, default=str, ensure_ascii=False).encode("utf-8")
    quarantine.add(file, row, "text is null", raw)


def document_rows(
    path: str | os.PathLike[str], text_key: str = "text", *, batch_rows: int = 8192
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(1-based row, record)`` of every row of a Parquet/Arrow input that becomes a document
    (those ``read_table_batches`` keeps, rows counted as its ``Batch.first_line``)."""
    row = 0
    for file in _table_files(os.fspath(path)):
        for batch in _file_batches(file, str(file), text_key, None, max(batch_rows, 1)):
            for record in batch.to_pylist():
                row += 1
                if record[text_key] is not None:
                    yield row, record
