"""The .bin/.idx format: golden bytes (FORMATS §9.1), round trips, validation errors."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from tokenmill.errors import FormatError
from tokenmill.formats.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    encode_index,
    optimal_dtype,
)

GOLDEN_V1 = bytes.fromhex(
    "4d4d4944494458000001000000000000000803000000000000000400000000000000"
    "030000000200000004000000"
    "0000000000000000"
    "0600000000000000"
    "0a00000000000000"
    "0000000000000000"
    "0100000000000000"
    "0200000000000000"
    "0300000000000000"
)


def _write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(np.asarray(d, dtype=dtype))
    return IndexedDataset(prefix)


def test_golden_vector_1_uint16(tmp_path):
    ds = _write(tmp_path / "v1", [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    data = (tmp_path / "v1.idx").read_bytes()
    assert len(data) == 102
    assert data == GOLDEN_V1
    assert (tmp_path / "v1.bin").read_bytes() == np.arange(1, 10, dtype="<u2").tobytes()
    assert ds.get(2).tolist() == [6, 7, 8, 9]


def test_golden_vector_1_int32_pointers(tmp_path):
    _write(tmp_path / "v1", [[1, 2, 3], [4, 5], [6, 7, 8, 9]], dtype=np.int32)
    data = (tmp_path / "v1.idx").read_bytes()
    assert data[17] == 4
    assert np.frombuffer(data, "<i8", 3, 34 + 12).tolist() == [0, 12, 20]


def test_golden_vector_2_sentences(tmp_path):
    with IndexedDatasetWriter(tmp_path / "v2", np.uint16) as w:
        w.add_document(np.arange(5), lengths=[2, 3])
        w.add_document(np.arange(4), lengths=[4])
    data = (tmp_path / "v2.idx").read_bytes()
    assert len(data) == 94
    body = np.array([2, 3, 4], "<i4").tobytes() + np.array([0, 4, 10], "<i8").tobytes()
    assert data[34:] == body + np.array([0, 2, 3], "<i8").tobytes()
    assert data[18:34] == struct.pack("<QQ", 3, 3)


def test_golden_vector_3_empty_document(tmp_path):
    ds = _write(tmp_path / "v3", [[1, 2, 3], [], [4, 5, 6, 7]])
    assert (tmp_path / "v3.idx").stat().st_size == 90
    assert ds.sequence_lengths.tolist() == [3, 4]
    assert ds.document_indices.tolist() == [0, 1, 1, 2]


def test_add_documents_matches_add_document(tmp_path):
    docs = [[1, 2], [], [3], [], [], [4, 5, 6]]
    _write(tmp_path / "a", docs)
    with IndexedDatasetWriter(tmp_path / "b", np.uint16) as w:
        w.add_documents(np.array([1, 2, 3, 4, 5, 6]), [2, 0, 1, 0, 0, 3])
    for ext in ("bin", "idx"):
        assert (tmp_path / f"a.{ext}").read_bytes() == (tmp_path / f"b.{ext}").read_bytes()


def test_zero_documents(tmp_path):
    ds = _write(tmp_path / "z", [])
    assert len(ds) == 0 and ds.num_documents == 0
    assert ds.document_indices.tolist() == [0]
    assert (tmp_path / "z.idx").stat().st_size == 34 + 8
    assert (tmp_path / "z.bin").stat().st_size == 0
    assert ds.tokens.size == 0


def test_encode_index_matches_writer(tmp_path):
    _write(tmp_path / "e", [[1, 2, 3], [], [4]])
    assert encode_index(np.uint16, [3, 1], [0, 1, 1, 2]) == (tmp_path / "e.idx").read_bytes()


@pytest.mark.parametrize(("vocab", "dtype"), [(65499, np.uint16), (65500, np.int32)])
def test_optimal_dtype_boundary(vocab, dtype):
    assert optimal_dtype(vocab) is dtype


def test_round_trip_random(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 2**31 - 1, rng.integers(0, 50)) for _ in range(300)]
    ds = _write(tmp_path / "r", docs, dtype=np.int32)
    nonempty = [d for d in docs if len(d)]
    assert len(ds) == len(nonempty)
    for i, d in enumerate(nonempty):
        assert ds.get(i).tolist() == d.tolist()
    assert ds.get(5, offset=1, length=2).tolist() == nonempty[5][1:3].tolist()
    ds.check_pointers()


def test_exception_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
        w.add_document(np.arange(10))
        raise RuntimeError("boom")
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == [".tmp"]


def test_stale_temp_files_removed(tmp_path):
    (tmp_path / "x.bin.tmp-4194305-abcd").write_bytes(b"junk")  # beside: an older release's
    _write(tmp_path / "x", [[1]])
    (tmp_path / ".tmp" / "x.idx.tmp-4194305-abce").write_bytes(b"junk")  # no pid is above 2**22
    _write(tmp_path / "x", [[2]])
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert files == [".tmp", "x.bin", "x.idx"]


def _corrupt(tmp_path, offset, data):
    _write(tmp_path / "c", [[1, 2, 3], [4, 5]])
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[offset : offset + len(data)] = data
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    return tmp_path / "c"


@pytest.mark.parametrize(
    ("offset", "data", "field"),
    [
        (0, b"XXIDIDX", "magic"),
        (9, struct.pack("<Q", 2), "version"),
        (17, b"\x00", "dtype code"),
        (17, b"\x09", "dtype code"),
        (18, struct.pack("<Q", 99), "sequence_count/document_count"),
        (26, struct.pack("<Q", 99), "sequence_count/document_count"),
    ],
)
def test_header_corruption_is_named(tmp_path, offset, data, field):
    prefix = _corrupt(tmp_path, offset, data)
    with pytest.raises(FormatError) as err:
        IndexedDataset(prefix)
    assert err.value.field == field
    assert str(prefix) + ".idx" in str(err.value)


def test_truncated_idx(tmp_path):
    _write(tmp_path / "t", [[1, 2, 3]])
    raw = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(raw[:-3])
    with pytest.raises(FormatError, match="sequence_count/document_count"):
        IndexedDataset(tmp_path / "t")
    (tmp_path / "t.idx").write_bytes(raw[:20])
    with pytest.raises(FormatError, match="header"):
        IndexedDataset(tmp_path / "t")


def test_bin_size_mismatch(tmp_path):
    _write(tmp_path / "b", [[1, 2, 3]])
    (tmp_path / "b.bin").write_bytes(b"\0" * 4)
    with pytest.raises(FormatError, match=r"b\.bin: size: index says 3 tokens"):
        IndexedDataset(tmp_path / "b")


def test_inconsistent_pointers_and_docs(tmp_path):
    _write(tmp_path / "p", [[1, 2, 3], [4, 5]])
    raw = bytearray((tmp_path / "p.idx").read_bytes())
    raw[34 + 8 + 8 : 34 + 8 + 16] = struct.pack("<q", 4)
    (tmp_path / "p.idx").write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="pointer 1 is 4, lengths imply 6"):
        IndexedDataset(tmp_path / "p").check_pointers()
    raw = bytearray((tmp_path / "p.idx").read_bytes())
    raw[-8:] = struct.pack("<q", 5)
    (tmp_path / "p.idx").write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="document_indices"):
        IndexedDataset(tmp_path / "p")


def test_missing_partner(tmp_path):
    _write(tmp_path / "m", [[1]])
    (tmp_path / "m.bin").unlink()
    with pytest.raises(FormatError, match=r"m\.bin: file: missing"):
        IndexedDataset(tmp_path / "m")


def test_early_writeback_path_keeps_bytes(tmp_path, monkeypatch):
    import tokenmill.formats.indexed as indexed

    docs = [np.arange(i, i + 40) for i in range(50)]
    _write(tmp_path / "plain", docs)
    monkeypatch.setattr(indexed, "WRITEBACK_CHUNK", 64)
    with IndexedDatasetWriter(tmp_path / "wb", np.uint16) as w:
        for d in docs:
            w.add_document(d.astype(np.uint16))
        w.add_index(tmp_path / "plain")
        w.add_document(np.arange(7, dtype=np.uint16))
    ds = IndexedDataset(tmp_path / "wb")
    assert ds.tokens.tolist() == np.concatenate([*docs, *docs, np.arange(7)]).tolist()
    ds.check_pointers()


def test_a_pair_whose_manifest_records_its_tokens_opens_without_scanning(tmp_path, monkeypatch):
    """O(1) open: with the token count recorded, no length or boundary is scanned on open
    (only the header and the file sizes are read); check_pointers still scans everything and
    catches lengths that disagree with the recorded count."""
    from tiny_pairs import random_dataset

    from tokenmill.formats.dataset_manifest import dataset_manifest_path, open_dataset

    prefix = random_dataset(tmp_path / "p", 50, 3, counted=True)
    scans = []
    original = IndexedDataset._scan_index
    monkeypatch.setattr(IndexedDataset, "_scan_index", lambda self: scans.append(self))
    with open_dataset(prefix) as ds:
        assert scans == [] and ds.num_tokens == int(ds.sequence_lengths.sum())
    with IndexedDataset(prefix) as ds:  # no recorded count: the scan runs
        assert len(scans) == 1
    monkeypatch.setattr(IndexedDataset, "_scan_index", original)
    manifest = json.loads(dataset_manifest_path(prefix).read_text())
    manifest["counts"]["tokens"] += 1
    dataset_manifest_path(prefix).write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="size"):  # the .bin size disagrees with the record
        open_dataset(prefix)


def test_rewriting_a_pair_never_exposes_a_missing_idx(tmp_path, monkeypatch):
    """A second writer of the same prefix (two runs of one step) renames over the pair: a reader
    between its two renames finds both files, never "P.idx: missing"."""
    import tokenmill.formats.indexed as indexed

    docs = [[1, 2, 3], [4, 5]]
    _write(tmp_path / "p", docs)
    seen = []

    def commit(tmp, final):
        seen.append((tmp_path / "p.bin").exists() and (tmp_path / "p.idx").exists())
        real_commit(tmp, final)

    real_commit = indexed.commit
    monkeypatch.setattr(indexed, "commit", commit)
    ds = _write(tmp_path / "p", docs)
    assert seen == [True, True]
    assert [ds.get(i).tolist() for i in range(len(ds))] == docs
