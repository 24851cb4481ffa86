"""Owns batch reads shared by a Nanoset and a blend: ``get_batch`` and ``get_training_batch``.

``get_batch`` locates all pieces with array arithmetic, copies them with one ``bytes.join`` over
memoryview slices of the ``.bin`` memmap and widens to int64 ``[B, width]`` in one pass: exact,
and faster than every numpy gather measured (bench/bench_loader.py). ``get_training_batch``
turns that batch and its pieces into megatron-core's training inputs (``_training``, §11).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from tokenmill.errors import ConfigError, FormatError
from tokenmill.loader._training import TrainingFlags, training_inputs


class Source(Protocol):
    """What a batch is read from (a ``NanosetDataset``: its module imports this one)."""

    data: Any
    shuffle_index: Any
    width: int
    extra: int
    pad_id: int

    def read(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
    def assemble(self, j: int) -> np.ndarray: ...
    def recorded_eod_id(self) -> int | None: ...
    def prefetch(self, indices: npt.ArrayLike) -> None: ...


# One dataset's share of a batch: (dataset, output rows in ascending order, its sample ids).
Request = tuple[Source, np.ndarray, np.ndarray]


def sample_ids(indices: npt.ArrayLike, size: int, what: str) -> np.ndarray:
    """Indices as int64 after a bounds check (negative ids are refused, not wrapped)."""
    ks = np.asarray(indices)
    if ks.size and ks.dtype.kind not in "iu":
        raise TypeError(f"{what}: sample indices must be integers, got {ks.dtype}")
    ks = ks.astype(np.int64, copy=False).reshape(-1)
    if ks.size and (int(ks.min()) < 0 or int(ks.max()) >= size):
        bad = ks[(ks < 0) | (ks >= size)][0]
        raise IndexError(f"{what}: sample {int(bad)} out of range [0, {size})")
    return ks


def check_range(
    values: np.ndarray, bound: int, where: object, field: str, what: str = "values"
) -> None:
    """FormatError naming ``where`` and ``field`` when one of ``values`` (an index's, read
    for a batch: O(batch)) lies outside ``[0, bound)``."""
    if values.size and (int(values.min()) < 0 or int(values.max()) >= bound):
        raise FormatError(where, field, f"{what} outside [0, {bound})")


class Batches:
    """``get_batch`` and ``get_training_batch``, the same for a Nanoset and a blend (DESIGN §3's
    signatures); each dataset class says which datasets a batch reads (``_requests``)."""

    width: int

    def _requests(
        self, indices: npt.ArrayLike
    ) -> tuple[Mapping[str, Source], Sequence[Request], int]:
        """The datasets a batch may read, the request per dataset it reads, the batch size."""
        raise NotImplementedError

    def get_batch(self, indices: npt.ArrayLike) -> np.ndarray:
        """Samples ``indices`` as one int64 ``[B, width]`` array (vectorized reads)."""
        _, requests, size = self._requests(indices)
        return gather_batch(self.width, requests, size)[0]

    def get_training_batch(
        self,
        indices: npt.ArrayLike,
        *,
        eod_id: int | None = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
        create_attention_mask: bool = False,
        inter_document_masking: bool = False,
    ) -> dict[str, np.ndarray]:
        """Samples ``indices`` as megatron-core ``GPTDataset.__getitem__`` training dicts with
        these flags, stacked (FORMATS §11); ``eod_id=None`` takes the EOD id every dataset's
        manifest records (they must agree, as must their ``extra`` and pad id). The passes
        mapping padding run only if a sample is short or the pad id is a token value."""
        flags = TrainingFlags(
            reset_position_ids=reset_position_ids,
            reset_attention_mask=reset_attention_mask,
            eod_mask_loss=eod_mask_loss,
            create_attention_mask=create_attention_mask,
            inter_document_masking=inter_document_masking,
        )
        parts, requests, size = self._requests(indices)
        for setting in ("pad_id", "extra"):
            values = {name: getattr(ds, setting) for name, ds in parts.items()}
            if len(set(values.values())) > 1:
                raise ConfigError(f"the datasets' {setting} differ ({values}); training needs one")
        eod = resolve_eod(parts, eod_id)
        first = next(iter(parts.values()))
        text, rows, sizes = gather_batch(first.width, requests, size, widen=False)
        lengths = np.bincount(rows, weights=sizes, minlength=size)
        dtypes = [np.iinfo(ds.data.dtype) for ds in parts.values()]
        representable = any(info.min <= first.pad_id <= info.max for info in dtypes)
        return training_inputs(
            text,
            rows,
            sizes,
            extra=bool(first.extra),
            eod_id=eod,
            pad_id=first.pad_id,
            flags=flags,
            may_hold_pad=representable or bool(np.any(lengths < first.width)),
        )


def gather_batch(
    width: int,
    requests: Sequence[Request],
    size: int,
    *,
    widen: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An int64 ``[size, width]`` batch, each request filling its rows (short samples padded
    with the pad id), and each piece's output row and token count in row order (§11.4).
    ``widen=False`` keeps the token dtype when no sample is short (maybe a read-only view): a
    caller that widens slices of it anyway saves a pass."""
    reads, short = [], False
    for ds, rows, ks in requests:
        flat, sizes, counts = ds.read(ks)
        firsts = np.cumsum(counts) - counts
        lengths = np.add.reduceat(sizes, firsts) if len(ks) else np.zeros(0, np.int64)
        if lengths.size and int(lengths.max()) > width:
            ds.assemble(int(ds.shuffle_index[ks[int(np.argmax(lengths))]]))  # raises FormatError
        short = short or bool(np.any(lengths < width))
        reads.append((ds, rows, flat, np.repeat(rows, counts), sizes, lengths))
    if widen or short or not reads:
        dtype = np.dtype(np.int64)
    else:
        dtype = np.result_type(*(read[2].dtype for read in reads))
    if not widen and not short and len(reads) == 1 and len(reads[0][1]) == size:
        out = reads[0][2].reshape(size, width)
    else:
        out = np.empty((size, width), dtype=dtype)
        for ds, rows, flat, _, _, lengths in reads:
            if bool(np.all(lengths == width)):
                if len(rows) == size:
                    np.copyto(out.reshape(-1), flat)
                else:
                    out[rows] = flat.reshape(len(rows), width)
                continue
            block = np.full((len(rows), width), ds.pad_id, dtype=np.int64)
            block[np.arange(width) < lengths[:, None]] = flat
            out[rows] = block
    if len(reads) == 1:
        return out, reads[0][3], reads[0][4]
    all_rows = np.concatenate([r[3] for r in reads]) if reads else np.zeros(0, np.int64)
    order = np.argsort(all_rows, kind="stable")
    sizes = np.concatenate([r[4] for r in reads]) if reads else np.zeros(0, np.int64)
    return out, all_rows[order], sizes[order]


def resolve_eod(datasets: Mapping[str, Source], eod_id: int | None) -> int:
    """``eod_id``, or the EOD id all ``datasets`` record; ConfigError when one records none or
    they disagree (naming them)."""
    if eod_id is not None:
        return int(eod_id)
    recorded = {name: ds.recorded_eod_id() for name, ds in datasets.items()}
    missing = [name for name, value in recorded.items() if value is None]
    if missing:
        raise ConfigError(
            f"no EOD id recorded for {', '.join(map(repr, missing))} (config.eod_id of the "
            "dataset's .manifest.json); pass eod_id=... to get_training_batch"
        )
    values = set(recorded.values())
    if len(values) > 1:
        shown = ", ".join(f"{name!r}: {value}" for name, value in recorded.items())
        raise ConfigError(
            f"the blend's datasets record different EOD ids ({shown}); they were tokenized "
            "differently: pass eod_id=... explicitly only if that is intended"
        )
    return int(values.pop())  # type: ignore[arg-type]
