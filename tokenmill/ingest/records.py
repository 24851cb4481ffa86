"""The JSONL reader (plain, gzip, zstd shards) and what every input reader shares.

Readers yield ``Batch``es of texts (and, on request, records) in bounded memory. JSONL is read in
large blocks and parsed with orjson; only lines the fast path rejects are classified. A bad line
stops the run (``BadRecordError``, ``FILE:LINE: reason``) or goes to a ``Quarantine`` with its
bytes, so ``lines == documents + quarantined + blank`` always holds.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypedDict

import orjson
import zstandard

from tokenmill.errors import BadRecordError, ConfigError, InputError
from tokenmill.formats.shard_records import IngestStats
from tokenmill.ingest.quarantine import Quarantine

ON_BAD_RECORD = ("fail", "quarantine")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TABLE_SUFFIXES = (".parquet", ".arrow")
BOM = b"\xef\xbb\xbf"
_ZSTD_READ = 1 << 20
_JSON_TYPE_NAMES = {dict: "object", list: "list", str: "string", type(None): "null"}


class ReadOptions(TypedDict, total=False):
    """The keywords every reader takes (see ``read_jsonl_batches`` for their meaning)."""

    text_key: str
    on_bad_record: str
    quarantine: Quarantine | None
    stats: IngestStats | None
    keep_records: bool
    source_name: str | None


@dataclass
class Batch:
    """Documents read together: texts in input order, optional full records, first line number."""

    texts: list[str]
    records: list[dict[str, Any]] | None
    first_line: int


def shard_name(path: str | os.PathLike[str]) -> str:
    """``part-00001`` for ``part-00001.jsonl.gz``: the file name without its input suffix."""
    name = Path(path).name
    for suffix in (".jsonl.gz", ".jsonl.zst", ".jsonl", *TABLE_SUFFIXES):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    if os.path.isdir(path) and name:
        return name
    raise ConfigError(f"{path}: cannot name a shard: expected a name ending in {SUPPORTED_INPUTS}")


SUPPORTED_INPUTS = ", ".join((*JSONL_SUFFIXES, *TABLE_SUFFIXES)) + " (or a dataset folder)"


def _blocks(
    path: str | os.PathLike[str], block: int, byte_range: tuple[int, int] | None = None
) -> Iterator[bytes]:
    """Decompressed content of a JSONL file in blocks of about ``block`` bytes (of a plain file:
    only the bytes ``[start, end)`` of ``byte_range``, when given)."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as fh:
            if byte_range is not None:
                fh.seek(byte_range[0])
                left = byte_range[1] - byte_range[0]
                while left > 0 and (data := fh.read(min(block, left))):
                    left -= len(data)
                    yield data
            elif name.endswith(".gz"):
                with gzip.GzipFile(fileobj=fh, mode="rb") as gz:
                    while data := gz.read(block):
                        yield data
            elif name.endswith(".zst"):
                yield from _zstd_blocks(fh, name, block)
            else:
                while data := fh.read(block):
                    yield data
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise InputError(f"{name}: corrupt or truncated gzip stream: {exc}") from exc
    except zstandard.ZstdError as exc:
        raise InputError(f"{name}: corrupt or truncated zstd stream: {exc}") from exc
    except OSError as exc:
        raise InputError(f"{name}: cannot read: {exc}") from exc


def _zstd_blocks(fh: IO[bytes], name: str, block: int) -> Iterator[bytes]:
    """Frame by frame, so a stream that stops inside a frame is reported as truncated."""
    dctx = zstandard.ZstdDecompressor()
    frame = None
    pending: list[bytes] = []
    size = 0
    while raw := fh.read(_ZSTD_READ):
        while raw:
            frame = frame or dctx.decompressobj()
            pending.append(frame.decompress(raw))
            size += len(pending[-1])
            raw = b""
            if frame.eof:
                raw, frame = frame.unused_data, None
        if size >= block:
            yield b"".join(pending)
            pending, size = [], 0
    if frame is not None:
        raise InputError(f"{name}: corrupt or truncated zstd stream: input ends inside a frame")
    if size:
        yield b"".join(pending)


def _line_chunks(
    blocks: Iterator[bytes], stats: IngestStats, at_start: bool = True
) -> Iterator[tuple[int, list[bytes]]]:
    """``(first line number, lines)`` per block of complete lines (without their ``\\n``); the
    piece after a block's last newline starts the next. A UTF-8 BOM on line 1 is removed and
    noted in ``stats`` when the blocks start the file (``at_start``)."""
    carry: list[bytes] = []
    next_line = 1
    for data in blocks:
        stats.bytes_read += len(data)
        lines = data.split(b"\n")
        if len(lines) == 1:
            carry.append(data)
            continue
        if carry:
            lines[0] = b"".join([*carry, lines[0]])
        carry = [lines.pop()]
        if next_line == 1 and at_start:
            _strip_bom(lines, stats)
        if b"\r" in data or b"\r" in lines[0]:
            stats.crlf_lines += sum(1 for line in lines if line.endswith(b"\r"))
        yield next_line, lines
        next_line += len(lines)
    tail = [b"".join(carry)]
    if tail[0]:
        if next_line == 1 and at_start:
            _strip_bom(tail, stats)
        stats.missing_final_newline = True
        yield next_line, tail


def _strip_bom(lines: list[bytes], stats: IngestStats) -> None:
    if lines[0].startswith(BOM):
        stats.bom = True
        lines[0] = lines[0][len(BOM) :]


def _type_name(value: object) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _encodable(value: object) -> bool:
    """False if a string anywhere in ``value`` (keys included) holds a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_encodable(k) and _encodable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_encodable(v) for v in value)
    return True


def classify_line(line: bytes, text_key: str) -> str | None:
    """Why ``line`` is not a usable record (``None`` for a blank line, which is skipped); only
    for lines the fast path rejected, so it may be slow and thorough."""
    if not line.strip():
        return None
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"invalid UTF-8 at byte {exc.start} (0x{line[exc.start]:02x})"
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        try:
            obj = json.loads(decoded)
            encodable = _encodable(obj)
        except ValueError:
            return f"invalid JSON: {exc}"
        except RecursionError:  # nested deeper than any parser here follows: one bad line
            return f"JSON nested too deeply: {exc}"
        if encodable:
            return f"invalid JSON: {exc}"
    if not isinstance(obj, dict):
        return f"line is not a JSON object (found {_type_name(obj)})"
    if text_key not in obj:
        return f"missing text key {text_key!r}"
    text = obj[text_key]
    if not isinstance(text, str):
        return f"text is not a string (found {_type_name(text)})"
    if not _encodable(text):
        return "text contains a lone surrogate (cannot be encoded as UTF-8)"
    for key, value in obj.items():
        if not (_encodable(key) and _encodable(value)):
            return f"field {key!r} contains a lone surrogate (cannot be encoded as UTF-8)"
    return f"unusable record (text key {text_key!r})"


def check_bad_record_mode(on_bad_record: str, quarantine: Quarantine | None) -> None:
    if on_bad_record not in ON_BAD_RECORD:
        raise ConfigError(f"on_bad_record={on_bad_record!r}: expected one of {ON_BAD_RECORD}")
    if on_bad_record == "quarantine" and quarantine is None:
        raise ConfigError("on_bad_record='quarantine' needs a Quarantine to write bad lines to")


def read_jsonl_batches(
    path: str | os.PathLike[str],
    *,
    text_key: str = "text",
    on_bad_record: str = "fail",
    quarantine: Quarantine | None = None,
    stats: IngestStats | None = None,
    batch_bytes: int = 4 << 20,
    keep_records: bool = False,
    source_name: str | None = None,
    byte_range: tuple[int, int] | None = None,
) -> Iterator[Batch]:
    """Stream a ``.jsonl``/``.jsonl.gz``/``.jsonl.zst`` file as batches of good records, memory
    bounded by ``batch_bytes`` (plus the longest line).

    Bad lines raise ``BadRecordError`` (``fail``) or go to ``quarantine``; a corrupt compressed
    stream raises ``InputError``. ``source_name`` (default: ``path``): how bad lines name their
    file, e.g. an ``s3://`` URI. ``byte_range``: ``[start, end)`` of a plain ``.jsonl``, cut on
    line boundaries, its lines numbered from 1 (a BOM only counts at ``start == 0``).
    """
    check_bad_record_mode(on_bad_record, quarantine)
    name = os.fspath(path)
    if not name.endswith(JSONL_SUFFIXES):
        raise ConfigError(f"{name}: unsupported JSONL file name; expected one of {JSONL_SUFFIXES}")
    if byte_range is not None and not name.endswith(".jsonl"):
        raise ConfigError(f"{name}: a compressed file is read whole, not by byte range")
    st = stats if stats is not None else IngestStats(path=name)
    source = name if source_name is None else source_name

    def batches() -> Iterator[Batch]:
        """The fast path: orjson per line, everything else only for lines it rejects."""
        loads = orjson.loads
        decode_errors = (orjson.JSONDecodeError, TypeError, KeyError)
        blocks = _blocks(name, max(batch_bytes, 1), byte_range)
        at_start = byte_range is None or byte_range[0] == 0
        for first_no, lines in _line_chunks(blocks, st, at_start):
            texts: list[str] = []
            append = texts.append
            records: list[dict[str, Any]] | None = [] if keep_records else None
            bad: list[int] = []
            for i, line in enumerate(lines):
                try:
                    obj = loads(line)
                    text = obj[text_key]
                except decode_errors:
                    bad.append(i)
                    continue
                if text.__class__ is not str:
                    bad.append(i)
                    continue
                append(text)
                if records is not None:
                    records.append(obj)
            st.lines += len(lines)
            for i in bad:
                _handle_bad(source, lines[i], first_no + i, text_key, on_bad_record, quarantine, st)
            if texts:
                st.documents += len(texts)
                st.empty_documents += texts.count("")
                good = 0
                while good < len(bad) and bad[good] == good:
                    good += 1
                yield Batch(texts, records, first_no + good)

    return batches()


def document_lines(
    path: str | os.PathLike[str], text_key: str = "text"
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(1-based line number, record)`` of every line of a JSONL file that becomes a document
    (the test of ``read_jsonl_batches``): the n-th item is the shard's n-th document."""
    loads = orjson.loads
    decode_errors = (orjson.JSONDecodeError, TypeError, KeyError)
    stats = IngestStats(path=os.fspath(path))
    for first_no, lines in _line_chunks(_blocks(path, 4 << 20), stats):
        for i, line in enumerate(lines):
            try:
                obj = loads(line)
                text = obj[text_key]
            except decode_errors:
                continue
            if text.__class__ is str:
                yield first_no + i, obj


def _handle_bad(
    name: str,
    line: bytes,
    line_no: int,
    text_key: str,
    on_bad_record: str,
    quarantine: Quarantine | None,
    stats: IngestStats,
) -> None:
    reason = classify_line(line, text_key)
    if reason is None:
        stats.blank += 1
        return
    if on_bad_record == "fail" or quarantine is None:
        raise BadRecordError(name, line_no, reason)
    raw = BOM + line if line_no == 1 and stats.bom else line
    quarantine.add(name, line_no, reason, raw)
    stats.quarantined += 1
