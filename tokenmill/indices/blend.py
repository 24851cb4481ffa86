"""Blend algorithms: weight normalization, per-dataset sample counts and blend indices.

``semantics="megatron"`` follows megatron-core's BlendedMegatronDatasetBuilder + BlendedDataset:
the builder normalizes the configured weights once (for the sizes), BlendedDataset again before
the greedy loop (the second pass can change the last bits), dtypes int16/int64, and sampling a
dataset past its length is an error. ``semantics="nanotron"`` follows the index-era
BlendedNanoset: one normalization, sample positions wrapped modulo each dataset's length, dtypes
uint64/int64. Beyond the references: :func:`temperature_weights` (fairseq-style multilingual
sampling) and :func:`exhaustive_blend_indices` (Megatron's weights-as-counts, FORMATS.md §7.4).
The greedy loop itself is in ``_blend_kernels`` (bit-exact, vectorized/compiled).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tokenmill.errors import ConfigError
from tokenmill.indices._blend_kernels import greedy_blend

MEGATRON_SURPLUS = 0.005  # megatron-core mid_level_dataset_surplus default
NANOTRON_MARGIN = 1.005
MAX_MEGATRON_DATASETS = 32767  # dataset_index is int16


def normalize_weights(weights: Sequence[float] | np.ndarray) -> np.ndarray:
    """``w / sum(w)`` in float64 exactly as the references' ``normalize`` (one pass); ConfigError
    for empty, non-finite or negative weights and an all-zero list."""
    try:
        w = np.array(weights, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"weights must be a list of numbers, got {weights!r}") from exc
    if w.ndim != 1 or w.size == 0:
        raise ConfigError(f"weights must be a non-empty list of numbers, got {weights!r}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ConfigError(f"weights must be finite and non-negative, got {w.tolist()}")
    with np.errstate(over="ignore"):
        total = np.sum(w)
    if not 0 < total < np.inf:
        raise ConfigError(f"weights must have a positive, finite sum, got {w.tolist()}")
    return w / total


def temperature_weights(dataset_sizes: Sequence[int], temperature: float) -> np.ndarray:
    """Sampling weights ``∝ (size_i / Σ size)^(1/T)``, normalized (fairseq multilingual): T = 1
    keeps the natural proportions, larger T flattens them toward uniform."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ConfigError(f"temperature must be a number, got {temperature!r}")
    if not 0 < temperature < math.inf:
        raise ConfigError(f"temperature must be positive and finite, got {temperature}")
    sizes = _as_counts("dataset_sizes", dataset_sizes, minimum=1)
    shares = sizes / np.sum(sizes)
    return normalize_weights(shares ** (1.0 / temperature))


def blend_sample_counts(
    weights: Sequence[float], size: int, *, semantics: str = "megatron"
) -> list[int]:
    """Samples each dataset's index is built with for a blend of ``size`` samples (weights
    normalized once): megatron ``ceil(ceil(size·w)·1.005)``, nanotron ``int(size·w·1.005)``."""
    n = _check_size(size)
    w = _normalized(weights, semantics).tolist()
    if semantics == "megatron":
        return [math.ceil(math.ceil(n * x) * (1 + MEGATRON_SURPLUS)) for x in w]
    return [int(n * x * NANOTRON_MARGIN) for x in w]


def blend_size(weights: Sequence[float], size: int, *, semantics: str = "megatron") -> int:
    """Length of the blend built for ``size`` requested samples: megatron ``Σ ceil(size·w)`` over
    the builder-normalized weights (up to K − 1 more than ``size``), nanotron ``size``."""
    n = _check_size(size)
    w = _normalized(weights, semantics).tolist()
    return sum(math.ceil(n * x) for x in w) if semantics == "megatron" else n


def build_blend_indices(
    weights: Sequence[float],
    size: int,
    *,
    semantics: str = "megatron",
    dataset_sizes: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) of a blend of length ``size``, ``weights`` as
    configured; ``dataset_sizes`` (samples in each dataset's index) makes megatron reject
    oversampling and nanotron wrap sample positions modulo the sizes."""
    n = _check_size(size)
    w = _normalized(weights, semantics)
    sizes = None
    if dataset_sizes is not None:
        sizes = _as_counts("dataset_sizes", dataset_sizes, minimum=0)
        if len(sizes) != len(w):
            raise ConfigError(
                f"dataset_sizes has {len(sizes)} entries for {len(w)} weights; give one each"
            )
    if semantics == "megatron":
        di, dsi, counts = greedy_blend(normalize_weights(w), n, index_dtype=np.int16)
        if sizes is not None and np.any(counts > sizes):
            d = int(np.argmax(counts > sizes))
            raise ConfigError(
                f"dataset {d} is sampled {int(counts[d])} times but its index has "
                f"{int(sizes[d])} samples (oversampling); build its index with "
                "blend_sample_counts (Megatron's mid_level_dataset_surplus margin)"
            )
        return di, dsi
    di, dsi, counts = greedy_blend(w, n, index_dtype=np.uint64)
    if sizes is not None:
        _wrap(di, dsi, counts, sizes)
    return di, dsi


def exhaustive_blend_indices(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's exhaustive blending of datasets of lengths ``counts`` (their fractions steer
    the greedy order): int16 dataset_index and int64 dataset_sample_index of length ``Σ counts``."""
    c = _as_counts("counts", counts, minimum=1)
    if len(c) >= MAX_MEGATRON_DATASETS:
        raise ConfigError(f"counts: at most {MAX_MEGATRON_DATASETS - 1} datasets, got {len(c)}")
    total = int(np.sum(c))
    di, dsi, _ = greedy_blend(
        c.astype(np.float64) / float(total), total, index_dtype=np.int16, limits=c
    )
    return di, dsi


def _normalized(weights: Sequence[float], semantics: str) -> np.ndarray:
    """The builder's normalized weights, with the reference's extra megatron checks."""
    if semantics not in ("megatron", "nanotron"):
        raise ConfigError(f"semantics must be 'megatron' or 'nanotron', got {semantics!r}")
    w = normalize_weights(weights)
    if semantics == "megatron":
        if np.any(w == 0):
            raise ConfigError(
                f"weights {list(weights)}: megatron blends need every weight > 0 "
                "(BlendedDataset rejects zero weights); leave the dataset out instead"
            )
        if len(w) >= MAX_MEGATRON_DATASETS:
            raise ConfigError(f"at most {MAX_MEGATRON_DATASETS - 1} datasets, got {len(w)}")
    return w


def _wrap(di: np.ndarray, dsi: np.ndarray, counts: np.ndarray, sizes: np.ndarray) -> None:
    """nanotron: sample position modulo the dataset's length, in place."""
    over = counts > sizes
    if not over.any():
        return
    if np.any(sizes[over] == 0):
        d = int(np.flatnonzero(over & (sizes == 0))[0])
        raise ConfigError(f"dataset_sizes: dataset {d} is empty but the blend samples it")
    lengths = sizes[di.astype(np.intp)]
    np.remainder(dsi, lengths, out=dsi)


def _check_size(size: int) -> int:
    """``size`` as an int; ConfigError unless it is a non-negative integer."""
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 0:
        raise ConfigError(f"size must be a non-negative integer, got {size!r}")
    return int(size)


def _as_counts(name: str, values: Sequence[int], *, minimum: int) -> np.ndarray:
    """A non-empty 1-D int64 array of whole numbers >= ``minimum`` (ConfigError otherwise)."""
    try:
        arr = np.array(values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} must be a list of integers, got {values!r}") from exc
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iuf":
        raise ConfigError(f"{name} must be a non-empty list of integers, got {values!r}")
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
        raise ConfigError(f"{name} must be whole numbers, got {arr.tolist()}")
    if np.any(arr < minimum):
        raise ConfigError(f"{name} must all be >= {minimum}, got {arr.tolist()}")
    return arr.astype(np.int64)
