"""Owns ``NanosetDataset``: one (dataset, split) Nanoset, samples assembled as in FORMATS §5.5.

``ds[k]`` assembles one sample as Megatron does; ``get_batch`` and ``get_training_batch``
(``_batch``) read the pieces that :meth:`NanosetDataset.pieces` locates for a whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.errors import CacheError, FormatError
from tokenmill.formats.dataset_manifest import (
    dataset_manifest_path,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDataset
from tokenmill.formats.nanoset_cache import SegmentedArray
from tokenmill.formats.virtual_merge import VirtualDataset
from tokenmill.loader._batch import Batches, Request, check_range, sample_ids

# Each array's ``.npy`` file, or its parts' files (a segmented growing entry), in order.
IndexPaths = tuple[str | tuple[str, ...], ...]

PAD_ID = -1  # Megatron's _PAD_TOKEN_ID, used when the tokenizer has no pad id
_UNREAD = object()


class NanosetDataset(Batches):
    """One (dataset, split) Nanoset: ``ds[k]`` -> int64 tokens, ``get_batch`` -> ``[B, width]``."""

    def __init__(
        self,
        data: IndexedDataset | VirtualDataset,
        document_index: npt.ArrayLike,
        sample_index: npt.ArrayLike,
        shuffle_index: npt.ArrayLike,
        *,
        sequence_length: int,
        add_extra_token: bool = True,
        pad_id: int = PAD_ID,
        name: str = "",
        validate: bool = True,
        index_paths: IndexPaths | None = None,
        version: str | None = None,
    ) -> None:
        self.data = data
        self.index_paths = index_paths  # the arrays' .npy files: pickles send these, not data
        self.version = version
        self.name = name or str(data.prefix)
        self.document_index: Any = as_index(document_index)
        self.sample_index: Any = as_index(sample_index)
        self.shuffle_index: Any = as_index(shuffle_index)
        self.sequence_length = int(sequence_length)
        self.extra = int(bool(add_extra_token))
        self.width = self.sequence_length + self.extra
        self.pad_id = int(pad_id)
        if data.dtype.kind not in "iu":
            raise FormatError(data.idx_path, "dtype code", f"{data.dtype} is not a token dtype")
        # sequences a takedown masked (sorted): never read, whatever an index says
        self._masked = np.asarray(getattr(data, "masked", ()), dtype=np.int64)
        self._check_arrays(values=validate)
        self._itemsize = data.dtype.itemsize
        self._buffers: dict[int, memoryview] = {}  # each .bin's bytes (one per shard if virtual)
        self._eod_id: object = _UNREAD

    def _check_arrays(self, *, values: bool = True) -> None:
        """Structural checks (dtypes, shapes: O(1)); with ``values`` also every value's range
        (a scan of the whole index: ``verify="full"``). Without it, reads stay in bounds through
        the per-batch checks of :meth:`pieces` and :meth:`assemble`."""
        n_seq, where = len(self.data), self.name
        checks: list[tuple[str, np.ndarray, int, int]] = [
            ("document_index", self.document_index, 1, n_seq),
            ("sample_index", self.sample_index, 2, len(self.document_index)),
            ("shuffle_index", self.shuffle_index, 1, len(self.sample_index) - 1),
        ]
        for field, arr, ndim, bound in checks:
            if arr.dtype.kind not in "iu" or arr.ndim != ndim:
                raise FormatError(
                    where,
                    field,
                    f"must be a {ndim}-D integer array, found {arr.ndim}-D {arr.dtype}",
                )
            if ndim == 2 and arr.shape[1] != 2:
                raise FormatError(where, field, f"shape {arr.shape} is not (num_samples + 1, 2)")
            found = arr[:, 0] if ndim == 2 else arr
            if values and found.size and (int(found.min()) < 0 or int(found.max()) >= bound):
                raise FormatError(
                    where,
                    field,
                    f"values {int(found.min())}..{int(found.max())} are outside [0, {bound})",
                )
        if values:
            if self.sample_index.size and int(self.sample_index[:, 1].min()) < 0:
                raise FormatError(where, "sample_index", "has a negative token offset")
            self._check_unmasked(self.document_index)

    def _check_unmasked(self, seq: np.ndarray) -> None:
        """FormatError when any sequence of ``seq`` is masked (taken down) in the dataset: an
        index built before the takedown over a merge that has it (O(len(seq) log masks))."""
        if not self._masked.size or not seq.size:
            return
        at = np.minimum(np.searchsorted(self._masked, seq), len(self._masked) - 1)
        hit = self._masked[at] == seq
        if hit.any():
            first = int(seq[hit][0])
            raise FormatError(
                self.name,
                "document_index",
                f"references sequence {first}{self._document_of(first)}, which the merge masks "
                "(taken down): rebuild the index over the masked merge (tokenmill takedown does)",
            )

    def _document_of(self, seq: int) -> str:
        """`` (shard <key> document <ordinal>)`` of a global sequence of a merge with shard
        records (one sequence per document), else ``""``."""
        firsts, keys = getattr(self.data, "first_sequence", None), getattr(self.data, "keys", None)
        if firsts is None or not isinstance(keys, list) or not keys:
            return ""
        k = int(np.searchsorted(firsts, seq, side="right")) - 1
        return f" (shard {keys[k]} document {seq - int(firsts[k])})"

    def validate(self) -> None:
        """Full check: every index value in range (reads the whole index once)."""
        self._check_arrays(values=True)

    def _rows(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The first and last sample-index rows of samples ``ks``, each value checked against
        the array it indexes (O(batch): a damaged index raises FormatError, never reads beyond)."""
        if ks.size and (int(ks.min()) < 0 or int(ks.max()) >= len(self.shuffle_index)):
            raise IndexError(f"{self.name}: sample out of range [0, {len(self)})")
        j = self.shuffle_index[ks].astype(np.int64)
        check_range(j, len(self.sample_index) - 1, self.name, "shuffle_index")
        head = self.sample_index[j].astype(np.int64)
        tail = self.sample_index[j + 1].astype(np.int64)
        rows = np.concatenate([head, tail])
        check_range(rows[:, 0], len(self.document_index), self.name, "sample_index", "positions")
        if rows.size and int(rows[:, 1].min()) < 0:
            raise FormatError(self.name, "sample_index", "has a negative token offset")
        return head, tail

    def _documents(self, positions: np.ndarray) -> np.ndarray:
        """``document_index[positions]`` with every sequence id checked (O(pieces))."""
        seq = self.document_index[positions].astype(np.int64)
        check_range(seq, len(self.data), self.name, "document_index")
        self._check_unmasked(seq)
        return seq

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle file paths and small settings, which the receiver (a ``spawn`` DataLoader
        worker) maps again: O(1) in size; arrays built in memory travel by value."""
        settings = {
            "sequence_length": self.sequence_length,
            "add_extra_token": bool(self.extra),
            "pad_id": self.pad_id,
            "name": self.name,
            "version": self.version,
        }
        arrays: tuple[Any, ...] = self.index_paths or (
            self.document_index,
            self.sample_index,
            self.shuffle_index,
        )
        data: Any = str(self.data.prefix)  # a virtual merge: its manifest is read again
        if getattr(self.data, "remote", False):
            data = self.data
        elif isinstance(self.data, IndexedDataset):  # a pair: its checked token count travels
            data = (data, self.data.num_tokens)
        return (reopen, (data, *arrays, settings))

    def _buffer(self, part: int) -> memoryview:
        """The bytes of ``.bin`` number ``part`` (one for a pair, one per shard if virtual)."""
        view = self._buffers.get(part)
        if view is None:
            view = self._buffers[part] = self.data.buffer(part)
        return view

    def _read(self, seq: int, offset: int, length: int | None) -> np.ndarray:
        ids = np.array([seq], dtype=np.int64)
        size = int(self.data.lengths_of(ids)[0])
        stop_in_seq = size if length is None else offset + length
        if not 0 <= offset <= stop_in_seq <= size:
            raise FormatError(self.name, "sample_index", "a token offset lies outside its sequence")
        parts, base = self.data.locate(ids)
        view = self._buffer(int(parts[0]))
        start = int(base[0]) + offset * self._itemsize
        stop = start + (stop_in_seq - offset) * self._itemsize
        if start < 0 or stop > len(view):
            raise FormatError(self.name, "sequence_pointers", f"sequence {seq} lies outside .bin")
        return np.frombuffer(view[start:stop], dtype=self.data.dtype)

    def assemble(self, j: int) -> np.ndarray:
        """Megatron's per-sample assembly (FORMATS §5.5) of sample-index row ``j``."""
        if not 0 <= j < len(self.sample_index) - 1:
            raise FormatError(
                self.name, "shuffle_index", f"row {j} outside [0, {len(self.sample_index) - 1})"
            )
        b, bo = (int(v) for v in self.sample_index[j])
        e, eo = (int(v) for v in self.sample_index[j + 1])
        if not (0 <= b <= e < len(self.document_index)) or min(bo, eo) < 0:
            raise FormatError(self.name, "sample_index", f"rows {j}, {j + 1} are out of bounds")
        doc = self._documents(np.arange(b, e + 1))
        b, e = 0, e - b
        if b == e:
            parts = [self._read(int(doc[b]), bo, eo - bo + self.extra)]
        else:
            parts = [self._read(int(doc[b]), bo, None)]
            parts += [self._read(int(doc[p]), 0, None) for p in range(b + 1, e)]
            parts.append(self._read(int(doc[e]), 0, eo + self.extra))
        sample = np.concatenate(parts).astype(np.int64)
        if len(sample) > self.width:
            raise FormatError(
                self.name,
                "sample_index",
                f"row {j} spans {len(sample)} tokens, more than sequence_length + extra = "
                f"{self.width}",
            )
        if len(sample) < self.width:
            sample = np.concatenate([sample, np.full(self.width - len(sample), self.pad_id)])
        return sample

    def __getitem__(self, k: int) -> np.ndarray:
        (k,) = sample_ids([k], len(self), self.name)
        return self.assemble(int(self.shuffle_index[k]))

    def pieces(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where samples ``ks`` lie: the ``.bin`` part (always 0 for a pair; the shard of a
        virtual merge), byte start and stop of each piece (a run of one sequence) in order, and
        how many pieces each sample has (array arithmetic)."""
        head, tail = self._rows(np.asarray(ks, dtype=np.int64))
        count = tail[:, 0] - head[:, 0] + 1
        if count.size and int(count.min()) < 1:
            raise FormatError(self.name, "sample_index", "positions decrease between rows")
        ends = np.cumsum(count)
        firsts = ends - count
        pos = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(firsts - head[:, 0], count)
        seq = self._documents(pos)
        seq_len = self.data.lengths_of(seq)
        start = np.zeros(len(pos), dtype=np.int64)
        start[firsts] = head[:, 1]
        stop = seq_len.copy()
        stop[ends - 1] = tail[:, 1] + self.extra
        if len(pos) and (bool(np.any(start > stop)) or bool(np.any(stop > seq_len))):
            raise FormatError(self.name, "sample_index", "a token offset lies outside its sequence")
        part, base = self.data.locate(seq)
        ends_at = base + stop * self._itemsize
        outside = len(pos) > 0 and int(base.min()) < 0
        if len(pos) and self.data.num_parts == 1:  # a pair: one bound, no grouping by part
            outside = outside or int(ends_at.max()) > len(self._buffer(0))
        elif len(pos):
            for p in np.unique(part).tolist():
                outside = outside or int(ends_at[part == p].max()) > len(self._buffer(p))
        if outside:
            raise FormatError(self.name, "sequence_pointers", "a sequence lies outside the .bin")
        return part, base + start * self._itemsize, ends_at, count

    def read(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens (file dtype) of samples ``ks`` back to back, the token count of each piece,
        and how many pieces each sample has: one ``bytes.join`` over memoryview slices of the
        memmap, the fastest copy measured (``_batch``; a list of slices beat ``map`` by ~10%)."""
        parts, starts, stops, counts = self.pieces(ks)
        gather = getattr(self.data, "gather", None)  # a remote dataset: through its blocks
        if gather is not None:
            blob = gather(parts, starts, stops)
        elif self.data.num_parts == 1:
            los, his = starts.tolist(), stops.tolist()
            view = self._buffer(0)
            blob = b"".join([view[lo:hi] for lo, hi in zip(los, his, strict=True)])
        else:
            los, his = starts.tolist(), stops.tolist()
            views = [self._buffer(p) for p in parts.tolist()]
            blob = b"".join([v[lo:hi] for v, lo, hi in zip(views, los, his, strict=True)])
        return (
            np.frombuffer(blob, dtype=self.data.dtype),
            (stops - starts) // self._itemsize,
            counts,
        )

    def prefetch(self, indices: npt.ArrayLike) -> None:
        """Start fetching what samples ``indices`` need in the background (a dataset read from
        S3: their index and token blocks enter the cache; local files: nothing to do)."""
        fetch = getattr(self.data, "prefetch", None)
        if fetch is not None:
            ks = sample_ids(indices, len(self), self.name)
            fetch(lambda: self.pieces(ks)[:3])

    def recorded_eod_id(self) -> int | None:
        """The EOD id in the dataset's ``.manifest.json`` config (``eod_id``), if recorded."""
        if self._eod_id is _UNREAD:
            path = dataset_manifest_path(self.data.prefix)
            config = read_dataset_manifest(self.data.prefix).get("config") if path.is_file() else {}
            value = config.get("eod_id") if isinstance(config, dict) else None
            if value is not None and type(value) is not int:
                raise FormatError(path, "config.eod_id", f"expected an integer, found {value!r}")
            self._eod_id = value
        return self._eod_id  # type: ignore[return-value]

    def _requests(
        self, indices: npt.ArrayLike
    ) -> tuple[dict[str, NanosetDataset], Sequence[Request], int]:
        """What a batch reads: this dataset, its one request and the batch size."""
        ks = sample_ids(indices, len(self), self.name)
        return {self.name: self}, [(self, np.arange(len(ks)), ks)], len(ks)


def as_index(values: Any) -> Any:
    """An index array as given when segmented (reads touch only their parts), else ndarray."""
    return values if isinstance(values, SegmentedArray) else np.asarray(values)


def part_names(parts: list[list[Path]]) -> IndexPaths:
    """The ``index_paths`` of a dataset's three arrays: a file name each, or a tuple of them
    for a segmented array (what a pickle sends; :func:`reopen` maps them again)."""
    return tuple(str(p[0]) if len(p) == 1 else tuple(str(x) for x in p) for p in parts)


def map_arrays(arrays: list[Any]) -> tuple[list[Any], IndexPaths | None]:
    """Pickled index arrays with their paths: file names (an array's file or its parts')
    memory-mapped again (``allow_pickle=False``), or arrays sent by value (no paths)."""
    if not all(isinstance(a, str | tuple) for a in arrays):
        return arrays, None

    def load(name: str) -> Any:
        return np.load(name, mmap_mode="r", allow_pickle=False)

    mapped = [
        load(a) if isinstance(a, str) else SegmentedArray([load(n) for n in a]) for a in arrays
    ]
    return mapped, tuple(arrays)


def reopen(
    prefix: Any,
    document_index: np.ndarray | str | tuple[str, ...],
    sample_index: np.ndarray | str | tuple[str, ...],
    shuffle_index: np.ndarray | str | tuple[str, ...],
    settings: dict[str, Any],
) -> NanosetDataset:
    """Inverse of ``NanosetDataset.__reduce__``: index files are memory-mapped again
    (``allow_pickle=False``); the sender verified them, so only the O(1) checks run."""
    try:
        arrays, paths = map_arrays([document_index, sample_index, shuffle_index])
        if isinstance(prefix, tuple):  # a pair with the token count the sender checked: O(1)
            data: Any = IndexedDataset(prefix[0], num_tokens=prefix[1])
        else:
            data = open_dataset(prefix) if isinstance(prefix, str) else prefix
    except FileNotFoundError as exc:
        raise CacheError(
            f"{exc.filename}: missing when a DataLoader worker reopened index cache "
            f"{settings.get('version')} of dataset {settings.get('name')!r}: removed after the "
            "job opened it, most likely by `tokenmill gc`; keep what a running job reads "
            "(`tokenmill gc --keep-version`) and restart the job"
        ) from exc
    return NanosetDataset(
        data,
        *arrays,
        validate=paths is None,
        index_paths=paths,
        **settings,  # type: ignore[arg-type]
    )
