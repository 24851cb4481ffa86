"""Property-based fuzzing of the two readers that face untrusted bytes: the JSONL reader and the
``.idx`` reader. Whatever the input, the only failures are the documented errors, and the JSONL
counts always add up (lines = documents + quarantined + blank)."""

from __future__ import annotations

import json
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.errors import BadRecordError, FormatError
from tokenmill.formats.indexed import IndexedDataset, IndexedDatasetWriter
from tokenmill.formats.shard_records import IngestStats
from tokenmill.ingest.records import Quarantine, read_jsonl_batches

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=6,
)
_good_line = st.builds(
    lambda text, extra: json.dumps({"text": text, **extra}).encode(),
    st.text(),
    st.dictionaries(st.text().filter(lambda k: k != "text"), _json_values, max_size=2),
)
_any_line = st.one_of(
    _good_line,
    st.binary(max_size=40),
    st.builds(lambda v: json.dumps(v).encode(), _json_values),
    st.sampled_from([b"", b"   ", b"\t", b'{"text": "\\ud800"}', b'{"text": 1}', b"\xff\xfe"]),
)


@FUZZ
@given(lines=st.lists(_any_line, max_size=25), crlf=st.booleans(), final_newline=st.booleans())
def test_jsonl_reader_counts_always_add_up(tmp_path, lines, crlf, final_newline):
    lines = [ln.replace(b"\n", b" ").replace(b"\r", b" ") for ln in lines]
    sep = b"\r\n" if crlf else b"\n"
    data = sep.join(lines) + (sep if final_newline and lines else b"")
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(data)
    stats = IngestStats(path=str(path))
    quarantine = Quarantine(tmp_path / "q.jsonl")
    texts = []
    for batch in read_jsonl_batches(
        path, on_bad_record="quarantine", quarantine=quarantine, stats=stats
    ):
        texts += batch.texts
    quarantine.commit()
    assert stats.lines == stats.documents + stats.quarantined + stats.blank
    assert len(texts) == stats.documents
    assert stats.quarantined == quarantine.count
    try:
        failed = sum(len(b.texts) for b in read_jsonl_batches(path))
    except BadRecordError as exc:
        assert 1 <= exc.line <= max(stats.lines, 1)
    else:
        assert failed == stats.documents and stats.quarantined == 0


def _valid_pair(prefix):
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in ([1, 2, 3], [], [4, 5], [6]):
            w.add_document(np.array(doc, dtype=np.uint16))


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 120), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4
    ),
    truncate=st.one_of(st.none(), st.integers(0, 120)),
)
def test_idx_reader_fails_only_with_format_error(tmp_path, edits, truncate):
    prefix = tmp_path / "d"
    _valid_pair(prefix)
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    for offset, patch in edits:
        raw[offset : offset + len(patch)] = patch
    if truncate is not None:
        del raw[truncate:]
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    try:
        ds = IndexedDataset(prefix)
        ds.check_pointers()
    except FormatError:
        return
    for i in range(len(ds)):
        assert len(ds.get(i)) == ds.sequence_lengths[i]
    assert ds.num_tokens == len(ds.tokens)


@FUZZ
@given(header=st.binary(min_size=34, max_size=34), body=st.binary(max_size=64))
def test_idx_reader_on_random_bytes(tmp_path, header, body):
    (tmp_path / "r.idx").write_bytes(header + body)
    (tmp_path / "r.bin").write_bytes(b"")
    try:
        ds = IndexedDataset(tmp_path / "r")
    except FormatError:
        return
    assert ds.num_tokens == 0
    assert struct.unpack("<Q", header[18:26])[0] == len(ds)
