"""``dataset_info.json``: the Hugging Face description of exported Parquet shards (features,
split sizes, shards), assembled from small per-shard records, plus tokenmill's own key (format
version, inputs, config and counts)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.atomic import file_sha256, write_bytes
from tokenmill.errors import FormatError, InputError
from tokenmill.formats.dataset_manifest import FORMAT_VERSION, input_files, input_sha256
from tokenmill.formats.shard_records import INFO_COUNTS, IngestStats

_HF_DTYPES = {"double": "float64", "float": "float32", "halffloat": "float16"}


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
    bytes, sha256) plus its Arrow ``schema`` (base64 IPC): descriptions need no Parquet opened."""
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
) -> Path:
    """Write ``output_dir/dataset_info.json`` from ``parquet_record``s in shard order (features:
    the schemas unified; ``train`` split sizes; shards; ``extra`` at the top level). Keys keep
    their order, so the bytes are deterministic without sorting."""
    out = Path(output_dir)
    if not records:
        raise InputError(f"{out / 'data'}: no .parquet shards to describe")
    schemas = [record_schema(r, str(out / r["file"])) for r in records]
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
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``output_dir/dataset_info.json`` for every ``output_dir/data/*.parquet`` through
    ``dataset_info_from_records``."""
    out = Path(output_dir)
    files = sorted((out / "data").glob("*.parquet"))
    return dataset_info_from_records(out, [parquet_record(p, out) for p in files], extra=extra)


def export_input(
    shard: str, uri: str, path: str | os.PathLike[str], stats: IngestStats
) -> dict[str, Any]:
    """One input of an export as ``dataset_info.json`` records it: ``{shard, uri, bytes,
    sha256, counts}`` (a folder: its files' total size and ``input_sha256``)."""
    path = Path(path)
    return {
        "shard": shard,
        "uri": uri,
        "bytes": sum(p.stat().st_size for p in input_files(path)),
        "sha256": input_sha256(path),
        "counts": {key: getattr(stats, key) for key in INFO_COUNTS},
    }


def tokenmill_info(
    inputs: list[dict[str, Any]], *, text_key: str, on_bad_record: str
) -> dict[str, Any]:
    """``{"tokenmill": ...}`` for ``write_dataset_info(extra=...)`` (a key ``datasets`` ignores):
    format version, the ``export_input`` records in shard order, config and summed counts."""
    counts = {key: sum(int(i["counts"][key]) for i in inputs) for key in INFO_COUNTS}
    return {
        "tokenmill": {
            "format_version": FORMAT_VERSION,
            "inputs": inputs,
            "config": {"text_key": text_key, "on_bad_record": on_bad_record},
            "counts": {"shards": len(inputs), **counts},
        }
    }
