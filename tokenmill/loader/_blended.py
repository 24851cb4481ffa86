"""Owns ``BlendedDataset``: a blend's samples routed to its Nanoset datasets (FORMATS §5.5)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.errors import CacheError, FormatError
from tokenmill.loader._batch import Batches, Request, check_range, sample_ids
from tokenmill.loader._datasets import IndexPaths, NanosetDataset, as_index, map_arrays, reopen


def _reopen_blend(
    parts: dict[str, tuple[Any, ...]],
    dataset_index: np.ndarray | str | tuple[str, ...],
    dataset_sample_index: np.ndarray | str | tuple[str, ...],
    settings: dict[str, Any],
) -> BlendedDataset:
    """Inverse of ``BlendedDataset.__reduce__``; a file gone since the job opened the blend (gc
    removed its version) is a CacheError naming the blend version."""
    try:
        datasets = {name: reopen(*args) for name, args in parts.items()}
        arrays, paths = map_arrays([dataset_index, dataset_sample_index])
    except (FileNotFoundError, CacheError) as exc:
        version = settings.get("version")
        name = settings.get("manifest", {}).get("name", "?")
        cause = exc.__cause__ if isinstance(exc, CacheError) else exc
        missing = getattr(cause, "filename", None) or exc
        raise CacheError(
            f"blend {name!r} version {version}: a DataLoader worker could not reopen it "
            f"({missing} is missing): the version was removed after the job opened it, most "
            f"likely by `tokenmill gc`; pin it (`tokenmill gc --keep-version {version}`) for "
            "as long as a job reads it, and restart the job (or open the current version)"
        ) from exc
    return BlendedDataset(datasets, *arrays, validate=paths is None, array_paths=paths, **settings)


class BlendedDataset(Batches):
    """A blend: sample ``i`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``."""

    def __init__(
        self,
        datasets: dict[str, NanosetDataset],
        dataset_index: npt.ArrayLike,
        dataset_sample_index: npt.ArrayLike,
        *,
        manifest: dict[str, Any] | None = None,
        split: str = "train",
        validate: bool = True,
        array_paths: IndexPaths | None = None,
        version: str | None = None,
    ) -> None:
        self.datasets = dict(datasets)
        self.array_paths = array_paths  # the blend arrays' .npy files: pickles send these
        self.version = version
        self.names = list(self.datasets)
        self._parts = list(self.datasets.values())
        self.dataset_index: Any = as_index(dataset_index)
        self.dataset_sample_index: Any = as_index(dataset_sample_index)
        self.manifest = manifest or {}
        self.split = split
        widths = {ds.width for ds in self._parts}
        if len(widths) != 1:
            raise FormatError(split, "datasets", f"sample widths differ: {sorted(widths)}")
        self.width = widths.pop()
        self.sequence_length = self._parts[0].sequence_length
        self._check_arrays(values=validate)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the datasets (paths, see NanosetDataset), the blend arrays' paths and small
        settings; the receiver memory-maps the files again."""
        settings = {"manifest": self.manifest, "split": self.split, "version": self.version}
        arrays: tuple[Any, ...] = self.array_paths or (
            self.dataset_index,
            self.dataset_sample_index,
        )
        parts = {name: ds.__reduce__()[1] for name, ds in self.datasets.items()}
        return (_reopen_blend, (parts, *arrays, settings))

    def validate(self) -> None:
        """Full check: every blend value and every dataset's index values in range."""
        self._check_arrays(values=True)
        for part in self._parts:
            part.validate()

    def _route(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Dataset and sample of blend samples ``ids``, checked (O(batch)) against the number
        of datasets and each dataset's length."""
        which = self.dataset_index[ids].astype(np.int64)
        local = self.dataset_sample_index[ids].astype(np.int64)
        check_range(which, len(self._parts), self.split, "dataset_index")
        if local.size:
            limits = np.array([len(ds) for ds in self._parts], dtype=np.int64)[which]
            bad = (local < 0) | (local >= limits)
            if bool(bad.any()):
                d, k = int(which[bad][0]), int(local[bad][0])
                raise FormatError(
                    self.split,
                    "dataset_sample_index",
                    f"dataset {self.names[d]!r} is asked for sample {k} but has "
                    f"{len(self._parts[d])}",
                )
        return which, local

    def _check_arrays(self, *, values: bool = True) -> None:
        di, dsi = self.dataset_index, self.dataset_sample_index
        for field, arr in (("dataset_index", di), ("dataset_sample_index", dsi)):
            if arr.dtype.kind not in "iu" or arr.ndim != 1 or len(arr) != len(di):
                raise FormatError(
                    self.split,
                    field,
                    "must be 1-D integer arrays of equal length, "
                    f"found {arr.ndim}-D {arr.dtype} of {len(arr)}",
                )
        if not len(di) or not values:
            return
        check_range(di, len(self._parts), self.split, "dataset_index")
        if int(dsi.min()) < 0:
            raise FormatError(self.split, "dataset_sample_index", "has negative values")
        high = np.full(len(self._parts), -1, dtype=np.int64)  # -1: a dataset never asked
        np.maximum.at(high, di.astype(np.int64), dsi.astype(np.int64))
        for d, ds in enumerate(self._parts):
            if int(high[d]) >= len(ds):
                raise FormatError(
                    self.split,
                    "dataset_sample_index",
                    f"dataset {ds.name!r} is asked for sample {int(high[d])} but has {len(ds)}",
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    @property
    def extends(self) -> str | None:
        """The blend version whose samples this one's start with (growing semantics, data only
        added), or None."""
        found = self.manifest.get("extends")
        return None if found is None else str(found)

    @property
    def proportions(self) -> dict[str, float]:
        """Realized share of each dataset in this split's blend."""
        counts = np.bincount(self.dataset_index.astype(np.int64), minlength=len(self._parts))
        total = max(1, len(self))
        return {name: float(c) / total for name, c in zip(self.names, counts, strict=True)}

    def __getitem__(self, i: int) -> np.ndarray:
        ids = sample_ids([i], len(self), f"blend split {self.split!r}")
        which, local = self._route(ids)
        return self._parts[int(which[0])][int(local[0])]

    def _requests(
        self, indices: npt.ArrayLike
    ) -> tuple[dict[str, NanosetDataset], Sequence[Request], int]:
        """What a batch reads: every dataset, the request of each dataset with samples in it
        (dataset, rows, its sample ids) and the batch size."""
        ids = sample_ids(indices, len(self), f"blend split {self.split!r}")
        which, local = self._route(ids)
        requests = []
        for d, part in enumerate(self._parts):
            rows = np.flatnonzero(which == d)
            if len(rows):
                requests.append((part, rows, local[rows]))
        return self.datasets, requests, len(ids)

    def prefetch(self, indices: npt.ArrayLike) -> None:
        """Start fetching what samples ``indices`` need in the background (a blend read from
        S3), e.g. this rank's next batches: ``sampler.indices(step + k)`` for k = 1..N."""
        for part, _, ks in self._requests(indices)[1]:
            part.prefetch(ks)
