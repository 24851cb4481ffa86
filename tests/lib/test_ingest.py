"""JSONL ingest: the bad-record catalogue in both modes, tolerated quirks, compression, tables."""

from __future__ import annotations

import base64
import gzip
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tokenmill.errors import BadRecordError, ConfigError, FormatError, InputError
from tokenmill.formats.shard_records import IngestStats
from tokenmill.ingest.records import Batch, Quarantine, read_jsonl_batches, shard_name
from tokenmill.ingest.sources import read_input_batches
from tokenmill.ingest.tables import read_table_batches

SURROGATE = "text contains a lone surrogate (cannot be encoded as UTF-8)"
# (line bytes, exact reason; a reason ending in ": " is a prefix, the parser's detail follows)
CATALOGUE: list[tuple[bytes, str]] = [
    (b'{"text": "unterminated', "invalid JSON: "),
    (b"not json at all", "invalid JSON: "),
    (b'{"text": "a"} trailing', "invalid JSON: "),
    (b'{"text": NaN}', "invalid JSON: "),
    (b'{"text": "raw \x01 control"}', "invalid JSON: "),
    (b"[1, 2]", "line is not a JSON object (found list)"),
    (b'"just a string"', "line is not a JSON object (found string)"),
    (b"42", "line is not a JSON object (found int)"),
    (b"null", "line is not a JSON object (found null)"),
    (b'{"id": 1}', "missing text key 'text'"),
    (b'{"Text": "wrong case"}', "missing text key 'text'"),
    (b'{"text": 5}', "text is not a string (found int)"),
    (b'{"text": 1.5}', "text is not a string (found float)"),
    (b'{"text": true}', "text is not a string (found bool)"),
    (b'{"text": null}', "text is not a string (found null)"),
    (b'{"text": ["a"]}', "text is not a string (found list)"),
    (b'{"text": {"a": 1}}', "text is not a string (found object)"),
    (b'{"text": "\xff\xfe"}', "invalid UTF-8 at byte 10 (0xff)"),
    (b'{"text": "ok", "m": "\xc3"}', "invalid UTF-8 at byte 21 (0xc3)"),
    (b'{"text": "\xed\xa0\x80"}', "invalid UTF-8 at byte 10 (0xed)"),
    (b'{"text": "\\ud800"}', SURROGATE),
    (b'{"text": "tail \\udc00"}', SURROGATE),
    (b'{"text": "ok", "meta": ["\\ud800"]}', SURROGATE.replace("text", "field 'meta'")),
    (b'{"text": "ok", "m": ' + b"[" * 1025 + b"]" * 1025 + b"}", "JSON nested too deeply: "),
    (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply: "),
]
GOOD = b'{"text": "good"}'


def write(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path``, compressed according to its suffix."""
    if path.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    path.write_bytes(data)
    return path


def read_all(path: Path, **kwargs: object) -> tuple[list[Batch], IngestStats]:
    stats = IngestStats(path=str(path))
    batches = list(read_jsonl_batches(path, stats=stats, **kwargs))  # type: ignore[arg-type]
    return batches, stats


def texts_of(batches: list[Batch]) -> list[str]:
    return [t for b in batches for t in b.texts]


def check_reason(reason: str, expected: str) -> None:
    if expected.endswith(": "):
        assert reason.startswith(expected) and len(reason) > len(expected)
    else:
        assert reason == expected


@pytest.mark.parametrize(("line", "expected"), CATALOGUE)
def test_fail_mode_names_file_line_and_reason(tmp_path: Path, line: bytes, expected: str) -> None:
    path = write(tmp_path / "in.jsonl", b"\n".join([GOOD, b"", line, GOOD]) + b"\n")
    with pytest.raises(BadRecordError) as info:
        read_all(path)
    assert info.value.line == 3
    assert info.value.path == str(path)
    check_reason(info.value.reason, expected)
    assert str(info.value) == f"{path}:3: {info.value.reason}"


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_quarantine_mode_catalogue(tmp_path: Path, suffix: str) -> None:
    lines = [GOOD, b"   "]
    for bad, _ in CATALOGUE:
        lines += [bad, b'{"text": "x", "n": 1}']
    path = write(tmp_path / f"in{suffix}", b"\n".join(lines) + b"\n")
    quarantine = Quarantine(tmp_path / "out.quarantine.jsonl")
    batches, stats = read_all(path, on_bad_record="quarantine", quarantine=quarantine)
    quarantine.commit()
    entries = [json.loads(x) for x in quarantine.path.read_text().splitlines()]
    assert [e["line"] for e in entries] == [3 + 2 * i for i in range(len(CATALOGUE))]
    for entry, (bad, expected) in zip(entries, CATALOGUE, strict=True):
        check_reason(entry["reason"], expected)
        assert base64.b64decode(entry["raw_b64"]) == bad
        assert entry["source"] == str(path)
        assert list(entry) == sorted(entry)
    assert texts_of(batches) == ["good"] + ["x"] * len(CATALOGUE)
    assert (stats.lines, stats.documents, stats.quarantined, stats.blank) == (
        len(lines),
        1 + len(CATALOGUE),
        len(CATALOGUE),
        1,
    )
    assert stats.lines == stats.documents + stats.quarantined + stats.blank
    assert quarantine.count == len(CATALOGUE)


def test_source_name_names_bad_lines_of_a_local_copy(tmp_path: Path) -> None:
    path = write(tmp_path / "copy.jsonl.gz", b"\n".join([GOOD, b"[1]", GOOD]) + b"\n")
    uri = "s3://bucket/sources/part-1.jsonl.gz"
    quarantine = Quarantine(tmp_path / "q.jsonl")
    batches, stats = read_all(
        path, on_bad_record="quarantine", quarantine=quarantine, source_name=uri
    )
    quarantine.commit()
    (entry,) = [json.loads(x) for x in quarantine.path.read_text().splitlines()]
    assert (entry["source"], entry["line"], texts_of(batches)) == (uri, 2, ["good", "good"])
    assert str(tmp_path) not in quarantine.path.read_text()
    assert (stats.path, stats.quarantined) == (str(path), 1)  # the caller's stats: unchanged
    with pytest.raises(BadRecordError, match=re.escape(f"{uri}:2: line is not a JSON object")):
        read_all(path, source_name=uri)


def test_valid_surrogate_pair_and_unicode_are_good(tmp_path: Path) -> None:
    data = '{"text": "\\ud83d\\ude00"}\n{"text": "héllo ✓"}\n'.encode()
    batches, _ = read_all(write(tmp_path / "a.jsonl", data))
    assert texts_of(batches) == ["\U0001f600", "héllo ✓"]


def test_bom_crlf_blank_missing_final_newline_empty_text(tmp_path: Path) -> None:
    data = b'\xef\xbb\xbf{"text": "a"}\r\n\r\n  \t \n{"text": ""}\r\n{"text": "z"}'
    path = write(tmp_path / "q.jsonl", data)
    batches, stats = read_all(path)
    assert texts_of(batches) == ["a", "", "z"]
    assert stats.to_dict() == {
        "path": str(path),
        "lines": 5,
        "documents": 3,
        "empty_documents": 1,
        "blank": 2,
        "quarantined": 0,
        "bytes_read": len(data),
        "bom": True,
        "crlf_lines": 3,
        "missing_final_newline": True,
    }


def test_bad_first_line_keeps_bom_and_cr_in_raw_bytes(tmp_path: Path) -> None:
    data = b"\xef\xbb\xbf[1]\r\n" + GOOD + b"\r\n"
    quarantine = Quarantine(tmp_path / "q.jsonl")
    _, stats = read_all(
        write(tmp_path / "b.jsonl", data), on_bad_record="quarantine", quarantine=quarantine
    )
    quarantine.commit()
    (entry,) = [json.loads(x) for x in quarantine.path.read_text().splitlines()]
    assert (entry["line"], base64.b64decode(entry["raw_b64"])) == (1, b"\xef\xbb\xbf[1]\r")
    assert (stats.bom, stats.crlf_lines, stats.missing_final_newline) == (True, 2, False)


@pytest.mark.parametrize("batch_bytes", [1, 2, 3, 5, 17, 64, 4 << 20])
def test_block_boundaries_do_not_change_results(tmp_path: Path, batch_bytes: int) -> None:
    records = [json.dumps({"text": f"doc {i} " * (i % 7), "i": i}).encode() for i in range(60)]
    lines = [b"\xef\xbb\xbf" + records[0]] + [
        r + (b"\r" if i % 3 == 0 else b"") for i, r in enumerate(records[1:])
    ]
    lines[10:10] = [b"", b"  "]
    path = write(tmp_path / "c.jsonl", b"\n".join(lines))
    reference, ref_stats = read_all(path, keep_records=True)
    batches, stats = read_all(path, keep_records=True, batch_bytes=batch_bytes)
    assert texts_of(batches) == texts_of(reference)
    assert [r for b in batches for r in b.records or []] == [json.loads(r) for r in records]
    assert stats == ref_stats
    assert (stats.lines, stats.blank, stats.bom, stats.crlf_lines) == (62, 2, True, 20)
    line_of = {}
    number = 0
    for i, line in enumerate(lines, start=1):
        if line.strip():
            line_of[number] = i
            number += 1
    seen = 0
    for batch in batches:
        assert batch.first_line == line_of[seen]
        seen += len(batch.texts)


def test_first_line_skips_leading_bad_and_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", b"\n\n[]\n" + GOOD + b"\n")
    quarantine = Quarantine(tmp_path / "q.jsonl")
    batches, _ = read_all(path, on_bad_record="quarantine", quarantine=quarantine)
    quarantine.discard()
    assert [b.first_line for b in batches] == [4]


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_compressed_equals_plain_across_members(tmp_path: Path, suffix: str) -> None:
    part1 = b"".join(b'{"text": "a%d"}\n' % i for i in range(500))
    part2 = b"".join(b'{"text": "b%d"}\n' % i for i in range(500))
    whole = write(tmp_path / "whole.jsonl", part1 + part2)
    multi = tmp_path / f"multi{suffix}"
    first = write(tmp_path / f"p1{suffix}", part1).read_bytes()
    multi.write_bytes(first + write(tmp_path / f"p2{suffix}", part2).read_bytes())
    plain, plain_stats = read_all(whole)
    packed, packed_stats = read_all(multi, batch_bytes=1000)
    assert texts_of(packed) == texts_of(plain)
    assert packed_stats.bytes_read == plain_stats.bytes_read == len(part1) + len(part2)


def truncated(blob: bytes) -> bytes:
    return blob[: len(blob) // 2]


def corrupted(blob: bytes) -> bytes:
    mid = len(blob) // 2
    return blob[:mid] + bytes(b ^ 0x5A for b in blob[mid : mid + 8]) + blob[mid + 8 :]


@pytest.mark.parametrize(
    ("suffix", "damage", "message"),
    [
        (".jsonl.gz", truncated, "corrupt or truncated gzip stream"),
        (".jsonl.gz", corrupted, "corrupt or truncated gzip stream"),
        (".jsonl.gz", lambda b: b"not gzip at all", "corrupt or truncated gzip stream"),
        (".jsonl.zst", truncated, "corrupt or truncated zstd stream"),
        (".jsonl.zst", lambda b: b[:-1], "input ends inside a frame"),
        (".jsonl.zst", corrupted, "corrupt or truncated zstd stream"),
        (".jsonl.zst", lambda b: b + b"junk", "corrupt or truncated zstd stream"),
    ],
)
def test_damaged_compressed_input_names_the_file(
    tmp_path: Path, suffix: str, damage: object, message: str
) -> None:
    data = b"".join(b'{"text": "document %d %s"}\n' % (i, b"x" * (i % 50)) for i in range(4000))
    path = write(tmp_path / f"bad{suffix}", data)
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    for mode, quarantine in (("fail", None), ("quarantine", Quarantine(tmp_path / "q.jsonl"))):
        with pytest.raises(InputError) as info:
            read_all(path, on_bad_record=mode, quarantine=quarantine)
        assert str(info.value).startswith(f"{path}: ")
        assert message in str(info.value)


def test_empty_and_missing_inputs(tmp_path: Path) -> None:
    for name in ("e.jsonl", "e.jsonl.gz", "e.jsonl.zst"):
        batches, stats = read_all(write(tmp_path / name, b""))
        assert batches == [] and stats.lines == 0
    with pytest.raises(InputError, match=re.escape("nope.jsonl: cannot read")):
        read_all(tmp_path / "nope.jsonl")


def test_settings_are_checked(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", GOOD + b"\n")
    with pytest.raises(ConfigError, match="needs a Quarantine"):
        read_all(path, on_bad_record="quarantine")
    with pytest.raises(ConfigError, match="on_bad_record='skip'"):
        read_all(path, on_bad_record="skip")
    with pytest.raises(ConfigError, match=re.escape("a.json: unsupported")):
        read_all(write(tmp_path / "a.json", GOOD))
    with pytest.raises(ConfigError, match=re.escape("a.txt: unsupported input")):
        read_input_batches(tmp_path / "a.txt")
    # settings and names are checked when the reader is created, before any iteration
    with pytest.raises(ConfigError):
        read_jsonl_batches(tmp_path / "a.json")
    with pytest.raises(ConfigError):
        read_input_batches(path, on_bad_record="quarantine")
    with pytest.raises(InputError):
        read_table_batches(tmp_path / "absent.parquet")


def test_custom_text_key(tmp_path: Path) -> None:
    path = write(tmp_path / "k.jsonl", b'{"content": "c", "text": 1}\n{"text": "t"}\n')
    with pytest.raises(BadRecordError, match=r"k.jsonl:2: missing text key 'content'"):
        read_all(path, text_key="content")


def test_quarantine_commit_discard_and_spooling(tmp_path: Path) -> None:
    empty = Quarantine(tmp_path / "sub" / "empty.quarantine.jsonl")
    empty.path.parent.mkdir()
    empty.path.write_bytes(b"a previous run's bad line\n")
    empty.commit()  # nothing quarantined: no file, and the previous run's file is gone
    assert not empty.path.exists() and empty.count == 0
    assert list(empty.path.parent.iterdir()) == []
    spooled = Quarantine(tmp_path / "s.quarantine.jsonl")
    spooled.add("src.jsonl", 7, "why", b"\x00\xff")
    temps = list(tmp_path.glob(".tmp/s.quarantine.jsonl.tmp-*"))
    assert len(temps) == 1
    assert not spooled.path.exists()
    spooled.discard()
    assert list(tmp_path.glob("s.quarantine.jsonl*")) == []
    assert list(tmp_path.glob(".tmp/s.quarantine.jsonl*")) == []
    with pytest.raises(RuntimeError), Quarantine(tmp_path / "ctx.jsonl") as q:
        q.add("s", 1, "r", b"x")
        raise RuntimeError
    assert list(tmp_path.glob("ctx.jsonl*")) == []
    with Quarantine(tmp_path / "ok.jsonl") as q:
        q.add("s", 1, "r", b"x")
    assert json.loads((tmp_path / "ok.jsonl").read_text()) == {
        "line": 1,
        "raw_b64": "eA==",
        "reason": "r",
        "source": "s",
    }


def test_shard_name(tmp_path: Path) -> None:
    assert shard_name("x/part-00001.jsonl.gz") == "part-00001"
    assert shard_name("part-00001.jsonl.zst") == "part-00001"
    assert shard_name("a.b.jsonl") == "a.b"
    assert shard_name("t.parquet") == "t" and shard_name("t.arrow") == "t"
    assert shard_name(tmp_path) == tmp_path.name
    with pytest.raises(ConfigError, match="cannot name a shard"):
        shard_name("notes.txt")


def _table(n: int) -> pa.Table:
    return pa.table({"text": [f"t{i}" for i in range(n)], "n": list(range(n))})


def test_parquet_and_arrow_files_and_folders(tmp_path: Path) -> None:
    pq.write_table(_table(10), tmp_path / "one.parquet", row_group_size=4)
    batches = list(read_table_batches(tmp_path / "one.parquet", batch_rows=3, keep_records=True))
    assert texts_of(batches) == [f"t{i}" for i in range(10)]
    assert [b.first_line for b in batches] == [1, 4, 7, 10]
    assert batches[0].records == [
        {"text": "t0", "n": 0},
        {"text": "t1", "n": 1},
        {"text": "t2", "n": 2},
    ]
    with (
        pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, _table(5).schema) as writer,
    ):
        writer.write_table(_table(5))
    folder = tmp_path / "hf" / "data"
    folder.mkdir(parents=True)
    for i, name in enumerate(["b", "a"]):
        table = pa.table({"text": [f"{name}{i}{j}" for j in range(3)], "n": [0] * 3})
        with (
            pa.OSFile(str(folder / f"{name}.arrow"), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as writer,
        ):
            writer.write_table(table)
    stats = IngestStats(path="hf")
    assert texts_of(list(read_input_batches(tmp_path / "file.arrow"))) == [
        f"t{i}" for i in range(5)
    ]
    folder_batches = list(read_input_batches(tmp_path / "hf", stats=stats))
    assert texts_of(folder_batches) == ["a10", "a11", "a12", "b00", "b01", "b02"]
    assert [b.first_line for b in folder_batches] == [1, 4]
    assert (stats.lines, stats.documents, stats.bytes_read) == (6, 6, 18)


def test_hf_save_to_disk_folder(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["x", "", "z"], "id": [1, 2, 3]})
    ds.save_to_disk(str(tmp_path / "saved"))
    stats = IngestStats(path="saved")
    batches = list(read_input_batches(tmp_path / "saved", stats=stats, keep_records=True))
    assert texts_of(batches) == ["x", "", "z"]
    assert stats.empty_documents == 1
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ConfigError, match="several splits \\(train\\)"):
        list(read_input_batches(tmp_path / "dict"))


def test_table_errors(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(FormatError, match=re.escape("ints.parquet: text: column has type int64")):
        list(read_table_batches(tmp_path / "ints.parquet"))
    with pytest.raises(
        FormatError, match=r"ints.parquet: body: no such column \(columns: \['text'\]\)"
    ):
        list(read_table_batches(tmp_path / "ints.parquet", text_key="body"))
    pq.write_table(pa.table({"text": ["a", None, "c"], "k": [1, 2, 3]}), tmp_path / "nul.parquet")
    with pytest.raises(BadRecordError, match=re.escape("nul.parquet:2: text is null")):
        list(read_table_batches(tmp_path / "nul.parquet"))
    quarantine = Quarantine(tmp_path / "q.jsonl")
    stats = IngestStats(path="nul")
    batches = list(
        read_table_batches(
            tmp_path / "nul.parquet", on_bad_record="quarantine", quarantine=quarantine, stats=stats
        )
    )
    quarantine.commit()
    assert texts_of(batches) == ["a", "c"]
    assert stats.lines == stats.documents + stats.quarantined + stats.blank == 3
    (entry,) = [json.loads(x) for x in quarantine.path.read_text().splitlines()]
    assert (entry["line"], entry["reason"]) == (2, "text is null")
    assert json.loads(base64.b64decode(entry["raw_b64"])) == {"k": 2, "text": None}
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match=re.escape("junk.parquet: cannot read table")):
        list(read_table_batches(tmp_path / "junk.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=re.escape("no .parquet or .arrow files")):
        list(read_table_batches(tmp_path / "empty"))


def test_quarantine_commit_inside_context_is_final(tmp_path: Path) -> None:
    with Quarantine(tmp_path / "q.jsonl") as q:
        q.add("s", 3, "r", b"raw")
        q.commit()
    assert json.loads((tmp_path / "q.jsonl").read_text())["line"] == 3
    with pytest.raises(ValueError, match="already committed"):
        q.add("s", 4, "r", b"raw")


def test_table_source_name_labels_bad_rows(tmp_path: Path) -> None:
    """A downloaded shard's bad rows name where it came from, not the local copy."""
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("a", "b"):
        pq.write_table(pa.table({"text": ["x", None]}), folder / f"{name}.parquet")
    uri = "s3://bucket/wiki/a.parquet"
    with pytest.raises(BadRecordError, match=re.escape(f"{uri}:2: text is null")):
        list(read_input_batches(folder / "a.parquet", source_name=uri))
    quarantine = Quarantine(tmp_path / "q.jsonl")
    batches = read_input_batches(
        folder, on_bad_record="quarantine", quarantine=quarantine, source_name="s3://bucket/wiki/"
    )
    assert texts_of(list(batches)) == ["x", "x"]
    quarantine.commit()
    entries = [json.loads(x) for x in quarantine.path.read_text().splitlines()]
    assert [(e["source"], e["line"]) for e in entries] == [
        ("s3://bucket/wiki/a.parquet", 2),
        ("s3://bucket/wiki/b.parquet", 2),
    ]
    pq.write_table(pa.table({"text": [1]}), tmp_path / "ints.parquet")
    with pytest.raises(FormatError, match=re.escape(f"{uri}: text: column has type int64")):
        list(read_input_batches(tmp_path / "ints.parquet", source_name=uri))
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match=re.escape(f"{uri}: cannot read table")):
        list(read_input_batches(tmp_path / "junk.parquet", source_name=uri))
