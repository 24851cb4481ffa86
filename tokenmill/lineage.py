"""Lineage of a merged dataset's sequences: the shard each comes from and, through the shard's
raw stats, its source file, line (or row) and record.

A merge's ``shards`` records map a global sequence to ``(shard key, document ordinal)``; the
shard's raw stats (``raw/<ds>/<shard>.stats.json``) name its source file, checked against the
recorded size, whose n-th accepted line is the n-th document (``document_lines``; Parquet/Arrow:
the 1-based row, ``document_rows``) and whose ``id`` field is the document id. An ``s3://``
source is downloaded once, to a temporary copy.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import write_bytes
from tokenmill.errors import FormatError
from tokenmill.formats.dataset_manifest import dataset_manifest_path, read_dataset_manifest
from tokenmill.formats.shard_records import parse_record, read_dochash, read_record, text_digest
from tokenmill.formats.virtual_merge import VirtualDataset
from tokenmill.ingest.records import JSONL_SUFFIXES, TABLE_SUFFIXES, document_lines
from tokenmill.ingest.tables import document_rows
from tokenmill.loader import NanosetDataset
from tokenmill.storage import layout
from tokenmill.storage.store import Store, open_store

ID_FIELD = "id"
# What one pass over a shard's source looks for: ``(query, kind, value)`` of ``id``/``text``
# queries, and ``(query, hex digest)`` of ``sha256`` queries.
Scans = list[tuple[str, str, str]]
Hashes = list[tuple[str, str]]


def text_hash(text: str) -> str:
    """Hex sha256 of ``text`` NFC-normalized (``text_digest``): how ``find`` matches a document's
    text without reading its source."""
    return text_digest(text).hex()


@dataclass
class Shard:
    """A shard's records: where its pair is, its raw stats and (read once) the source line and
    ``id`` of each document (not the texts: a shard's source may be large)."""

    dataset: str
    key: str
    prefix: Path
    root: Path | None
    documents: int
    remote: Store | None = None  # the S3 root when ``root`` is a loader mirror without records
    _stats: dict[str, Any] | None = None
    lines: tuple[np.ndarray, list[str | None]] | None = None  # set by ``scan``
    _copy: tempfile.TemporaryDirectory[str] | None = None  # an s3:// source, downloaded once

    def stats(self) -> dict[str, Any] | None:
        """``raw/<ds>/<shard>.stats.json`` (read once), or None when there is none."""
        if self._stats is None and self.root is not None:
            key = layout.raw_stats(self.dataset, self.key)
            if (self.root / key).is_file():
                self._stats = read_record(self.root / key)
            elif self.remote is not None:
                data = self.remote.read(key)
                if data is not None:
                    self._stats = parse_record(data, f"{getattr(self.remote, 'uri', '')}/{key}")
        return self._stats

    def dochash(self) -> np.ndarray | None:
        """The shard's document hashes (``raw/<ds>/<shard>.dochash.npy``), if written."""
        if self.root is None:
            return None
        path = self.root / layout.dochash(self.dataset, self.key)
        return read_dochash(path, self.documents) if path.is_file() else None

    def source(self) -> str | None:
        stats = self.stats()
        return None if stats is None else str(stats["input"]["uri"])

    def text_key(self) -> str:
        return str((self.stats() or {}).get("config", {}).get("text_key", "text"))

    def records(self) -> Iterator[tuple[int, dict[str, Any]]] | None:
        """``(1-based line or row, record)`` of each document from the source file (None when it
        is not a JSONL or table file, or is gone); FormatError when it does not match its stats."""
        stats, uri = self.stats(), self.source()
        if stats is None or uri is None:
            return None
        table = uri.endswith(TABLE_SUFFIXES)
        if not (table or uri.endswith(JSONL_SUFFIXES)):
            return None
        path = self._local_source(uri)
        if path is None or not path.is_file():
            return None
        size, recorded = path.stat().st_size, stats["input"]["bytes"]
        if size != int(recorded):
            changed = f"the source changed after shard {self.key!r} was read"
            raise FormatError(uri, "bytes", f"{size}, the raw stats recorded {recorded}: {changed}")
        read = document_rows if table else document_lines
        return self._checked(path, read(path, self.text_key()))

    def _local_source(self, uri: str) -> Path | None:
        """The source file as a local path: itself, or an ``s3://`` source's copy in a temporary
        folder (downloaded once, removed with this object); None when not there."""
        if not uri.startswith("s3://"):
            return Path(uri)
        if self._copy is None:
            folder, _, name = uri.rpartition("/")
            data = open_store(folder).read(name)
            if data is None:
                return None
            self._copy = tempfile.TemporaryDirectory(prefix="tokenmill-source-")
            write_bytes(Path(self._copy.name) / name, data)
        return Path(self._copy.name) / uri.rpartition("/")[2]

    def _checked(
        self, path: Path, found: Iterator[tuple[int, dict[str, Any]]]
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        count = 0
        for item in found:
            count += 1
            yield item
        if count != self.documents:
            raise FormatError(
                path, "documents", f"{count} documents, shard {self.key!r} has {self.documents}"
            )

    def read(self) -> tuple[np.ndarray, list[str | None]] | None:
        """1-based source line and ``id`` of each document (read once; see ``records``)."""
        if self.lines is None:
            self.scan([], [])
        return self.lines

    def scan(self, scans: Scans, hashes: Hashes) -> list[tuple[str, int]] | None:
        """One streaming pass over the source: keeps its line map (``read``) and returns
        ``(query, ordinal)`` of every ``id``/``text`` scan and ``sha256`` query that matches
        (None when the source is unreadable)."""
        found = self.records()
        if found is None:
            return None
        text_key = self.text_key()
        lines, ids, hits = [], [], []
        for ordinal, (n, record) in enumerate(found):
            value = record.get(ID_FIELD)
            doc_id = None if value is None else str(value)
            lines.append(n)
            ids.append(doc_id)
            text = record[text_key]
            for q, kind, wanted in scans:
                if (kind == "id" and doc_id == wanted) or (kind == "text" and wanted in text):
                    hits.append((q, ordinal))
            if hashes:
                digest = text_hash(text)
                hits.extend((q, ordinal) for q, h in hashes if h == digest)
        self.lines = (np.array(lines, dtype=np.int64), ids)
        return hits

    def is_current(self, record: dict[str, Any]) -> bool:
        """True when a merge's ``record`` of this shard is its current content (so ordinals and
        source lines read today are the ones the merge holds)."""
        if not dataset_manifest_path(self.prefix).is_file():
            return False
        manifest = read_dataset_manifest(self.prefix)
        return bool(manifest.get("content_hash") == record["content_hash"])


def shards_on(root: Path) -> list[Shard]:
    """Every shard with raw stats and a tokenized pair under ``root``."""
    out = []
    for stats in sorted((root / "raw").glob("*/*.stats.json")):
        ds, key = stats.parent.name, stats.name[: -len(".stats.json")]
        record = read_record(stats)
        prefix = root / layout.tokens_prefix(ds, key, str(record["config"]["text_key"]))
        out.append(Shard(ds, key, prefix, root, int(record["documents"]), _stats=record))
    return out


def _storage_root(prefix: Path, dataset: str) -> Path | None:
    """The storage root above ``tokens/<ds>/<pair>``, or None for a pair elsewhere."""
    folder = prefix.parent
    if folder.name == dataset and folder.parent.name == "tokens":
        return folder.parent.parent
    return None


def _pair_of_physical(prefix: Path, key: str) -> Path:
    """``<root>/tokens/<ds>/<key>_<text_key>_document``: the pair of shard ``key`` of a physical
    merge the pipeline wrote at ``<root>/merged/<ds>/<v16>/<ds>_<text_key>_document``."""
    ds = prefix.parent.parent.name
    text_key = prefix.name.removeprefix(f"{ds}_").removesuffix("_document")
    root = prefix.parent.parent.parent.parent
    if prefix.parent.parent.parent.name != "merged" or text_key == prefix.name:
        return prefix.parent / f"{key}_document"  # not the pipeline's layout: no root found
    return root / "tokens" / ds / f"{key}_{text_key}_document"


class Merge:
    """The shard records of one merged dataset (virtual or pipeline-made physical)."""

    def __init__(self, prefix: Path, manifest: dict[str, Any], remote: Store | None = None) -> None:
        records = manifest.get("shards") or []
        self.records = records
        self.first = np.zeros(len(records) + 1, dtype=np.int64)
        np.cumsum([int(s["sequences"]) for s in records], out=self.first[1:])
        self.shards = []
        for s in records:
            if "prefix" in s:  # a virtual merge: the pair's place relative to the merge's
                sp = Path(os.path.normpath(prefix.parent / str(s["prefix"])))
            else:  # a physical merge at merged/<ds>/<v16>/<ds>_<text_key>_document
                sp = _pair_of_physical(prefix, str(s["key"]))
            ds = sp.parent.name
            root = _storage_root(sp, ds)
            self.shards.append(Shard(ds, str(s["key"]), sp, root, int(s["documents"]), remote))
        self.where = {(s.dataset, s.key): k for k, s in enumerate(self.shards)}

    @classmethod
    def of_dataset(cls, ds: NanosetDataset, remote: Store | None) -> Merge:
        """The merge a loader's dataset reads (no records for a pair without a manifest)."""
        data = ds.data
        if isinstance(data, VirtualDataset):
            return cls(data.prefix, data.manifest, remote)
        path = dataset_manifest_path(data.prefix)
        manifest = read_dataset_manifest(data.prefix) if path.is_file() else {}
        return cls(Path(data.prefix), manifest, remote)

    def split(self, seq: int) -> tuple[Shard | None, int]:
        """The shard holding global sequence ``seq`` and the sequence's ordinal in it."""
        if not self.records:
            return None, seq
        k = int(np.searchsorted(self.first, seq, side="right")) - 1
        return self.shards[k], seq - int(self.first[k])
