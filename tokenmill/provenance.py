"""Provenance: from a training sample back to its documents and source lines, and back again.

``explain`` is index arithmetic over files that already exist (FORMATS §5.5): blend sample ``i``
is sample ``k = dataset_sample_index[i]`` of dataset ``dataset_index[i]``; its sample-index rows
``j = shuffle_index[k]`` and ``j + 1`` name the run of ``document_index`` positions it covers and
the token offsets in the first and last; each position is a global sequence (one per document)
of the merged dataset, which the merge's ``shards`` records (virtual and pipeline-made physical
merges both have them) map to ``(shard key, document ordinal)``. The ordinal becomes a source
line through the shard's source file named in its raw stats (``raw/<ds>/<shard>.stats.json``,
checked against the recorded size): the n-th line that ``read_jsonl_batches`` accepts is the
n-th document (blank and quarantined lines skipped), and the document id is that record's
``id`` field (the same record the shard's Parquet export holds). A Parquet/Arrow source
(``format: hf``) names the 1-based row instead; an ``s3://`` source is downloaded once (a temporary
copy) (null texts skipped, ``document_rows``), and a
``line:FILE:N`` query of such a file means row N. No new file is written.

``find`` goes the other way: queries (document id, ``file:line``, text substring, or the sha256
of normalized text) resolve to ``(dataset, shard, ordinal)`` by reading the named source files
(a ``file:line`` query reads only its file); every blend version still under
``blends/<name>/versions/`` that names the shard (same content hash) is then searched for that
global sequence with vectorized scans of its index arrays.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import write_bytes
from tokenmill.errors import ConfigError, FormatError
from tokenmill.formats.blend_manifest import (
    INDEX_ARRAYS,
    index_part_paths,
    load_blend_arrays,
    load_index_parts,
    read_blend_manifest,
    resolve,
)
from tokenmill.formats.dataset_manifest import dataset_manifest_path, read_dataset_manifest
from tokenmill.formats.shard_records import parse_record, read_dochash, read_record, text_digest
from tokenmill.formats.virtual_merge import VirtualDataset
from tokenmill.ingest.records import JSONL_SUFFIXES, TABLE_SUFFIXES, document_lines
from tokenmill.ingest.tables import document_rows
from tokenmill.loader import NanosetDataset, open_blend
from tokenmill.storage.mirror import local_root, root_of_blend
from tokenmill.storage.store import Store, open_store

__all__ = [
    "DocumentRef",
    "Hit",
    "Piece",
    "SampleProvenance",
    "explain",
    "find",
    "query_lines",
    "resolve_queries",
    "text_hash",
]

ID_FIELD = "id"


@dataclass(frozen=True)
class Piece:
    """One run of a document's tokens inside a sample."""

    dataset: str
    shard: str | None  # the shard key; None for a merge without shard records
    document: int  # the document's ordinal in its shard (0-based; one sequence per document)
    sequence: int  # its global sequence id in the merged dataset
    source: str | None  # the shard's source file (the uri its raw stats record)
    line: int | None  # 1-based line of the document in ``source`` (its row for Parquet/Arrow)
    doc_id: str | None  # the record's ``id`` field, if it has one
    sample_range: tuple[int, int]  # [start, stop) of the piece in the sample
    document_range: tuple[int, int]  # [start, stop) of the piece in the document


@dataclass(frozen=True)
class SampleProvenance:
    """Where one blend sample comes from: its dataset sample and its pieces in order."""

    split: str
    sample: int
    version: str
    dataset: str
    dataset_sample: int
    pieces: list[Piece]


@dataclass(frozen=True)
class DocumentRef:
    """A document of a shard, as ``find`` resolved a query to it."""

    query: str
    dataset: str
    shard: str
    document: int
    source: str
    line: int
    doc_id: str | None


@dataclass
class Hit:
    """A document found in one blend version: the samples of each split that hold it."""

    document: DocumentRef
    blend: str
    version: str
    samples: dict[str, list[int]] = field(default_factory=dict)


def text_hash(text: str) -> str:
    """Hex sha256 of ``text`` NFC-normalized (``text_digest``): how ``find`` matches a document's
    text without reading its source."""
    return text_digest(text).hex()


@dataclass
class _Shard:
    """A shard's records: where its pair is, its raw stats and (read once) the source line and
    ``id`` of each document (not the texts: a shard's source may be large)."""

    dataset: str
    key: str
    prefix: Path
    root: Path | None
    documents: int
    remote: Store | None = None  # the S3 root when ``root`` is a loader mirror without records
    _stats: dict[str, Any] | None = None
    _lines: tuple[np.ndarray, list[str | None]] | None = None
    _copy: tempfile.TemporaryDirectory[str] | None = None  # an s3:// source, downloaded once

    def stats(self) -> dict[str, Any] | None:
        """``raw/<ds>/<shard>.stats.json`` (read once), or None when there is none."""
        if self._stats is None and self.root is not None:
            path = self.root / "raw" / self.dataset / f"{self.key}.stats.json"
            if path.is_file():
                self._stats = read_record(path)
            elif self.remote is not None:
                key = f"raw/{self.dataset}/{self.key}.stats.json"
                data = self.remote.read(key)
                if data is not None:
                    shown = f"{getattr(self.remote, 'uri', '')}/{key}"
                    self._stats = parse_record(data, shown)
        return self._stats

    def dochash(self) -> np.ndarray | None:
        """The shard's document hashes (``raw/<ds>/<shard>.dochash.npy``), if written."""
        if self.root is None:
            return None
        path = self.root / "raw" / self.dataset / f"{self.key}.dochash.npy"
        return read_dochash(path, self.documents) if path.is_file() else None

    def source(self) -> str | None:
        stats = self.stats()
        return None if stats is None else str(stats["input"]["uri"])

    def text_key(self) -> str:
        return str((self.stats() or {}).get("config", {}).get("text_key", "text"))

    def records(self) -> Iterator[tuple[int, dict[str, Any]]] | None:
        """``(1-based line, record)`` of each document from the source file, or ``(1-based row,
        record)`` for a Parquet/Arrow source (None when the source is not a JSONL or table file,
        local or ``s3://``, or is gone); FormatError when it no longer matches its stats."""
        stats = self.stats()
        if stats is None:
            return None
        uri = str(stats["input"]["uri"])
        table = uri.endswith(TABLE_SUFFIXES)
        if not (table or uri.endswith(JSONL_SUFFIXES)):
            return None
        path = self._local_source(uri)
        if path is None or not path.is_file():
            return None
        if path.stat().st_size != int(stats["input"]["bytes"]):
            raise FormatError(
                uri,
                "bytes",
                f"{path.stat().st_size}, the raw stats recorded {stats['input']['bytes']}: "
                f"the source changed after shard {self.key!r} was read",
            )
        found = (
            document_rows(path, self.text_key()) if table else document_lines(path, self.text_key())
        )
        return self._checked(path, found)

    def _local_source(self, uri: str) -> Path | None:
        """The source file as a local path: itself, or for an ``s3://`` source a copy in a
        temporary folder (downloaded once, removed with this object); None when not there."""
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
        if self._lines is None:
            found = self.records()
            if found is None:
                return None
            lines, ids = [], []
            for n, record in found:
                lines.append(n)
                value = record.get(ID_FIELD)
                ids.append(None if value is None else str(value))
            self._lines = (np.array(lines, dtype=np.int64), ids)
        return self._lines


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


class _Merge:
    """The shard records of one merged dataset (virtual or pipeline-made physical)."""

    def __init__(
        self, name: str, prefix: Path, manifest: dict[str, Any], remote: Store | None = None
    ) -> None:
        self.name = name
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
            self.shards.append(_Shard(ds, str(s["key"]), sp, root, int(s["documents"]), remote))
        self.where = {(s.dataset, s.key): k for k, s in enumerate(self.shards)}

    def split(self, seq: int) -> tuple[_Shard | None, int]:
        if not self.records:
            return None, seq
        k = int(np.searchsorted(self.first, seq, side="right")) - 1
        return self.shards[k], seq - int(self.first[k])


def _merge_of(name: str, ds: NanosetDataset, remote: Store | None) -> _Merge:
    data = ds.data
    if isinstance(data, VirtualDataset):
        return _Merge(name, data.prefix, data.manifest, remote)
    path = dataset_manifest_path(data.prefix)
    manifest = read_dataset_manifest(data.prefix) if path.is_file() else {}
    return _Merge(name, Path(data.prefix), manifest, remote)


def _pieces(ds: NanosetDataset, k: int) -> list[tuple[int, int, int]]:
    """``(global sequence, start, stop)`` token runs of dataset sample ``k``, in order."""
    j = int(ds.shuffle_index[k])
    (b, bo), (e, eo) = (tuple(int(v) for v in ds.sample_index[r]) for r in (j, j + 1))
    seqs = ds.document_index[b : e + 1].astype(np.int64)
    lengths = ds.data.lengths_of(seqs)
    out = []
    for p, (seq, size) in enumerate(zip(seqs.tolist(), lengths.tolist(), strict=True)):
        start = bo if p == 0 else 0
        stop = eo + ds.extra if p == len(seqs) - 1 else size
        if stop > start:
            out.append((seq, start, stop))
    return out


def explain(
    blend_manifest_path: str | os.PathLike[str],
    split: str,
    sample_ids: Iterable[int],
    *,
    version: str | None = None,
) -> list[SampleProvenance]:
    """The documents each blend sample of ``split`` holds, piece by piece in sample order:
    dataset, shard key, ordinal, source file and 1-based line, the record's ``id``, and the
    token range of the piece in the sample and in its document (an extra token, when the blend
    adds one, is counted in the last piece). An ``s3://…/blends/<name>`` blend is opened through
    the streaming loader and its shards' raw stats are read from its storage root."""
    blend = open_blend(blend_manifest_path, split, version=version)
    root_uri = root_of_blend(os.fspath(blend_manifest_path))
    remote = None if root_uri is None else open_store(root_uri)
    ids = np.asarray(list(sample_ids), dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= len(blend)):
        raise IndexError(f"split {split!r}: samples must lie in [0, {len(blend)})")
    merges = {name: _merge_of(name, ds, remote) for name, ds in blend.datasets.items()}
    out = []
    for i in ids.tolist():
        name = blend.names[int(blend.dataset_index[i])]
        ds = blend.datasets[name]
        k = int(blend.dataset_sample_index[i])
        pieces, at = [], 0
        for seq, start, stop in _pieces(ds, k):
            shard, ordinal = merges[name].split(seq)
            source = line = doc_id = None
            if shard is not None:
                source = shard.source()
                found = shard.read()
                if found is not None:
                    line, doc_id = int(found[0][ordinal]), found[1][ordinal]
            pieces.append(
                Piece(
                    dataset=name,
                    shard=None if shard is None else shard.key,
                    document=ordinal,
                    sequence=seq,
                    source=source,
                    line=line,
                    doc_id=doc_id,
                    sample_range=(at, at + stop - start),
                    document_range=(start, stop),
                )
            )
            at += stop - start
        out.append(SampleProvenance(split, i, blend.version or "", name, k, pieces))
    return out


_LINE_QUERY = re.compile(r"^(?P<file>.+):(?P<line>[0-9]+)$")
QUERY_KINDS = ("id", "line", "text", "sha256")


def _parse(query: str) -> tuple[str, str]:
    kind, sep, value = query.partition(":")
    if not sep or kind not in QUERY_KINDS or not value:
        raise ConfigError(
            f"query {query!r}: expected id:<id>, line:<file>:<line>, text:<substring> or "
            "sha256:<hex of the normalized text>"
        )
    if kind == "line" and not _LINE_QUERY.match(value):
        raise ConfigError(f"query {query!r}: expected line:<file>:<1-based line>")
    return kind, value


def _shards_on(root: Path) -> list[_Shard]:
    """Every shard with raw stats and a tokenized pair under ``root``."""
    out = []
    for stats in sorted((root / "raw").glob("*/*.stats.json")):
        ds, key = stats.parent.name, stats.name[: -len(".stats.json")]
        record = read_record(stats)
        text_key = str(record["config"]["text_key"])
        prefix = root / "tokens" / ds / f"{key}_{text_key}_document"
        out.append(_Shard(ds, key, prefix, root, int(record["documents"]), _stats=record))
    return out


def _same_file(uri: str, wanted: str) -> bool:
    if uri == wanted:
        return True
    a, b = Path(uri), Path(wanted)
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.as_posix().endswith("/" + b.as_posix().lstrip("/"))


def resolve_queries(root: str | os.PathLike[str], queries: Sequence[str]) -> list[DocumentRef]:
    """Every shard document a query names. A shard's source is read only when a query may match
    in it: a ``line`` query reads just its own file; ``sha256`` queries look in the shard's
    ``.dochash.npy`` first (one vectorized compare) and read the source only on a match; ``id``
    and ``text`` queries read every source once (for all of them together). An ``s3://`` root
    is read through a local mirror of its records (``tokenmill.storage.mirror``)."""
    if os.fspath(root).startswith("s3://"):
        with local_root(root) as base:
            return resolve_queries(base, queries)
    parsed = [(q, *_parse(q)) for q in queries]
    scans = [(q, kind, value) for q, kind, value in parsed if kind in ("id", "text")]
    hashes = [(q, value.lower()) for q, kind, value in parsed if kind == "sha256"]
    lines = [(q, _LINE_QUERY.match(value)) for q, kind, value in parsed if kind == "line"]
    wanted = np.array(
        [bytes.fromhex(h) if re.fullmatch(r"[0-9a-f]{64}", h) else b"" for _, h in hashes],
        dtype="S32",
    )
    refs: list[DocumentRef] = []
    for shard in _shards_on(Path(root)):
        source = shard.source() or ""
        mine = [(q, int(m["line"])) for q, m in lines if m and _same_file(source, m["file"])]
        by_hash: list[tuple[str, int]] = []
        hash_scan = hashes
        index = shard.dochash()
        if index is not None and hashes:
            digests = np.frombuffer(index.tobytes(), dtype="S32")
            for d in np.flatnonzero(np.isin(digests, wanted)).tolist():
                by_hash += [
                    (q, d) for (q, _), w in zip(hashes, wanted, strict=True) if w == digests[d]
                ]
            hash_scan = []
        if not (mine or scans or by_hash or hash_scan):
            continue
        if scans or hash_scan:  # one pass over the source: every scan, and the line map
            matched = _scan(shard, scans, hash_scan)
            if matched is None:
                continue
            shard._lines, hits = matched
            refs.extend(_ref(q, shard, d) for q, d in hits)
        found = shard.read()
        if found is None:
            continue
        for q, n in mine:
            at = int(np.searchsorted(found[0], n))
            if at < len(found[0]) and int(found[0][at]) == n:
                refs.append(_ref(q, shard, at))
        refs.extend(_ref(q, shard, d) for q, d in by_hash)
    return refs


def _scan(
    shard: _Shard, scans: list[tuple[str, str, str]], hashes: list[tuple[str, str]]
) -> tuple[tuple[np.ndarray, list[str | None]], list[tuple[str, int]]] | None:
    """One streaming pass over a shard's source: its line map and ``(query, ordinal)`` of every
    ``id``/``text`` scan and ``sha256`` query that matches (None when the source is unreadable)."""
    found = shard.records()
    if found is None:
        return None
    text_key = shard.text_key()
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
    return (np.array(lines, dtype=np.int64), ids), hits


def _ref(query: str, shard: _Shard, ordinal: int) -> DocumentRef:
    lines, ids = shard.read() or (np.zeros(0, dtype=np.int64), [])
    return DocumentRef(
        query,
        shard.dataset,
        shard.key,
        ordinal,
        shard.source() or "",
        int(lines[ordinal]),
        ids[ordinal],
    )


def _samples_holding(ds: dict[str, Any], mpath: Path, seqs: np.ndarray, extra: int) -> np.ndarray:
    """Dataset samples (shuffled order) of one split whose pieces hold any sequence ``seqs``."""
    doc, sample, shuffle = (
        np.asarray(load_index_parts(parts, ndim=2 if kind == "sample" else 1, what=f"{kind}_index"))
        for kind, parts in zip(INDEX_ARRAYS, index_part_paths(ds, mpath), strict=True)
    )
    pos = np.flatnonzero(np.isin(doc, seqs))
    if not pos.size or len(sample) < 2:
        return np.zeros(0, dtype=np.int64)
    first = sample[:, 0].astype(np.int64)
    lo = np.clip(np.searchsorted(first, pos, side="left") - 1, 0, len(sample) - 2)
    hi = np.clip(np.searchsorted(first, pos, side="right") - 1, 0, len(sample) - 2)
    rows = []
    for p, a, b in zip(pos.tolist(), lo.tolist(), hi.tolist(), strict=True):
        for j in range(a, b + 1):
            (sb, _), (eb, eo) = sample[j].tolist(), sample[j + 1].tolist()
            if not sb <= p <= eb or (p == eb and eo + extra == 0):
                continue
            rows.append(j)
    return np.flatnonzero(np.isin(shuffle, np.unique(np.asarray(rows, dtype=np.int64))))


def find(
    root: str | os.PathLike[str],
    queries: Sequence[str],
    *,
    refs: list[DocumentRef] | None = None,
) -> list[Hit]:
    """Every blend version on the storage ``root`` holding a document a query names, with the
    samples of each split that hold it. Queries: ``id:<id>``, ``line:<file>:<line>``,
    ``text:<exact substring>``, ``sha256:<text_hash of the text>`` (``refs``: what
    ``resolve_queries`` already returned for them, so the sources are not read again). An
    ``s3://`` root is read through a local mirror of its records (``tokenmill.storage.mirror``)."""
    if os.fspath(root).startswith("s3://"):
        with local_root(root) as local:
            return find(local, queries, refs=refs)
    base = Path(root)
    refs = resolve_queries(base, queries) if refs is None else refs
    hits: list[Hit] = []
    if not refs:
        return hits
    for mfile in sorted(base.glob("blends/*/versions/*/manifest.json")):
        info = read_blend_manifest(mfile)
        extra = int(bool(info["add_extra_token"]))
        merges = {}
        for entry in info["datasets"]:
            prefix = resolve(mfile, entry["prefix"])
            merges[entry["name"]] = _Merge(entry["name"], prefix, read_dataset_manifest(prefix))
        for ref in refs:
            hit = Hit(ref, str(info["name"]), str(info["version"]))
            for split, part in info["splits"].items():
                blend_arrays: list[np.ndarray] = []
                for d, ds in enumerate(part["datasets"]):
                    merge = merges[ds["name"]]
                    k = merge.where.get((ref.dataset, ref.shard))
                    if k is None or not _current(merge.records[k], merge.shards[k]):
                        continue
                    seq = np.array([int(merge.first[k]) + ref.document], dtype=np.int64)
                    ks = _samples_holding(ds, mfile, seq, extra)
                    if not ks.size:
                        continue
                    if not blend_arrays:
                        blend_arrays = load_blend_arrays(part, mfile)
                    di, dsi = blend_arrays
                    ids = np.flatnonzero((di == d) & np.isin(dsi, ks))
                    if ids.size:
                        hit.samples[split] = ids.tolist()
            if hit.samples:
                hits.append(hit)
    return hits


def _current(record: dict[str, Any], shard: _Shard) -> bool:
    """True when the merge's record of a shard is the shard's current content (so ordinals and
    source lines read today are the ones the version holds)."""
    path = dataset_manifest_path(shard.prefix)
    if not path.is_file():
        return False
    return bool(read_dataset_manifest(shard.prefix).get("content_hash") == record["content_hash"])


def query_lines(path: str | os.PathLike[str]) -> list[str]:
    """The queries of a file, one a line (blank lines skipped)."""
    return [q for q in Path(path).read_text(encoding="utf-8").splitlines() if q.strip()]
