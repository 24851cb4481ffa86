"""Megatron "MMIDIDX" pair, byte-exact; over 400 lines: its layout, reader and writer stay together.

``P.bin`` holds the tokens, ``P.idx`` the index.

``.idx`` layout (little-endian):

    0   9 B   magic  b"MMIDIDX\\x00\\x00"
    9   8 B   version u64 = 1
    17  1 B   dtype code u8 (see DTYPE_CODES)
    18  8 B   sequence_count u64 = N
    26  8 B   document_count u64 = D = number of documents + 1
    34  4N    sequence_lengths int32
    ..  8N    sequence_pointers int64 (byte offsets into .bin, recomputed from lengths)
    ..  8D    document_indices int64 (starts at 0, ends at N; repeats for empty documents)

``.bin`` is the bare concatenation of all sequences in the token dtype. Writers go through a
temporary name, fsync and rename, so an interrupted write never leaves a final-named pair; their
kernel I/O (``_writer_io``) is imported lazily, so readers never load it.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import os
import struct
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from tokenmill.atomic import CommitOnExit, commit, create_temp, name_os_errors, remove_stale_temps
from tokenmill.errors import FormatError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
UINT16_VOCAB_LIMIT = 65500
WRITEBACK_CHUNK = 32 << 20  # bytes written between two early-writeback requests


def data_file_path(prefix: str | os.PathLike[str]) -> Path:
    """``P.bin`` for prefix ``P``."""
    return Path(f"{os.fspath(prefix)}.bin")


def index_file_path(prefix: str | os.PathLike[str]) -> Path:
    """``P.idx`` for prefix ``P``."""
    return Path(f"{os.fspath(prefix)}.idx")


def dtype_code(dtype: npt.DTypeLike) -> int:
    """The MMIDIDX code of a numpy dtype; raises ValueError for dtypes the format lacks."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise ValueError(f"dtype {dt} has no MMIDIDX code (allowed: {sorted(map(str, _CODE_OF))})")
    return _CODE_OF[dt]


def parse_header(head: bytes, where: object) -> tuple[np.dtype[Any], int, int]:
    """(dtype, sequence count, document count) of a ``.idx`` header's ``HEADER_SIZE`` bytes;
    FormatError naming ``where`` for a wrong magic, version or dtype code."""
    if head[:9] != MAGIC:
        raise FormatError(where, "magic", f"found {head[:9]!r}, expected {MAGIC!r}")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise FormatError(where, "version", f"found {version}, expected {VERSION}")
    code = head[17]
    if code not in DTYPE_CODES:
        raise FormatError(where, "dtype code", f"found {code}, allowed {sorted(DTYPE_CODES)}")
    n_seq, n_doc = struct.unpack("<QQ", head[18:HEADER_SIZE])
    return np.dtype(DTYPE_CODES[code]), n_seq, n_doc


def optimal_dtype(vocab_size: int) -> type[np.generic]:
    """Megatron's rule: uint16 when the vocabulary has fewer than 65500 entries, else int32."""
    return np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32


def _pointers(lengths: np.ndarray, itemsize: int) -> np.ndarray:
    """Each sequence's byte offset in ``.bin``: the running sum of the lengths before it."""
    pointers = np.zeros(len(lengths), dtype="<i8")
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    return pointers * itemsize


def encode_index(
    dtype: npt.DTypeLike,
    sequence_lengths: npt.ArrayLike,
    document_indices: npt.ArrayLike,
) -> bytes:
    """The exact ``.idx`` bytes for the given lengths and document boundaries."""
    lengths = np.ascontiguousarray(sequence_lengths, dtype="<i4")
    docs = np.ascontiguousarray(document_indices, dtype="<i8")
    pointers = _pointers(lengths, np.dtype(dtype).itemsize)
    header = MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", dtype_code(dtype))
    header += struct.pack("<QQ", len(lengths), len(docs))
    return header + lengths.tobytes() + pointers.tobytes() + docs.tobytes()


def _extend(buf: array.array[int], values: npt.ArrayLike) -> None:
    """Append ``values`` to ``buf`` cast to its C type, through one bytes copy."""
    buf.frombytes(np.asarray(values, dtype=buf.typecode).tobytes())


class IndexedDatasetWriter(CommitOnExit):
    """Builder for a ``.bin``/``.idx`` pair (Megatron ``IndexedDatasetBuilder`` semantics); as a
    context manager, ``finalize`` on a clean exit, nothing left at the prefix on an exception."""

    def __init__(self, prefix: str | os.PathLike[str], dtype: npt.DTypeLike = np.int32) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        for final in (data_file_path(prefix), index_file_path(prefix)):
            remove_stale_temps(final)
        # Held open across add_* calls until finalize/abort, so no context manager here.
        self._bin_tmp, opened = create_temp(
            data_file_path(prefix),
            lambda t: open(t, "wb"),  # noqa: SIM115
        )
        self._bin: IO[bytes] | None = opened
        # Append-only C arrays (amortized growth, no per-item Python objects).
        self._lengths = array.array("i")
        self._docs = array.array("q", [0])
        self._done = False
        # sha256 of the bytes as written (None once add_index copied bytes in the kernel).
        self._bin_hash: Any = hashlib.sha256()
        self._bin_size = 0
        self._idx_digest: dict[str, Any] | None = None
        # Early disk writeback, so finalize's fsync has little left (imported here: see module).
        from tokenmill.formats._writer_io import Writeback

        self._writeback = Writeback(self._bin.fileno())
        self._written_back = 0

    # -- adding data ---------------------------------------------------------------------
    def _open_bin(self) -> IO[bytes]:
        """The ``.bin`` temp being written; RuntimeError once finalized or aborted."""
        if self._bin is None:
            raise RuntimeError(f"{self.prefix}: writer already finalized or aborted")
        return self._bin

    def _write_tokens(self, tokens: np.ndarray) -> None:
        bin_file = self._open_bin()
        data = np.ascontiguousarray(tokens, dtype=self.dtype).data.cast("B")
        with name_os_errors(data_file_path(self.prefix)):
            bin_file.write(data)
            self._bin_size += data.nbytes
            if self._bin_hash is not None:
                self._bin_hash.update(data)
            self._write_back(bin_file.tell(), bin_file)

    def _write_back(self, end: int, flush: IO[bytes] | None = None) -> None:
        """Ask the kernel to write back ``.bin`` up to ``end`` once a chunk more is there
        (``flush``: the file whose buffered bytes go to the kernel first)."""
        if end - self._written_back >= WRITEBACK_CHUNK:
            if flush is not None:
                flush.flush()
            self._writeback.add(self._written_back, end - self._written_back)
            self._written_back = end

    def _add_document_lengths(self, lens: np.ndarray) -> None:
        """Record one-sequence documents of lengths ``lens``; a zero length is an empty
        document: no sequence, a repeated boundary (FORMATS §1.3)."""
        base = len(self._lengths)
        nonempty = lens > 0
        _extend(self._lengths, lens[nonempty])
        _extend(self._docs, base + np.cumsum(nonempty, dtype=np.int64))

    def add_item(self, tokens: npt.ArrayLike) -> None:
        """Append one sequence without closing the document."""
        arr = np.asarray(tokens)
        self._write_tokens(arr)
        _extend(self._lengths, np.array([arr.size]))

    def end_document(self) -> None:
        """Close the current document (appends the sequence count as a boundary)."""
        self._docs.append(len(self._lengths))

    def add_document(self, tokens: npt.ArrayLike, lengths: npt.ArrayLike | None = None) -> None:
        """Append one document; ``lengths`` splits it into sequences (default: one sequence).

        A document with no tokens adds no sequence but still records its boundary.
        """
        arr = np.asarray(tokens)
        if lengths is None:
            lens = np.array([arr.size] if arr.size else [], dtype=np.int64)
        else:
            lens = np.asarray(lengths, dtype=np.int64)
            if int(lens.sum()) != arr.size:
                raise ValueError(f"lengths sum to {int(lens.sum())}, tokens has {arr.size}")
        self._write_tokens(arr)
        _extend(self._lengths, lens)
        self.end_document()

    def add_documents(self, tokens: npt.ArrayLike, doc_lengths: npt.ArrayLike) -> None:
        """Append many one-sequence documents at once (flat tokens + per-document lengths;
        zero lengths are empty documents)."""
        arr = np.asarray(tokens)
        lens = np.asarray(doc_lengths, dtype=np.int64)
        if int(lens.sum()) != arr.size:
            raise ValueError(f"doc_lengths sum to {int(lens.sum())}, tokens has {arr.size}")
        self._write_tokens(arr)
        self._add_document_lengths(lens)

    def add_part(self, part: str | os.PathLike[str], doc_lengths: npt.ArrayLike) -> None:
        """Append a raw token file (e.g. a worker's part) as many one-sequence documents, as
        ``add_documents`` would: bytes copied in the kernel, the sha256 kept (read from a map of
        the part, no copy into Python)."""
        lens = np.asarray(doc_lengths, dtype=np.int64)
        size = int(lens.sum()) * self.dtype.itemsize
        bin_file = self._open_bin()
        with name_os_errors(data_file_path(self.prefix), source=part), open(part, "rb") as src:
            if os.fstat(src.fileno()).st_size != size:
                raise FormatError(part, "size", f"lengths need {size} bytes, file has "
                                  f"{os.fstat(src.fileno()).st_size}")  # fmt: skip
            if size:
                from tokenmill.formats._writer_io import append_part

                append_part(src, bin_file, size, self._bin_hash)
        self._bin_size += size
        self._add_document_lengths(lens)
        self._write_back(self._bin_size)

    def add_index(self, prefix: str | os.PathLike[str]) -> None:
        """Append a whole existing dataset (Megatron ``add_index``): bytes copied in blocks. Its
        pointers are checked first: the output recomputes them, so a bad input fails, not mended."""
        src = IndexedDataset(prefix)
        src.check_pointers()
        if src.dtype != self.dtype:
            raise FormatError(
                index_file_path(prefix),
                "dtype",
                f"{src.dtype} does not match the output dtype {self.dtype}; "
                "merge only datasets tokenized with the same vocabulary size rule",
            )
        bin_file = self._open_bin()
        base = len(self._lengths)
        _extend(self._lengths, src.sequence_lengths)
        _extend(self._docs, base + src.document_indices[1:])
        self._bin_hash = None
        with name_os_errors(data_file_path(self.prefix), source=data_file_path(prefix)):
            bin_file.flush()
            from tokenmill.formats._writer_io import copy_file

            with open(data_file_path(prefix), "rb") as fh:
                copy_file(fh, bin_file)
        self._written_back = bin_file.tell()
        src.close()

    # -- committing ----------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    @property
    def num_documents(self) -> int:
        return len(self._docs) - 1

    @property
    def file_digests(self) -> dict[str, dict[str, Any]] | None:
        """``{"bin": {bytes, sha256}, "idx": {...}}`` of the finalized pair, hashed while writing
        (no re-read); None before finalize or when ``add_index`` was used."""
        if not self._done or self._bin_hash is None or self._idx_digest is None:
            return None
        return {
            "bin": {"bytes": self._bin_size, "sha256": self._bin_hash.hexdigest()},
            "idx": dict(self._idx_digest),
        }

    def finalize(self) -> None:
        """Flush and fsync ``.bin``, write ``.idx``, then rename both into place (idx last)."""
        if self._done:
            return
        if self._bin is None:
            raise RuntimeError(f"{self.prefix}: writer was aborted")
        with name_os_errors(data_file_path(self.prefix)):
            self._bin.flush()
            self._writeback.close()
            os.fsync(self._bin.fileno())
            self._bin.close()
        self._bin = None
        idx_final = index_file_path(self.prefix)
        idx_tmp, opened = create_temp(idx_final, lambda t: open(t, "wb"))  # noqa: SIM115
        try:
            lengths, docs = (
                np.frombuffer(self._lengths, np.int32),
                np.frombuffer(self._docs, np.int64),
            )
            index = encode_index(self.dtype, lengths, docs)
            self._idx_digest = {"bytes": len(index), "sha256": hashlib.sha256(index).hexdigest()}
            with name_os_errors(idx_final), opened as fh:
                fh.write(index)
                fh.flush()
                os.fsync(fh.fileno())
            # Renamed over, never unlinked first: a concurrent writer of the same pair (same
            # bytes) or a reader between the two renames never meets a missing .idx.
            commit(self._bin_tmp, data_file_path(self.prefix))
            commit(idx_tmp, idx_final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(idx_tmp)
            raise
        self._done = True

    def abort(self) -> None:
        """Discard everything written so far."""
        if self._bin is not None:
            self._writeback.close()
            with contextlib.suppress(OSError):  # flushing bytes being discarded may fail too
                self._bin.close()
            self._bin = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._bin_tmp)


class IndexedDataset:
    """Read-only view of a ``.bin``/``.idx`` pair through ``np.memmap``, validated on open."""

    def __init__(
        self,
        prefix: str | os.PathLike[str],
        *,
        multimodal: bool = False,
        index_only: bool = False,
        num_tokens: int | None = None,
    ) -> None:
        """``index_only``: read the ``.idx`` alone, never the ``.bin``. ``num_tokens`` (a manifest's
        count): an O(1) open (header and file sizes); the O(size) scans wait for
        :meth:`check_pointers`, and the loader's per-batch checks keep reads in bounds."""
        self.prefix = Path(prefix)
        self.idx_path = index_file_path(prefix)
        self.bin_path = data_file_path(prefix)
        for p in (self.idx_path,) if index_only else (self.idx_path, self.bin_path):
            if not p.is_file():
                raise FormatError(p, "file", "missing (a .bin/.idx pair needs both files)")
        self._read_index(multimodal, scan=num_tokens is None)
        if num_tokens is None:
            num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        self.num_tokens = int(num_tokens)
        self._index_only = index_only
        self._bin: np.memmap | None = None
        if not index_only:
            self._check_bin()

    def _read_index(self, multimodal: bool, *, scan: bool = True) -> None:
        path = self.idx_path
        size = path.stat().st_size
        if size < HEADER_SIZE:
            raise FormatError(path, "header", f"file has {size} bytes, the header needs 34")
        with open(path, "rb") as fh:
            head = fh.read(HEADER_SIZE)
        self.dtype, n_seq, n_doc = parse_header(head, path)
        expected = HEADER_SIZE + 12 * n_seq + 8 * n_doc + (n_seq if multimodal else 0)
        if size != expected:
            raise FormatError(
                path,
                "sequence_count/document_count",
                f"counts {n_seq}/{n_doc} need a {expected}-byte file, found {size} bytes",
            )
        if n_doc < 1:
            raise FormatError(path, "document_count", "is 0; it must be at least 1")
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._mm: np.memmap | None = buf
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=n_doc, offset=off)
        off += 8 * n_doc
        self.sequence_modes = (
            np.frombuffer(buf, dtype=np.int8, count=n_seq, offset=off) if multimodal else None
        )
        docs = self.document_indices
        if docs[0] != 0 or docs[-1] != n_seq:
            raise FormatError(
                path,
                "document_indices",
                f"must start at 0 and end at sequence_count {n_seq}, "
                f"found {int(docs[0])}..{int(docs[-1])}",
            )
        if scan:
            self._scan_index()

    def _scan_index(self) -> None:
        """The O(size) checks of the index: boundaries non-decreasing, no negative length."""
        docs, path = self.document_indices, self.idx_path
        if len(docs) > 1 and bool(np.any(np.diff(docs) < 0)):
            raise FormatError(path, "document_indices", "are not non-decreasing")
        if len(self.sequence_lengths) and int(self.sequence_lengths.min()) < 0:
            raise FormatError(path, "sequence_lengths", "contain a negative length")

    def _check_bin(self) -> None:
        n_tokens = self.num_tokens
        itemsize = self.dtype.itemsize
        size = self.bin_path.stat().st_size
        if size != n_tokens * itemsize:
            raise FormatError(
                self.bin_path,
                "size",
                f"index says {n_tokens} tokens x {itemsize} B = {n_tokens * itemsize} bytes, "
                f"file has {size} bytes",
            )
        if len(self) and int(self.sequence_pointers[0]) != 0:
            raise FormatError(self.idx_path, "sequence_pointers", "do not start at 0")
        self._bin = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if size else None

    def check_pointers(self) -> None:
        """Full check: boundaries and lengths scanned, the lengths add up to the token count,
        and every pointer equals the running byte sum of the lengths before it."""
        self._scan_index()
        total = int(self.sequence_lengths.sum(dtype=np.int64))
        if total != self.num_tokens:
            raise FormatError(
                self.idx_path,
                "sequence_lengths",
                f"add up to {total} tokens, the manifest records {self.num_tokens}",
            )
        expect = _pointers(self.sequence_lengths, self.dtype.itemsize)
        bad = np.flatnonzero(expect != self.sequence_pointers)
        if bad.size:
            i = int(bad[0])
            raise FormatError(
                self.idx_path,
                "sequence_pointers",
                f"pointer {i} is {int(self.sequence_pointers[i])}, lengths imply {int(expect[i])}",
            )

    # -- access --------------------------------------------------------------------------
    num_parts = 1  # one .bin (a virtual merge has one per shard: formats.virtual_merge)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def lengths_of(self, seq: np.ndarray) -> np.ndarray:
        """Lengths of sequences ``seq`` (int64)."""
        return self.sequence_lengths[seq].astype(np.int64)

    def locate(self, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(part, byte offset in that part's ``.bin``) of sequences ``seq``: part 0 here."""
        return np.zeros(len(seq), dtype=np.int64), self.sequence_pointers[seq].astype(np.int64)

    def buffer(self, part: int) -> memoryview:
        """The ``.bin``'s bytes (``part`` is always 0 for a pair)."""
        return self.tokens.view(np.uint8).data

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def tokens(self) -> np.ndarray:
        """All tokens as one flat memmap (empty array for an empty dataset)."""
        if self._index_only:
            raise FormatError(self.bin_path, "file", "not opened: this view reads the .idx only")
        return self._bin if self._bin is not None else np.empty(0, dtype=self.dtype)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence ``i`` from ``offset`` for ``length`` tokens (default: to the end)."""
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def close(self) -> None:
        """Drop the memory maps (the arrays handed out stay valid while referenced)."""
        self._bin = None
        self._mm = None

    def __enter__(self) -> IndexedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
