"""A dataset read from S3 (``open_blend("s3://...")``): a pair or a virtual merge whose ``.bin``
and ``.idx`` are both read by blocks through the node-local cache (``_s3``).

It opens from what the manifests record (counts, dtype, file sizes, block records), so its open
fetches no index file; a batch reads the index entries it needs, then its token blocks. A file's
S3 key is the one its mirrored path ``<cache>/files/<bucket>/<key>`` names.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import FormatError
from tokenmill.formats.dataset_manifest import (
    BLOCK_BYTES,
    dataset_manifest_path,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import HEADER_SIZE, data_file_path, index_file_path, parse_header
from tokenmill.formats.virtual_merge import is_virtual, masked_sequences
from tokenmill.loader._s3 import OPEN_BLOCKS, BlockCache, RemoteFile, cache_for

COUNTS = ("num_sequences", "num_tokens")  # what a blend's entry of a pair records


class RemoteFiles:
    """Byte ranges of a dataset's files of one kind (one per part) read through the cache."""

    def __init__(self, files: list[RemoteFile], cache: BlockCache) -> None:
        self.files, self.cache = files, cache
        self._block_bytes = np.array([f.block_bytes for f in files], dtype=np.int64)
        self._stride = max(f.blocks for f in files) + 1  # blocks per key

    def _plan(
        self, parts: np.ndarray, starts: np.ndarray, stops: np.ndarray
    ) -> tuple[list[tuple[RemoteFile, int]], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The distinct (file, block) the non-empty byte ranges touch, and per piece (empty
        ones dropped: they add no bytes): the position of its first block in that list, and
        its range within that block (array arithmetic; ``hi > block size``: it spans blocks)."""
        keep = stops > starts
        if not bool(keep.all()):
            parts, starts, stops = parts[keep], starts[keep], stops[keep]
        sizes = self._block_bytes[parts]
        first = starts // sizes
        last = np.maximum(first, (stops - 1) // sizes)
        keys = parts.astype(np.int64) * self._stride + first
        spans = np.flatnonzero(last > first)
        extra = [
            int(p) * self._stride + i
            for p, a, b in zip(
                parts[spans].tolist(), first[spans].tolist(), last[spans].tolist(), strict=True
            )
            for i in range(a + 1, b + 1)
        ]
        uniq = np.unique(np.concatenate([keys, np.asarray(extra, dtype=np.int64)]))
        wanted = [
            (self.files[int(k) // self._stride], int(k) % self._stride) for k in uniq.tolist()
        ]
        base = first * sizes
        return wanted, np.searchsorted(uniq, keys), starts - base, stops - base, sizes

    def gather(
        self,
        parts: np.ndarray,
        starts: np.ndarray,
        stops: np.ndarray,
        also: list[tuple[RemoteFile, int]] | None = None,
    ) -> bytes:
        """The bytes of every range back to back (missing blocks fetched first: parallel range
        GETs, with the blocks ``also`` lists, which the next read needs): one memoryview slice
        of a mapped block per range, as from a local memmap."""
        wanted, where, los, his, sizes = self._plan(parts, starts, stops)
        views = self.cache.views(wanted + (also or []))
        chunks = [
            views[k][lo:hi]
            for k, lo, hi in zip(where.tolist(), los.tolist(), his.tolist(), strict=True)
        ]
        for j in np.flatnonzero(his > sizes).tolist():  # spans blocks: piece by piece
            k, lo, hi, size = int(where[j]), int(los[j]), int(his[j]), int(sizes[j])
            out = []
            while hi > 0:
                out.append(views[k][max(lo, 0) : min(hi, size)])
                k, lo, hi = k + 1, lo - size, hi - size
            chunks[j] = b"".join(out)
        return b"".join(chunks)

    def prefetch(self, parts: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> None:
        """Fetch the blocks these ranges need, in the background."""
        self.cache.prefetch(self._plan(parts, starts, stops)[0])


@dataclass(frozen=True)
class RemoteView:
    """The bytes of one part's file, sliced as ``view[lo:hi]`` -> bytes through the cache."""

    files: RemoteFiles
    part: int

    def __len__(self) -> int:
        return self.files.files[self.part].size

    def __getitem__(self, where: slice) -> bytes:
        lo, hi, _ = where.indices(len(self))
        at = np.array([self.part])
        return self.files.gather(at, np.array([lo]), np.array([max(lo, hi)]))


@dataclass(frozen=True)
class RemotePair:
    """One ``.bin``/``.idx`` pair of a remote dataset (the dataset, or a shard of a merge)."""

    bin: RemoteFile
    idx: RemoteFile
    sequences: int


class RemoteData:
    """A remote pair or virtual merge with the reading surface of ``IndexedDataset``:
    lengths and pointers from ``.idx`` blocks, tokens from ``.bin`` blocks."""

    remote = True

    def __init__(
        self,
        prefix: Path,
        pairs: list[RemotePair],
        cache: BlockCache,
        *,
        dtype: np.dtype[Any],
        num_tokens: int,
        num_documents: int,
        where: object,
        recorded: dict[str, Any] | None = None,
        keys: list[str] | None = None,
        masked: np.ndarray | None = None,
    ) -> None:
        self.prefix, self.dtype, self.idx_path = prefix, dtype, where
        self.pairs, self.cache = pairs, cache
        self.files = [p.bin for p in pairs]
        self.num_parts = len(pairs)
        self.num_tokens = num_tokens
        self.num_documents = num_documents
        self.masked = np.zeros(0, dtype=np.int64) if masked is None else masked  # taken down
        if keys is not None:
            self.keys = keys  # a merge's shard keys (errors name the shard of a sequence)
        self.first_sequence = np.zeros(len(pairs) + 1, dtype=np.int64)
        np.cumsum([p.sequences for p in pairs], out=self.first_sequence[1:])
        self._sequences = self.first_sequence[1:] - self.first_sequence[:-1]
        self._recorded = recorded  # a pair's counts from its blend entry: what pickles send
        self._bins = RemoteFiles(self.files, cache)
        self._idxs = RemoteFiles([p.idx for p in pairs], cache)
        self._headers: set[int] = set()  # parts whose .idx header was checked
        # parts whose .idx is one block: lengths and pointers viewed on its mapped file, the
        # OPEN_BLOCKS last used (a held mapping keeps an evicted block's disk space in use)
        self._tables: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._last: tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        for p in pairs:
            pointers = p.idx.size - HEADER_SIZE - 12 * p.sequences  # document index bytes
            if pointers % 8 or pointers < 8:
                raise FormatError(
                    p.idx.uri, "size", f"{p.idx.size} bytes cannot hold {p.sequences} sequences"
                )
        total = sum(f.size for f in self.files)
        if total != num_tokens * dtype.itemsize:
            raise FormatError(
                self.files[0].uri,
                "size",
                f"the manifests record {num_tokens} tokens x {dtype.itemsize} B and "
                f"{total} bytes of token files",
            )

    def __len__(self) -> int:
        return int(self.first_sequence[-1])

    def _index(self, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(part, length, byte pointer in that part's ``.bin``) of sequences ``seq``, read from
        the ``.idx`` blocks holding them with the headers of parts not read yet (one fetch;
        the last answer is kept: ``pieces`` asks for lengths, then pointers, of one array)."""
        seq = np.asarray(seq, dtype=np.int64)
        last = self._last
        if last is not None and last[0].shape == seq.shape and np.array_equal(last[0], seq):
            return last[1]
        if seq.size and (int(seq.min()) < 0 or int(seq.max()) >= len(self)):
            raise IndexError(f"{self.prefix}: a sequence outside [0, {len(self)})")
        if self.num_parts == 1:
            part, local = np.zeros(len(seq), dtype=np.int64), seq
        else:
            part = np.searchsorted(self.first_sequence, seq, side="right") - 1
            local = seq - self.first_sequence[part]
        tables = self._mapped_index(part, local)
        if tables is not None:
            found = (part, *tables)
            self._last = (seq.copy(), found)
            return found
        new = np.array(
            [p for p in np.unique(part).tolist() if p not in self._headers], dtype=np.int64
        )
        fresh = [self.pairs[p] for p in new.tolist()]
        if fresh:  # their block lists (a shard's manifest) come while the index is read
            self.cache.prefetch_lists([f for pair in fresh for f in (pair.bin, pair.idx)])
        # and so does a token file of one block: the batch needs it, whatever the pointers
        also = [(pair.bin, 0) for pair in fresh if pair.bin.blocks == 1]
        lengths_at = HEADER_SIZE + 4 * local
        pointers_at = HEADER_SIZE + 4 * self._sequences[part] + 8 * local
        starts = np.concatenate([np.zeros(len(new), dtype=np.int64), lengths_at, pointers_at])
        widths = np.repeat(np.array([HEADER_SIZE, 4, 8]), [len(new), len(seq), len(seq)])
        blob = self._idxs.gather(np.concatenate([new, part, part]), starts, starts + widths, also)
        for k, p in enumerate(new.tolist()):
            self._check_header(p, blob[k * HEADER_SIZE : (k + 1) * HEADER_SIZE])
        at = len(new) * HEADER_SIZE
        lengths = np.frombuffer(blob, dtype="<i4", count=len(seq), offset=at).astype(np.int64)
        pointers = np.frombuffer(blob, dtype="<i8", count=len(seq), offset=at + 4 * len(seq))
        found = (part, lengths, pointers.astype(np.int64))
        self._last = (seq.copy(), found)
        return found

    def _mapped_index(
        self, part: np.ndarray, local: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(length, pointer) of sequences ``local`` of parts ``part`` indexed straight from
        the mapped block of each part's one-block ``.idx``, as from a local memmap (no byte
        ranges gathered); None while a part's header is unchecked, its ``.idx`` spans blocks
        or its block is not yet a file in the cache."""
        parts = np.unique(part).tolist()
        tables = []
        for p in parts:
            table = self._tables.get(p)
            if table is None:
                pair = self.pairs[p]
                if p not in self._headers or pair.idx.blocks != 1:
                    return None
                (view,) = self.cache.views([(pair.idx, 0)])
                if not isinstance(view.obj, mmap.mmap):  # served from memory while stored
                    return None
                n = pair.sequences
                table = self._tables[p] = (
                    np.frombuffer(view, dtype="<i4", count=n, offset=HEADER_SIZE),
                    np.frombuffer(view, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n),
                )
                while len(self._tables) > OPEN_BLOCKS:
                    self._tables.popitem(last=False)
            else:
                self._tables.move_to_end(p)
            tables.append(table)
        if len(tables) == 1:
            return tables[0][0][local].astype(np.int64), tables[0][1][local].astype(np.int64)
        lengths, pointers = np.empty(len(local), np.int64), np.empty(len(local), np.int64)
        for p, (part_lengths, part_pointers) in zip(parts, tables, strict=True):
            mine = part == p
            lengths[mine], pointers[mine] = part_lengths[local[mine]], part_pointers[local[mine]]
        return lengths, pointers

    def _check_header(self, part: int, head: bytes) -> None:
        """FormatError naming the ``.idx`` when its header disagrees with the records."""
        pair = self.pairs[part]
        where = pair.idx.uri
        dtype, n_seq, n_doc = parse_header(head, where)
        if dtype != self.dtype:
            raise FormatError(
                where, "dtype code", f"found {head[17]}, the manifests record {self.dtype}"
            )
        if n_seq != pair.sequences or HEADER_SIZE + 12 * n_seq + 8 * n_doc != pair.idx.size:
            raise FormatError(
                where,
                "sequence_count/document_count",
                f"counts {n_seq}/{n_doc}, the manifests record {pair.sequences} sequences "
                f"and {pair.idx.size} bytes",
            )
        self._headers.add(part)

    def lengths_of(self, seq: np.ndarray) -> np.ndarray:
        """Lengths of sequences ``seq`` (int64)."""
        return self._index(seq)[1]

    def locate(self, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(part, byte offset in that part's ``.bin``) of sequences ``seq``."""
        part, _, pointers = self._index(seq)
        return part, pointers

    def buffer(self, part: int) -> RemoteView:
        """The bytes of part ``part``'s ``.bin``, read by blocks."""
        return RemoteView(self._bins, part)

    def gather(self, parts: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> bytes:
        """The bytes of every piece of the ``.bin`` files back to back."""
        return self._bins.gather(parts, starts, stops)

    def prefetch(self, plan: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """Fetch what future batches need, in the background: ``plan()`` (their byte ranges
        in the ``.bin`` files: it reads their index blocks) runs on the planning thread."""
        self.cache.later(lambda: self._bins.prefetch(*plan()))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the local prefix, a pair's counts and the cache settings: no data, no block
        record (the receiver reads those from the manifests mirrored in the cache)."""
        args = (str(self.prefix), self._recorded, str(self.cache.root), self.cache.capacity)
        return (_reopen_remote, args)


def _reopen_remote(
    prefix: str, recorded: dict[str, Any] | None, root: str, capacity: int | None
) -> RemoteData:
    """Inverse of ``RemoteData.__reduce__`` (a DataLoader worker on the same node)."""
    return remote_dataset(Path(prefix), recorded, cache_for(root, capacity))


def remote_dataset(prefix: Path, recorded: dict[str, Any] | None, cache: BlockCache) -> RemoteData:
    """The dataset mirrored at ``prefix``: a pair from its blend entry's counts (``recorded``)
    and its dataset manifest's block records, or a virtual merge from its manifest."""
    manifest = read_dataset_manifest(prefix)
    if is_virtual(manifest):
        return _merge(prefix, manifest, cache)
    if recorded is None or not all(type(recorded.get(c)) is int for c in COUNTS):
        raise FormatError(
            prefix, "blend entry", "records no num_sequences/num_tokens: rebuild the blend"
        )
    pair = _pair(prefix, manifest["files"], recorded["num_sequences"], cache.root)
    counts = {c: recorded[c] for c in (*COUNTS, "dtype")}
    return RemoteData(
        prefix,
        [pair],
        cache,
        dtype=np.dtype(str(recorded["dtype"])),
        num_tokens=recorded["num_tokens"],
        num_documents=(pair.idx.size - HEADER_SIZE - 12 * pair.sequences) // 8 - 1,
        where=pair.idx.uri,
        recorded=counts,
    )


def _merge(prefix: Path, manifest: dict[str, Any], cache: BlockCache) -> RemoteData:
    """A virtual merge read from S3: its shards from the merge's records."""
    pairs = []
    for shard in manifest["shards"]:
        path = Path(os.path.normpath(prefix.parent / str(shard["prefix"])))
        records = {
            data_file_path(path).name: shard["files"]["bin"],
            index_file_path(path).name: shard["files"]["idx"],
        }
        pairs.append(_pair(path, records, int(shard["sequences"]), cache.root))
    return RemoteData(
        prefix,
        pairs,
        cache,
        dtype=np.dtype(str(manifest["dtype"])),
        num_tokens=int(manifest["counts"]["tokens"]),
        num_documents=int(manifest["counts"]["documents"]),
        where=dataset_manifest_path(prefix),
        keys=[str(s["key"]) for s in manifest["shards"]],
        masked=masked_sequences(manifest),
    )


def _pair(prefix: Path, records: dict[str, Any], sequences: int, root: Path) -> RemotePair:
    """The pair mirrored at ``prefix`` with its files' ``records`` (by file name)."""
    return RemotePair(
        _remote_file(data_file_path(prefix), records, root),
        _remote_file(index_file_path(prefix), records, root),
        sequences,
    )


def _remote_file(path: Path, records: dict[str, Any], root: Path) -> RemoteFile:
    """The S3 object mirrored at ``path`` (``<root>/files/<bucket>/<key>``) with the size,
    sha256 and block record (a list, or a list's digest) that ``records[path.name]`` holds."""
    try:
        bucket, *key = path.relative_to(root / "files").parts
    except ValueError:
        bucket, key = "", []
    info = records.get(path.name)
    if not key or not isinstance(info, dict):
        raise FormatError(path, "files", "is not among the blend's files")
    size = int(info["bytes"])
    hashes = tuple(str(h) for h in info.get("block_sha256", ()))
    block = int(info.get("block_bytes", BLOCK_BYTES))
    if block < 1 or (hashes and len(hashes) != -(-size // block)):
        raise FormatError(path, "block_sha256", f"{len(hashes)} hashes of {block} B for {size} B")
    listed = "" if hashes else str(info.get("block_list_sha256", ""))
    return RemoteFile(
        bucket, "/".join(key), size, block, hashes, listed, str(info.get("sha256", ""))
    )
