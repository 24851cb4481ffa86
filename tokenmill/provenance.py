"""Provenance: from a training sample back to its documents and source lines, and back again.

``explain`` is index arithmetic over existing files (FORMATS §5.5): blend sample ``i`` is sample
``k = dataset_sample_index[i]`` of dataset ``dataset_index[i]``; sample-index rows
``j = shuffle_index[k]`` and ``j + 1`` name the ``document_index`` positions it covers and the
token offsets in the first and last; ``tokenmill.lineage`` maps each position (a global sequence
of the merged dataset) to its shard, source line (Parquet/Arrow: row) and record ``id``.
``find`` goes the other way: queries resolve to ``(dataset, shard, ordinal)`` by reading the
source files, then every blend version under ``blends/<name>/versions/`` naming the shard (same
content hash) is searched for that sequence with vectorized scans of its index arrays.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import ConfigError
from tokenmill.formats.blend_manifest import (
    INDEX_ARRAYS,
    index_part_paths,
    load_blend_arrays,
    load_index_parts,
    read_blend_manifest,
    resolve,
)
from tokenmill.formats.dataset_manifest import read_dataset_manifest
from tokenmill.lineage import Merge, Shard, shards_on, text_hash
from tokenmill.loader import NanosetDataset, open_blend
from tokenmill.paths import is_lower_hex
from tokenmill.storage.mirror import local_root, root_of_blend
from tokenmill.storage.store import open_store

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
    """The documents each blend sample of ``split`` holds, piece by piece in sample order (an
    extra token is counted in the last piece). An ``s3://…/blends/<name>`` blend is opened
    through the streaming loader, its shards' raw stats read from its storage root."""
    blend = open_blend(blend_manifest_path, split, version=version)
    root_uri = root_of_blend(os.fspath(blend_manifest_path))
    remote = None if root_uri is None else open_store(root_uri)
    ids = np.asarray(list(sample_ids), dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= len(blend)):
        raise IndexError(f"split {split!r}: samples must lie in [0, {len(blend)})")
    merges = {name: Merge.of_dataset(ds, remote) for name, ds in blend.datasets.items()}
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


def _same_file(uri: str, wanted: str) -> bool:
    if uri == wanted:
        return True
    a, b = Path(uri), Path(wanted)
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.as_posix().endswith("/" + b.as_posix().lstrip("/"))


def resolve_queries(root: str | os.PathLike[str], queries: Sequence[str]) -> list[DocumentRef]:
    """Every shard document a query names, reading a source only where a query may match: a
    ``line`` query its own file, ``sha256`` queries on a ``.dochash.npy`` match, ``id`` and
    ``text`` queries every source once (together). ``s3://``: through a local mirror."""
    if os.fspath(root).startswith("s3://"):
        with local_root(root) as base:
            return resolve_queries(base, queries)
    parsed = [(q, *_parse(q)) for q in queries]
    scans = [(q, kind, value) for q, kind, value in parsed if kind in ("id", "text")]
    hashes = [(q, value.lower()) for q, kind, value in parsed if kind == "sha256"]
    lines = [(q, _LINE_QUERY.match(value)) for q, kind, value in parsed if kind == "line"]
    wanted = np.array(
        [bytes.fromhex(h) if len(h) == 64 and is_lower_hex(h) else b"" for _, h in hashes], "S32"
    )
    refs: list[DocumentRef] = []
    for shard in shards_on(Path(root)):
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
            hits = shard.scan(scans, hash_scan)
            if hits is None:
                continue
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


def _ref(query: str, shard: Shard, ordinal: int) -> DocumentRef:
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
            if sb <= p <= eb and not (p == eb and eo + extra == 0):
                rows.append(j)
    return np.flatnonzero(np.isin(shuffle, np.unique(np.asarray(rows, dtype=np.int64))))


def find(
    root: str | os.PathLike[str],
    queries: Sequence[str],
    *,
    refs: list[DocumentRef] | None = None,
) -> list[Hit]:
    """Every blend version on ``root`` holding a document a query names, with the samples of
    each split holding it (``refs``: ``resolve_queries``' answer, so sources are not read
    again). ``s3://``: through a local mirror."""
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
            merges[entry["name"]] = Merge(prefix, read_dataset_manifest(prefix))
        for ref in refs:
            hit = Hit(ref, str(info["name"]), str(info["version"]))
            for split, part in info["splits"].items():
                blend_arrays: list[np.ndarray] = []
                for d, ds in enumerate(part["datasets"]):
                    merge = merges[ds["name"]]
                    k = merge.where.get((ref.dataset, ref.shard))
                    if k is None or not merge.shards[k].is_current(merge.records[k]):
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


def query_lines(path: str | os.PathLike[str]) -> list[str]:
    """The queries of a file, one a line (blank lines skipped)."""
    return [q for q in Path(path).read_text(encoding="utf-8").splitlines() if q.strip()]
