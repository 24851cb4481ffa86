"""HF Parquet export: every field kept, loadable by pyarrow and datasets, atomic, deterministic."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.atomic import file_sha256
from tokenmill.cli import main
from tokenmill.errors import BadRecordError, ConfigError, InputError
from tokenmill.formats.dataset_manifest import FORMAT_VERSION
from tokenmill.ingest.dataset_info import (
    export_input,
    hf_feature,
    tokenmill_info,
    write_dataset_info,
)
from tokenmill.ingest.export import JSON_FIELDS_KEY, export_shard
from tokenmill.ingest.sources import read_input_batches

RECORDS: list[dict[str, Any]] = [
    {"text": "first", "id": 1, "score": 0.5, "meta": {"lang": "en", "tags": ["a", "b"]}},
    {"text": "", "id": 2, "ok": True, "meta": {"lang": "fr", "n": 3}},
    {"id": 3, "text": "third", "score": 2, "none": None, "list": [1, 2, 3]},
    {"text": "fourth ✓", "id": 4, "list": [], "deep": [{"k": "v"}, {"k": "w", "x": 1.0}]},
]


def jsonl(path: Path, records: list[Any], *, gz: bool = False) -> Path:
    data = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def rows_of(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


def drop_nulls(value: Any) -> Any:
    """A record as stored, minus the nulls Parquet adds for absent fields."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def test_every_field_is_kept(tmp_path: Path) -> None:
    res = export_shard(jsonl(tmp_path / "s.jsonl", RECORDS), tmp_path / "hf")
    assert res.parquet_path == tmp_path / "hf" / "data" / "s.parquet"
    assert (res.rows, res.stats.documents, res.bytes) == (4, 4, res.parquet_path.stat().st_size)
    schema = pq.read_schema(res.parquet_path)
    assert schema.names == ["text", "id", "score", "meta", "ok", "none", "list", "deep"]
    assert schema.field("text").type == pa.string()
    assert schema.field("score").type == pa.float64()
    assert schema.metadata is None or JSON_FIELDS_KEY not in schema.metadata
    rows = rows_of(res.parquet_path)
    assert [drop_nulls(r) for r in rows] == [drop_nulls(r) for r in RECORDS]
    assert rows[2]["score"] == 2.0 and rows[0]["meta"]["n"] is None


def test_conflicting_and_unstorable_fields_become_json_text(tmp_path: Path) -> None:
    records = [
        {"text": "a", "v": 1, "e": {}, "s": "x"},
        {"text": "b", "v": "one", "e": {}},
        {"text": "c", "v": [1, {"z": None}], "s": "y"},
        {"text": "d"},
    ]
    res = export_shard(jsonl(tmp_path / "m.jsonl", records), tmp_path / "hf")
    schema = pq.read_schema(res.parquet_path)
    assert json.loads(schema.metadata[JSON_FIELDS_KEY]) == ["e", "v"]
    assert schema.field("v").type == pa.string() and schema.field("s").type == pa.string()
    rows = rows_of(res.parquet_path)
    assert [None if r["v"] is None else json.loads(r["v"]) for r in rows] == [
        1,
        "one",
        [1, {"z": None}],
        None,
    ]
    assert [r["e"] for r in rows] == ["{}", "{}", None, None]
    assert [r["s"] for r in rows] == ["x", None, "y", None]


def test_type_widening_across_batches_falls_back_to_json(tmp_path: Path) -> None:
    """An exact int too large for float64 in batch 1, a float in a later 4 MiB batch."""
    filler = [{"text": "x" * 1000, "n": None}] * 4300
    records = [{"text": "big", "n": 2**60 + 1}, *filler, {"text": "float", "n": 0.5}]
    res = export_shard(jsonl(tmp_path / "w.jsonl", records), tmp_path / "hf")
    table = pq.read_table(res.parquet_path, columns=["n"])
    assert json.loads(pq.read_schema(res.parquet_path).metadata[JSON_FIELDS_KEY]) == ["n"]
    values = table.column("n").to_pylist()
    assert (json.loads(values[0]), json.loads(values[-1]), values[1]) == (2**60 + 1, 0.5, "null")


def test_loadable_by_datasets_with_dataset_info(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    out = tmp_path / "hf"
    more = [{**r, "text": r["text"] + "!"} for r in RECORDS]
    inputs = []
    for name, records, mode in (
        ("part-00000", RECORDS, "fail"),
        ("part-00001", more, "quarantine"),
    ):
        src = jsonl(tmp_path / f"{name}.jsonl.gz", records, gz=True)
        res = export_shard(src, out, on_bad_record=mode)
        inputs.append(export_input(name, f"s3://b/{src.name}", src, res.stats))
    assert not (out / "part-00001.quarantine.jsonl").exists()  # nothing quarantined
    extra = tokenmill_info(inputs, text_key="text", on_bad_record="quarantine")
    info_path = write_dataset_info(out, extra=extra)
    info = json.loads(info_path.read_text())
    files = sorted((out / "data").glob("*.parquet"))
    ds = datasets.load_dataset(
        "parquet", data_files=[str(f) for f in files], split="train", cache_dir=str(tmp_path / "c")
    )
    assert ds.num_rows == 8 == info["splits"]["train"]["num_examples"]
    assert ds.features.to_dict() == info["features"]
    assert list(info["features"]) == ds.column_names
    assert [drop_nulls(r) for r in ds] == [drop_nulls(r) for r in RECORDS + more]
    assert [s["file"] for s in info["shards"]] == [
        "data/part-00000.parquet",
        "data/part-00001.parquet",
    ]
    assert [s["sha256"] for s in info["shards"]] == [file_sha256(f) for f in files]
    assert info["download_size"] == sum(f.stat().st_size for f in files)
    assert info["tokenmill"] == extra["tokenmill"]
    assert info["tokenmill"]["counts"] == {
        "shards": 2,
        "lines": 8,
        "documents": 8,
        "blank": 0,
        "quarantined": 0,
    }
    whole = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "c2"))
    assert whole.num_rows == 8


def test_hf_feature_matches_datasets() -> None:
    datasets = pytest.importorskip("datasets")
    schema = pa.schema(
        [
            ("text", pa.string()),
            ("i", pa.int64()),
            ("f", pa.float64()),
            ("g", pa.float32()),
            ("b", pa.bool_()),
            ("z", pa.null()),
            ("l", pa.list_(pa.int64())),
            ("s", pa.struct([("a", pa.int64()), ("b", pa.list_(pa.struct([("c", pa.string())])))])),
            ("ls", pa.large_string()),
            ("ll", pa.large_list(pa.float32())),
            ("fl", pa.list_(pa.int32(), 3)),
            ("ts", pa.timestamp("us")),
            ("d", pa.date32()),
        ]
    )
    ours = {f.name: hf_feature(f.type) for f in schema}
    assert ours == datasets.Features.from_arrow_schema(schema).to_dict()


def test_export_is_deterministic_and_row_groups_exact(tmp_path: Path) -> None:
    records = [{"text": f"doc {i}", "i": i, "m": {"k": i % 3}} for i in range(10)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = export_shard(
        jsonl(tmp_path / "a" / "x.jsonl", records), tmp_path / "out1", row_group_rows=3
    )
    b = export_shard(
        jsonl(tmp_path / "b" / "x.jsonl", records), tmp_path / "out2", row_group_rows=3
    )
    assert a.parquet_path.read_bytes() == b.parquet_path.read_bytes()
    meta = pq.read_metadata(a.parquet_path)
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [3, 3, 3, 1]
    again = export_shard(tmp_path / "b" / "x.jsonl", tmp_path / "out2", row_group_rows=3)
    assert again.parquet_path.read_bytes() == b.parquet_path.read_bytes()
    info1 = write_dataset_info(tmp_path / "out1").read_bytes()
    assert info1 == write_dataset_info(tmp_path / "out1").read_bytes()
    assert info1 == write_dataset_info(tmp_path / "out2").read_bytes()


def test_fail_mode_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"text": "ok"}\n{"text": 3}\n')
    out = tmp_path / "deep" / "hf"
    with pytest.raises(
        BadRecordError, match=re.escape(f"{src}:2: text is not a string (found int)")
    ):
        export_shard(src, out)
    assert not (tmp_path / "deep").exists()
    corrupt = tmp_path / "c.jsonl.gz"
    corrupt.write_bytes(gzip.compress(b'{"text": "ok"}\n' * 1000)[:-20])
    (out / "data").mkdir(parents=True)
    with pytest.raises(InputError, match=re.escape("c.jsonl.gz: corrupt or truncated gzip stream")):
        export_shard(corrupt, out, on_bad_record="quarantine")
    assert [p.name for p in out.rglob("*")] == ["data"]


def test_quarantine_mode_counts_and_file(tmp_path: Path) -> None:
    src = tmp_path / "q.jsonl"
    src.write_bytes(b'{"text": "a", "n": 1}\n\n[1]\n{"text": "b"}\n{"n": 2}\n')
    res = export_shard(src, tmp_path / "hf", on_bad_record="quarantine")
    assert res.quarantine_path == tmp_path / "hf" / "q.quarantine.jsonl"
    entries = [json.loads(x) for x in res.quarantine_path.read_text().splitlines()]
    assert [(e["line"], e["reason"]) for e in entries] == [
        (3, "line is not a JSON object (found list)"),
        (5, "missing text key 'text'"),
    ]
    st = res.stats
    assert (st.lines, st.documents, st.quarantined, st.blank) == (5, 2, 2, 1)
    assert rows_of(res.parquet_path) == [{"text": "a", "n": 1}, {"text": "b", "n": None}]
    clean = export_shard(
        jsonl(tmp_path / "c.jsonl", RECORDS[:1]),
        tmp_path / "hf",
        on_bad_record="quarantine",
        quarantine_path=tmp_path / "elsewhere" / "c.q.jsonl",
    )
    assert clean.quarantine_path is None and not (tmp_path / "elsewhere" / "c.q.jsonl").exists()


def test_text_key_and_empty_shard(tmp_path: Path) -> None:
    src = jsonl(tmp_path / "k.jsonl", [{"content": "c1", "text": 5}, {"content": "c2"}])
    res = export_shard(src, tmp_path / "hf", text_key="content")
    assert rows_of(res.parquet_path) == [
        {"content": "c1", "text": 5},
        {"content": "c2", "text": None},
    ]
    blank = tmp_path / "blank.jsonl"
    blank.write_bytes(b"\n \n")
    empty = export_shard(blank, tmp_path / "hf2")
    assert empty.rows == 0 and pq.read_schema(empty.parquet_path).names == ["text"]


def test_exported_folder_is_a_tokenization_input(tmp_path: Path) -> None:
    export_shard(jsonl(tmp_path / "a.jsonl", RECORDS), tmp_path / "hf")
    export_shard(jsonl(tmp_path / "b.jsonl", RECORDS[:2]), tmp_path / "hf")
    write_dataset_info(tmp_path / "hf")
    texts = [t for b in read_input_batches(tmp_path / "hf") for t in b.texts]
    expected = [r["text"] for r in RECORDS] + [r["text"] for r in RECORDS[:2]]
    assert texts == expected
    single = read_input_batches(tmp_path / "hf" / "data" / "b.parquet", keep_records=True)
    assert [drop_nulls(r) for b in single for r in b.records or []] == RECORDS[:2]


def test_bad_settings(tmp_path: Path) -> None:
    src = jsonl(tmp_path / "s.jsonl", RECORDS)
    with pytest.raises(ConfigError, match=re.escape("shard name '../x'")):
        export_shard(src, tmp_path / "hf", shard="../x")
    with pytest.raises(ConfigError, match=re.escape("on_bad_record='skip'")):
        export_shard(src, tmp_path / "hf", on_bad_record="skip")
    with pytest.raises(InputError, match=re.escape("no .parquet shards")):
        write_dataset_info(tmp_path / "nothing")


def test_cli_export(tmp_path: Path, capsys: Any) -> None:
    good = jsonl(tmp_path / "good.jsonl", RECORDS)
    out = tmp_path / "out"
    assert main(["export", "--input", str(good), "--output-dir", str(out)]) == 0
    info = json.loads((out / "dataset_info.json").read_text())
    assert info["splits"]["train"]["num_examples"] == 4
    [source] = info["tokenmill"]["inputs"]
    assert (source["shard"], source["counts"]["documents"]) == ("good", 4)
    assert (source["uri"], source["sha256"]) == (str(good.resolve()), file_sha256(good))
    assert "good.jsonl: 4 lines, 4 documents (1 empty)" in capsys.readouterr().out

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "a"}\n{"text": "\\ud800"}\n')
    fresh = tmp_path / "fresh"
    assert main(["export", "--input", str(bad), "--output-dir", str(fresh)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:2: text contains a lone surrogate (cannot be encoded as UTF-8)" in err
    assert not fresh.exists()

    args = ["export", "--input", str(bad), "--output-dir", str(fresh), "--on-bad-record"]
    assert main([*args, "quarantine"]) == 0
    assert "1 quarantined" in capsys.readouterr().out
    assert (fresh / "bad.quarantine.jsonl").is_file() and (fresh / "data" / "bad.parquet").is_file()


def test_cli_dataset_info_records_inputs_config_counts(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    (tmp_path / "in").mkdir()
    good = jsonl(tmp_path / "in" / "b-good.jsonl", RECORDS)
    mixed = tmp_path / "in" / "a-mixed.jsonl.gz"
    mixed.write_bytes(gzip.compress(b'{"text": "x"}\n[1]\n\n{"text": "y"}\n', mtime=0))
    runs = []
    for out, cwd, names in (
        (tmp_path / "o1", tmp_path / "in", ["b-good.jsonl", "a-mixed.jsonl.gz"]),
        (tmp_path / "o2", tmp_path, ["in/a-mixed.jsonl.gz", "in/b-good.jsonl"]),
    ):
        monkeypatch.chdir(cwd)
        argv = ["export", "--input", *names, "--output-dir", str(out), "--on-bad-record"]
        assert main([*argv, "quarantine"]) == 0
        runs.append((out / "dataset_info.json").read_bytes())
    capsys.readouterr()
    assert runs[0] == runs[1]  # same inputs and config, whatever the cwd or argument order
    info = json.loads(runs[0])["tokenmill"]
    assert (info["format_version"], info["config"]) == (
        FORMAT_VERSION,
        {"text_key": "text", "on_bad_record": "quarantine"},
    )
    assert info["inputs"] == [
        {
            "shard": src.name.split(".")[0],
            "uri": str(src.resolve()),
            "bytes": src.stat().st_size,
            "sha256": file_sha256(src),
            "counts": counts,
        }
        for src, counts in (
            (mixed, {"lines": 4, "documents": 2, "blank": 1, "quarantined": 1}),
            (good, {"lines": 4, "documents": 4, "blank": 0, "quarantined": 0}),
        )
    ]
    assert info["counts"] == {"shards": 2, "lines": 8, "documents": 6, "blank": 1, "quarantined": 1}


def test_write_quarantine_false_counts_and_skips_bad_lines(tmp_path: Path) -> None:
    src = tmp_path / "q.jsonl"
    src.write_bytes(b'{"text": "a", "n": 1}\n\n[1]\n{"text": "b"}\n{"n": 2}\n')
    owned = tmp_path / "raw" / "q.quarantine.jsonl"
    owned.parent.mkdir()
    owned.write_bytes(b"written by the validation step\n")
    before = owned.stat()
    res = export_shard(src, tmp_path / "hf", on_bad_record="quarantine", write_quarantine=False)
    st = res.stats
    assert (st.lines, st.documents, st.quarantined, st.blank, res.quarantine_path) == (
        5,
        2,
        2,
        1,
        None,
    )
    hf = tmp_path / "hf"
    written = sorted(p.relative_to(hf).as_posix() for p in hf.rglob("*"))
    assert written == ["data", "data/.tmp", "data/q.parquet"]  # .tmp/ stays, empty
    after = owned.stat()
    assert (after.st_ino, after.st_mtime_ns, owned.read_bytes()) == (
        before.st_ino,
        before.st_mtime_ns,
        b"written by the validation step\n",
    )
    written = export_shard(src, tmp_path / "hf2", on_bad_record="quarantine")
    assert written.parquet_path.read_bytes() == res.parquet_path.read_bytes()
    with pytest.raises(ConfigError, match=re.escape("given with write_quarantine=False")):
        export_shard(src, tmp_path / "hf3", quarantine_path=owned, write_quarantine=False)
    assert not (tmp_path / "hf3").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--input", "{d}/missing.jsonl", "--output-dir", "{d}/o"], "no such file"),
        (["--input", "{d}/notes.txt", "--output-dir", "{d}/o"], "cannot name a shard"),
        (["--input", "{d}/x.jsonl", "{d}/sub/x.jsonl", "--output-dir", "{d}/o"], "both would be"),
    ],
)
def test_cli_usage_errors_exit_2(
    tmp_path: Path, capsys: Any, argv: list[str], message: str
) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("notes.txt", "x.jsonl", "sub/x.jsonl"):
        (tmp_path / name).write_bytes(b'{"text": "a"}\n')
    assert main(["export", *[a.format(d=tmp_path) for a in argv]]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "--input", "x.jsonl"],
        ["export", "--output-dir", "o"],
        ["export", "--input", "x.jsonl", "--output-dir", "o", "--on-bad-record", "skip"],
    ],
)
def test_cli_argument_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
