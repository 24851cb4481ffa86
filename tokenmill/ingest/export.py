"""HF dataset export: input shards -> ``<dir>/data/<shard>.parquet`` + ``<dir>/dataset_info.json``.

The layout loads with ``datasets.load_dataset("parquet", data_files=...)`` and plain pyarrow.
Every field of the input records is kept. Export streams twice over the input with bounded
memory: the first pass validates (quarantining bad lines) and infers one schema for the whole
shard (per-field types unified across batches; a field missing from a record becomes null); the
second pass writes row groups of exactly ``row_group_rows`` rows. A field whose values cannot
share one Arrow type (e.g. an int in one record and a string in another, or an empty object)
is stored as a string column holding each value's JSON text and listed under
``json_encoded_fields`` in the Parquet key-value metadata. Same input and settings -> same bytes.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.atomic import (
    commit,
    create_temp,
    file_sha256,
    name_os_errors,
    remove_stale_temps,
    remove_temp_dir,
    write_bytes,
)
from tokenmill.errors import ConfigError, FormatError, InputError
from tokenmill.formats.dataset_manifest import FORMAT_VERSION, input_sha256
from tokenmill.formats.shard_records import INFO_COUNTS, IngestStats
from tokenmill.ingest.records import ON_BAD_RECORD, Batch, Quarantine, shard_name
from tokenmill.ingest.sources import read_input_batches

DEFAULT_ROW_GROUP_ROWS = 1000
PARQUET_COMPRESSION = "zstd"
JSON_FIELDS_KEY = b"tokenmill.json_encoded_fields"
# The counts ``dataset_info.json`` records per input and in total.
_CONVERSION_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)
_HF_DTYPES = {"double": "float64", "float": "float32", "halffloat": "float16"}


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
        fields = []
        for name in names:
            if name == self.text_key or name in self.as_json:
                fields.append(pa.field(name, pa.string()))
            else:
                fields.append(pa.field(name, self.types.get(name, pa.null())))
        metadata = {JSON_FIELDS_KEY: json.dumps(sorted(self.as_json)).encode()}
        return pa.schema(fields, metadata=metadata if self.as_json else None)

    def to_json(self, name: str) -> None:
        self.as_json.add(name)
        self.types.pop(name, None)


class _AlreadyQuarantined(Quarantine):
    """A sink that only counts bad lines: they were quarantined by the first pass, or by the
    validation step that owns the quarantine file (``write_quarantine=False``)."""

    def add(self, source: str, line: int, reason: str, raw: bytes) -> None:
        self._count += 1


class _Unconvertible(Exception):
    """A value of ``field`` does not fit the type inferred for it (e.g. int -> float loss)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _check_shard(shard: str) -> None:
    bad = not shard or shard.startswith(".") or any(c in shard for c in "/\\")
    if bad or any(ord(c) < 32 or ord(c) == 127 for c in shard):
        raise ConfigError(f"shard name {shard!r}: use a plain file name (no slashes, no leading .)")


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


def _read(
    input_path: str | os.PathLike[str],
    text_key: str,
    on_bad_record: str,
    quarantine: Quarantine | None,
    stats: IngestStats,
    source_name: str | None = None,
) -> Any:
    return read_input_batches(
        input_path,
        text_key=text_key,
        on_bad_record=on_bad_record,
        quarantine=quarantine,
        stats=stats,
        keep_records=True,
        source_name=source_name,
    )


def _write(
    input_path: str | os.PathLike[str],
    tmp: Path,
    plan: _Plan,
    on_bad_record: str,
    row_group_rows: int,
) -> IngestStats:
    """Second pass: stream the records into ``tmp`` in row groups of ``row_group_rows``."""
    schema = plan.schema()
    stats = IngestStats(path=os.fspath(input_path))
    sink = _AlreadyQuarantined(os.devnull) if on_bad_record == "quarantine" else None
    options = {"compression": PARQUET_COMPRESSION, "use_dictionary": False}
    with pq.ParquetWriter(tmp, schema, write_statistics=False, **options) as writer:
        pending: list[pa.Table] = []
        rows = 0
        for batch in _read(input_path, plan.text_key, on_bad_record, sink, stats):
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
    """Write ``output_dir/data/<shard>.parquet`` atomically from one input shard.

    Bad lines raise ``BadRecordError`` (``fail``) or go to ``quarantine_path`` (default
    ``output_dir/<shard>.quarantine.jsonl``), written only when a line was quarantined.
    With ``write_quarantine=False`` they are only counted and skipped: a validation step that
    read the same shard owns its quarantine file. ``source_name`` (default: the input path) is
    how bad records name their file, e.g. the URI a downloaded shard came from. Nothing is left
    at the output path when the export fails.
    """
    if on_bad_record not in ON_BAD_RECORD:
        raise ConfigError(f"on_bad_record={on_bad_record!r}: expected one of {ON_BAD_RECORD}")
    if row_group_rows < 1:
        raise ConfigError(f"row_group_rows={row_group_rows}: must be at least 1")
    if quarantine_path is not None and not write_quarantine:
        raise ConfigError(
            f"quarantine_path={quarantine_path}: given with write_quarantine=False, which "
            "writes no quarantine file"
        )
    shard = shard_name(input_path) if shard is None else shard
    _check_shard(shard)
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
    try:
        plan = _Plan(text_key)
        for batch in _read(input_path, text_key, on_bad_record, sink, stats, source_name):
            _learn(plan, batch.records or [])
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(final)
        tmp, _ = create_temp(final, Path.touch)  # pyarrow writes the reserved name
        with name_os_errors(final):  # pyarrow's and fsync's disk errors name no file
            second = _write_with_fallback(input_path, tmp, plan, on_bad_record, row_group_rows)
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


def _write_with_fallback(
    input_path: str | os.PathLike[str], tmp: Path, plan: _Plan, on_bad_record: str, rows: int
) -> IngestStats:
    """Write; a field whose values do not fit its inferred type is retried as JSON text."""
    while True:
        try:
            return _write(input_path, tmp, plan, on_bad_record, rows)
        except _Unconvertible as exc:
            plan.to_json(exc.name)


def _check_same(
    input_path: str | os.PathLike[str], first: IngestStats, second: IngestStats
) -> None:
    keys = ("lines", "documents", "blank", "quarantined", "bytes_read")
    a = {k: getattr(first, k) for k in keys}
    b = {k: getattr(second, k) for k in keys}
    if a != b:
        raise InputError(f"{input_path}: changed while being exported ({a} then {b}); run again")


def hf_feature(kind: pa.DataType) -> dict[str, Any]:
    """The ``datasets`` feature dict (``Features.to_dict()`` form) for an Arrow type."""
    if pa.types.is_struct(kind):
        return {f.name: hf_feature(f.type) for f in kind}
    if pa.types.is_large_list(kind):
        return {"feature": hf_feature(kind.value_type), "_type": "LargeList"}
    if pa.types.is_fixed_size_list(kind):
        return {"feature": hf_feature(kind.value_type), "length": kind.list_size, "_type": "List"}
    if pa.types.is_list(kind):
        return {"feature": hf_feature(kind.value_type), "_type": "List"}
    if pa.types.is_date32(kind) or pa.types.is_date64(kind):
        return {"dtype": str(kind).split("[")[0], "_type": "Value"}
    return {"dtype": _HF_DTYPES.get(str(kind), str(kind)), "_type": "Value"}


def parquet_record(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> dict[str, Any]:
    """A Parquet shard as ``dataset_info.json`` lists it (``file`` relative to ``root``, rows,
    uncompressed and file bytes, sha256) plus its Arrow ``schema`` (base64 IPC), so the
    dataset's description is assembled from these small records without opening any Parquet."""
    path = Path(path)
    meta = pq.read_metadata(path)
    schema = meta.schema.to_arrow_schema().remove_metadata()
    rel = path.resolve()
    with contextlib.suppress(ValueError):
        rel = rel.relative_to(Path(root).resolve())
    return {
        "file": rel.as_posix(),
        "num_rows": meta.num_rows,
        "num_bytes": sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)),
        "size": path.stat().st_size,
        "sha256": file_sha256(path),
        "schema": base64.b64encode(schema.serialize().to_pybytes()).decode("ascii"),
    }


def record_schema(record: dict[str, Any], where: str) -> pa.Schema:
    """The Arrow schema a ``parquet_record`` carries; FormatError naming ``where`` if damaged."""
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(record["schema"])))
    except (KeyError, TypeError, ValueError, pa.ArrowInvalid) as exc:
        raise FormatError(where, "schema", f"not a serialized Arrow schema ({exc})") from exc


def dataset_info_from_records(
    output_dir: str | os.PathLike[str],
    records: list[dict[str, Any]],
    *,
    extra: dict[str, Any] | None = None,
    where: str | None = None,
) -> Path:
    """Write ``output_dir/dataset_info.json`` from ``parquet_record``s (in shard order): features
    (the shards' schemas must unify), ``train`` split sizes, shards; ``extra`` keys at the top
    level. ``num_bytes`` is the uncompressed size, ``download_size`` the files' size. Keys keep
    their order, so the bytes are deterministic without sorting."""
    out = Path(output_dir)
    if not records:
        raise InputError(f"{out / 'data'}: no .parquet shards to describe")
    schemas = [record_schema(r, where or str(out / r["file"])) for r in records]
    shards = [
        {k: r[k] for k in ("file", "num_rows", "num_bytes", "size", "sha256")} for r in records
    ]
    try:
        schema = pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise FormatError(
            out / "data", "schema", f"shards have incompatible schemas: {exc}"
        ) from exc
    num_bytes = sum(s["num_bytes"] for s in shards)
    info: dict[str, Any] = {
        "builder_name": "parquet",
        "config_name": "default",
        "features": {f.name: hf_feature(f.type) for f in schema},
        "splits": {
            "train": {
                "name": "train",
                "num_bytes": num_bytes,
                "num_examples": sum(s["num_rows"] for s in shards),
            }
        },
        "download_size": sum(s["size"] for s in shards),
        "dataset_size": num_bytes,
        "shards": shards,
    }
    info.update(extra or {})
    target = out / "dataset_info.json"
    write_bytes(target, (json.dumps(info, indent=2) + "\n").encode("utf-8"))
    return target


def write_dataset_info(
    output_dir: str | os.PathLike[str],
    *,
    features_from: list[Path] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``output_dir/dataset_info.json`` for Parquet files (default: every
    ``output_dir/data/*.parquet``) through ``dataset_info_from_records``."""
    out = Path(output_dir)
    files = sorted((out / "data").glob("*.parquet")) if features_from is None else features_from
    return dataset_info_from_records(out, [parquet_record(p, out) for p in files], extra=extra)


def export_input(
    shard: str, uri: str, path: str | os.PathLike[str], stats: IngestStats
) -> dict[str, Any]:
    """One input of an export as ``dataset_info.json`` records it: ``{shard, uri, bytes,
    sha256, counts}`` (a folder: its files' total size and ``input_sha256``)."""
    path = Path(path)
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    return {
        "shard": shard,
        "uri": uri,
        "bytes": sum(p.stat().st_size for p in files),
        "sha256": input_sha256(path),
        "counts": {key: getattr(stats, key) for key in INFO_COUNTS},
    }


def tokenmill_info(
    inputs: list[dict[str, Any]], *, text_key: str, on_bad_record: str
) -> dict[str, Any]:
    """``{"tokenmill": ...}`` for ``write_dataset_info(extra=...)``: format version, the inputs
    (``export_input`` records, in shard order), the config and the counts summed over them.
    One extra top-level key, which ``datasets`` ignores."""
    counts = {key: sum(int(i["counts"][key]) for i in inputs) for key in INFO_COUNTS}
    return {
        "tokenmill": {
            "format_version": FORMAT_VERSION,
            "inputs": inputs,
            "config": {"text_key": text_key, "on_bad_record": on_bad_record},
            "counts": {"shards": len(inputs), **counts},
        }
    }
