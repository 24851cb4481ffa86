"""HF dataset export: an input shard -> ``<dir>/data/<shard>.parquet`` (``dataset_info`` describes
the shards in ``<dir>/dataset_info.json``).

Loads with ``datasets.load_dataset("parquet", ...)`` and plain pyarrow; every input field is kept.
Two streaming passes: the first validates and infers one schema for the shard (a missing field is
null), the second writes row groups of ``row_group_rows`` rows. A field whose values share no
Arrow type (an int and a string, an empty object) is stored as JSON text and listed under
``json_encoded_fields`` in the Parquet metadata. Same input and settings -> same bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.atomic import (
    commit,
    create_temp,
    name_os_errors,
    remove_stale_temps,
    remove_temp_dir,
)
from tokenmill.errors import ConfigError, InputError
from tokenmill.formats.shard_records import IngestStats
from tokenmill.ingest.records import Batch, Quarantine, shard_name
from tokenmill.ingest.sources import read_input_batches
from tokenmill.paths import name_problem

DEFAULT_ROW_GROUP_ROWS = 1000
PARQUET_COMPRESSION = "zstd"
JSON_FIELDS_KEY = b"tokenmill.json_encoded_fields"
_CONVERSION_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)
# How a pass reads the input: with this sink for bad lines, counting into these stats.
_Reader = Callable[[Quarantine | None, IngestStats], Iterator[Batch]]


@dataclass
class ExportResult:
    """What ``export_shard`` wrote."""

    parquet_path: Path
    stats: IngestStats
    rows: int
    bytes: int
    quarantine_path: Path | None


@dataclass
class _Plan:
    """The shard's schema as learned by the first pass."""

    text_key: str
    order: dict[str, None] = field(default_factory=dict)
    types: dict[str, pa.DataType] = field(default_factory=dict)
    as_json: set[str] = field(default_factory=set)

    def schema(self) -> pa.Schema:
        names = list(self.order) if self.text_key in self.order else [self.text_key, *self.order]
        strings = {self.text_key, *self.as_json}
        fields = [
            pa.field(n, pa.string() if n in strings else self.types.get(n, pa.null()))
            for n in names
        ]
        metadata = {JSON_FIELDS_KEY: json.dumps(sorted(self.as_json)).encode()}
        return pa.schema(fields, metadata=metadata if self.as_json else None)

    def to_json(self, name: str) -> None:
        self.as_json.add(name)
        self.types.pop(name, None)


class _AlreadyQuarantined(Quarantine):
    """A sink that only counts bad lines: the first pass (or the validation step that owns the
    quarantine file) quarantined them."""

    def add(self, source: str, line: int, reason: str, raw: bytes) -> None:
        self._count += 1


class _Unconvertible(Exception):
    """A value of the field ``args[0]`` does not fit its inferred type (e.g. int -> float loss)."""


def _parquet_ok(kind: pa.DataType) -> bool:
    """Parquet cannot store a struct without fields (an empty JSON object)."""
    if pa.types.is_struct(kind):
        return kind.num_fields > 0 and all(_parquet_ok(f.type) for f in kind)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _parquet_ok(kind.value_type)
    return True


def _unify(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    if a == b:
        return a
    try:
        merged = pa.unify_schemas(
            [pa.schema([pa.field("x", a)]), pa.schema([pa.field("x", b)])],
            promote_options="permissive",
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    return merged.field("x").type


def _learn(plan: _Plan, records: list[dict[str, Any]]) -> None:
    """Fold one batch's field types into the plan."""
    for name in dict.fromkeys(k for r in records for k in r):
        plan.order.setdefault(name)
        if name == plan.text_key or name in plan.as_json:
            continue
        try:
            kind = pa.array([r.get(name) for r in records]).type
        except _CONVERSION_ERRORS:
            plan.to_json(name)
            continue
        previous = plan.types.get(name)
        merged = kind if previous is None else _unify(previous, kind)
        if merged is None or not _parquet_ok(merged):
            plan.to_json(name)
        else:
            plan.types[name] = merged


def _table(batch: Batch, schema: pa.Schema, plan: _Plan) -> pa.Table:
    records = batch.records or []
    columns = []
    for f in schema:
        if f.name == plan.text_key:
            columns.append(pa.array(batch.texts, type=pa.string()))
            continue
        if f.name in plan.as_json:
            values: list[Any] = [
                orjson.dumps(r[f.name]).decode() if f.name in r else None for r in records
            ]
        else:
            values = [r.get(f.name) for r in records]
        try:
            columns.append(pa.array(values, type=f.type))
        except _CONVERSION_ERRORS as exc:
            raise _Unconvertible(f.name) from exc
    return pa.Table.from_arrays(columns, schema=schema)


def _write(read: _Reader, tmp: Path, plan: _Plan, row_group_rows: int) -> IngestStats:
    """Second pass: stream the records into ``tmp`` in row groups of ``row_group_rows``; bad
    lines, quarantined by the first pass, are only counted."""
    schema = plan.schema()
    stats = IngestStats(path=tmp.name)
    options = {"compression": PARQUET_COMPRESSION, "use_dictionary": False}
    with pq.ParquetWriter(tmp, schema, write_statistics=False, **options) as writer:
        pending: list[pa.Table] = []
        rows = 0
        for batch in read(_AlreadyQuarantined(os.devnull), stats):
            pending.append(_table(batch, schema, plan))
            rows += len(batch.texts)
            while rows >= row_group_rows:
                combined = pa.concat_tables(pending)
                writer.write_table(combined.slice(0, row_group_rows), row_group_size=row_group_rows)
                pending = [combined.slice(row_group_rows)]
                rows -= row_group_rows
        if rows:
            writer.write_table(pa.concat_tables(pending), row_group_size=rows)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    return stats


def export_shard(
    input_path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    text_key: str = "text",
    on_bad_record: str = "fail",
    quarantine_path: str | os.PathLike[str] | None = None,
    shard: str | None = None,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
    write_quarantine: bool = True,
    source_name: str | None = None,
) -> ExportResult:
    """Write ``output_dir/data/<shard>.parquet`` atomically from one input shard (nothing left
    there on failure). Bad lines raise ``BadRecordError`` (``fail``) or go to ``quarantine_path``
    (default ``output_dir/<shard>.quarantine.jsonl``, written only if not empty); with
    ``write_quarantine=False`` only counted (the validation step owns that file).
    ``source_name`` (default: the input path): how bad records name their file."""
    if row_group_rows < 1:
        raise ConfigError(f"row_group_rows={row_group_rows}: must be at least 1")
    if quarantine_path is not None and not write_quarantine:
        raise ConfigError(
            f"quarantine_path={quarantine_path}: given with write_quarantine=False, which "
            "writes no quarantine file"
        )
    shard = shard_name(input_path) if shard is None else shard
    if name_problem(shard) or shard.startswith("."):
        raise ConfigError(f"shard name {shard!r}: use a plain file name (no slashes, no leading .)")
    final = Path(output_dir) / "data" / f"{shard}.parquet"
    qpath = None
    if on_bad_record == "quarantine" and write_quarantine:
        qpath = Path(quarantine_path or Path(output_dir) / f"{shard}.quarantine.jsonl")
    quarantine = Quarantine(qpath) if qpath is not None else None
    sink = quarantine
    if on_bad_record == "quarantine" and quarantine is None:
        sink = _AlreadyQuarantined(os.devnull)
    stats = IngestStats(path=os.fspath(input_path))
    created = [d for d in (final.parent, *final.parent.parents) if not d.exists()]
    tmp: Path | None = None

    def read(sink: Quarantine | None, stats: IngestStats) -> Iterator[Batch]:
        return read_input_batches(
            input_path,
            text_key=text_key,
            on_bad_record=on_bad_record,
            quarantine=sink if on_bad_record == "quarantine" else None,
            stats=stats,
            keep_records=True,
            source_name=source_name,
        )

    try:
        plan = _Plan(text_key)
        for batch in read(sink, stats):
            _learn(plan, batch.records or [])
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(final)
        tmp, _ = create_temp(final, Path.touch)  # pyarrow writes the reserved name
        with name_os_errors(final):  # pyarrow's and fsync's disk errors name no file
            second = _write_with_fallback(read, tmp, plan, row_group_rows)
        _check_same(input_path, stats, second)
        commit(tmp, final)
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if quarantine is not None:
            quarantine.discard()
        for folder in created:  # this call made them: it owns their .tmp/ too
            remove_temp_dir(folder)
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    if quarantine is not None:
        quarantine.commit()
    size = final.stat().st_size
    written = qpath if qpath is not None and qpath.is_file() else None
    return ExportResult(final, stats, stats.documents, size, written)


def _write_with_fallback(read: _Reader, tmp: Path, plan: _Plan, rows: int) -> IngestStats:
    """Write; a field whose values do not fit its inferred type is retried as JSON text."""
    while True:
        try:
            return _write(read, tmp, plan, rows)
        except _Unconvertible as exc:
            plan.to_json(exc.args[0])


def _check_same(
    input_path: str | os.PathLike[str], first: IngestStats, second: IngestStats
) -> None:
    keys = ("lines", "documents", "blank", "quarantined", "bytes_read")
    a, b = ({k: getattr(stats, k) for k in keys} for stats in (first, second))
    if a != b:
        raise InputError(f"{input_path}: changed while being exported ({a} then {b}); run again")
