"""Nanoset index algorithms: split ranges and document/sample/shuffle indices (pure functions),
bit-exact to their references (FORMATS.md §4–§6, vectors in §9):

- ``megatron``: megatron-core GPTDataset — bookend split rounding, ``E`` epochs shuffled
  jointly (a final epoch used below 80% is shuffled separately), ``add_extra_token`` and
  ``drop_last_partial`` flags, sample/shuffle index dtypes by size.
- ``nanotron``: the index-era nanotron Nanoset — legacy split rule, one shuffled epoch of
  documents and samples, the shuffle index tiled ``int(N / M) + 1`` times for training.

All randomness is one fresh ``numpy.random.RandomState(seed)`` per (dataset, split), drawn in
the references' order: document shuffle(s), then sample shuffle(s). The public API and the
on-disk cache are in ``tokenmill.indices.nanoset``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.errors import ConfigError
from tokenmill.formats.blend_manifest import SPLITS
from tokenmill.indices import _shuffle
from tokenmill.indices._sample_index import build_sample_index, count_samples

SEMANTICS = ("megatron", "nanotron")
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
UINT32_SHUFFLE_LIMIT = int(np.iinfo(np.uint32).max) - 1


# -- splits ------------------------------------------------------------------------------------
def parse_split(split: str) -> list[float]:
    """``"949,50,1"`` → normalized ``[0.949, 0.05, 0.001]`` (regex ``[.0-9]+``, padded to 3)."""
    if not isinstance(split, str):
        raise ConfigError(f"split must be a string like '949,50,1', got {split!r}")
    if re.search(r"-\s*[.0-9]", split):
        raise ConfigError(f"split {split!r}: weights must not be negative")
    try:
        values = [float(tok) for tok in re.findall(r"[.0-9]+", split)]
    except ValueError as exc:
        raise ConfigError(f"split {split!r}: {exc}") from exc
    if len(values) > len(SPLITS):
        raise ConfigError(f"split {split!r}: at most 3 weights (train, valid, test)")
    values += [0.0] * (len(SPLITS) - len(values))
    weights = np.array(values, dtype=np.float64)
    total = np.sum(weights)
    if not total > 0 or not np.isfinite(total):
        raise ConfigError(f"split {split!r}: the weights must have a positive, finite sum")
    return (weights / total).tolist()


def split_ranges(split: str, num_sequences: int, semantics: str) -> list[tuple[int, int] | None]:
    """Sequence-id range ``(begin, end)`` of train/valid/test, None for a zero-weight split:
    megatron rounds each cumulative bookend (half to even); nanotron (and legacy Megatron)
    rounds each weight and moves the excess off every boundary but the first."""
    _check_semantics(semantics)
    n = check_int("num_sequences", num_sequences, minimum=0)
    weights = parse_split(split)
    if semantics == "megatron":
        bookends = itertools.accumulate(weights, initial=0.0)
        return [
            None if hi <= lo else (round(lo * float(n)), round(hi * float(n)))
            for lo, hi in itertools.pairwise(bookends)
        ]
    bounds = list(itertools.accumulate((round(w * float(n)) for w in weights), initial=0))
    excess = bounds[-1] - n
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    ranges = [None if w == 0.0 else (bounds[i], bounds[i + 1]) for i, w in enumerate(weights)]
    for r in ranges:
        if r is not None and (r[0] < 0 or r[1] < r[0]):
            raise ConfigError(f"split {split!r} with {n} sequences gives the range {r}")
    return ranges


# -- indices -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexPlan:
    """Sizes decided before any randomness: epochs, tokens, samples, final-epoch handling."""

    tokens_per_epoch: int
    num_epochs: int
    num_samples: int
    separate_final_epoch: bool
    samples_before_final_epoch: int
    shuffle_copies: int


def compute_indices(
    sequence_lengths: np.ndarray | Sequence[int],
    split_range: tuple[int, int],
    params: Mapping[str, Any],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, IndexPlan]:
    """``nanoset.build_nanoset_indices`` plus the :class:`IndexPlan` it followed; ``params``
    holds that function's keyword arguments by name (as a Nanoset cache key does)."""
    semantics = params["semantics"]
    _check_semantics(semantics)
    sizes = _check_lengths(sequence_lengths)
    lo, hi = _check_range(split_range, len(sizes))
    seq = check_int("sequence_length", params["sequence_length"], minimum=2)
    seed = check_int("seed", params["seed"], minimum=0, maximum=2**32 - 1)
    num_samples = params["num_samples"]
    num_samples = None if num_samples is None else check_int("num_samples", num_samples, minimum=0)
    add_extra_token, drop_last_partial = params["add_extra_token"], params["drop_last_partial"]
    if semantics == "nanotron" and not (add_extra_token and drop_last_partial):
        raise ConfigError(
            "nanotron semantics always adds the extra token and drops the last partial "
            "sample: add_extra_token and drop_last_partial must be True"
        )
    extra = 1 if add_extra_token else 0
    tokens = int(np.sum(sizes[lo:hi], dtype=np.int64))
    plan = _plan(tokens, num_samples, seq, extra, drop_last_partial, semantics)
    rng = np.random.RandomState(seed)
    document_index = np.tile(np.arange(lo, hi, dtype=np.int32), plan.num_epochs)
    _shuffled(document_index, (hi - lo) * (plan.num_epochs - plan.separate_final_epoch), rng)
    shuffle_dtype = shuffle_index_dtype(plan.num_samples, semantics)
    shuffle_index = np.arange(plan.num_samples, dtype=shuffle_dtype)
    dtype = np.dtype(np.int32) if semantics == "nanotron" else None
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The shuffle only needs the sample count, known in advance, and the RNG state after
        # the document shuffle, so it overlaps with the sample index (numpy drops the GIL).
        shuffled = pool.submit(_shuffled, shuffle_index, plan.samples_before_final_epoch, rng)
        sample_index = build_sample_index(
            sizes,
            document_index,
            sequence_length=seq,
            total_tokens=plan.num_epochs * tokens,
            drop_last=drop_last_partial,
            extra=extra,
            dtype=dtype,
        )
        shuffled.result()
    if plan.shuffle_copies > 1:
        shuffle_index = np.tile(shuffle_index, plan.shuffle_copies)
    return document_index, sample_index, shuffle_index, plan


def _plan(
    tokens: int, num_samples: int | None, seq: int, extra: int, drop_last: bool, semantics: str
) -> IndexPlan:
    """Epochs and sample counts (GPTDataset / index-era Nanoset rules)."""
    if tokens <= 1 and (semantics == "megatron" or tokens == 0):
        raise ConfigError(
            f"the split holds {tokens} token(s); indexing needs at least 2 "
            "(choose a split or dataset with more data)"
        )
    if semantics == "nanotron":
        per_epoch = (tokens - 1) // seq
        copies = 1
        if num_samples is not None:
            if per_epoch == 0:
                raise ConfigError(
                    f"num_samples={num_samples}: the split has {tokens} tokens, fewer than "
                    f"sequence_length+1 = {seq + 1}, so no training sample fits"
                )
            copies = int(num_samples / per_epoch) + 1
        if per_epoch > UINT32_SHUFFLE_LIMIT:
            raise ConfigError(f"nanotron's uint32 shuffle index cannot hold {per_epoch} samples")
        return IndexPlan(tokens, 1, per_epoch, False, per_epoch, copies)
    epochs = 1 if num_samples is None else max(1, -(-(num_samples * seq + extra) // tokens))
    total = count_samples(epochs * tokens, seq, extra, drop_last)
    separate, before = False, total
    if epochs > 1 and num_samples is not None:
        before = ((epochs - 1) * tokens - extra) // seq
        per_epoch = (tokens - extra) // seq
        separate = num_samples - before < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    return IndexPlan(tokens, epochs, total, separate, before if separate else total, 1)


def shuffle_index_dtype(num_samples: int, semantics: str) -> np.dtype:
    """uint32, or int64 from 2**32 - 2 samples on (megatron; nanotron is always uint32)."""
    small = semantics == "nanotron" or num_samples < UINT32_SHUFFLE_LIMIT
    return np.dtype(np.uint32 if small else np.int64)


def _shuffled(values: np.ndarray, split_at: int, rng: np.random.RandomState) -> None:
    """Shuffle ``values[:split_at]`` then, separately, the rest, in place: the references' joint
    epochs and their separately shuffled final epoch (of documents or of samples)."""
    _shuffle.shuffle(values[:split_at], rng)
    if split_at < len(values):
        _shuffle.shuffle(values[split_at:], rng)


# -- argument checks ---------------------------------------------------------------------------
def _check_semantics(semantics: str) -> None:
    if semantics not in SEMANTICS:
        raise ConfigError(f"semantics must be one of {list(SEMANTICS)}, got {semantics!r}")


def check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{name} must be {bound}, got {value}")
    return int(value)


def _check_lengths(sequence_lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    sizes = np.asarray(sequence_lengths)
    if sizes.ndim != 1 or (sizes.size and sizes.dtype.kind not in "iu"):
        raise ConfigError(f"sequence_lengths must be a 1-D integer array, got {sizes.dtype}")
    if sizes.size and sizes.min() < 0:
        raise ConfigError(f"sequence_lengths contain a negative length ({int(sizes.min())})")
    if sizes.dtype != np.int32:
        if sizes.size and sizes.max() > np.iinfo(np.int32).max:
            raise ConfigError("sequence_lengths must fit int32 (the .idx length type)")
        sizes = sizes.astype(np.int32)
    return sizes


def _check_range(split_range: Any, num_sequences: int) -> tuple[int, int]:
    if split_range is None or len(split_range) != 2:
        raise ConfigError(f"split_range must be a (begin, end) pair, got {split_range!r}")
    lo = check_int("split_range begin", split_range[0], minimum=0)
    hi = check_int("split_range end", split_range[1], minimum=0)
    if not lo < hi <= num_sequences:
        raise ConfigError(
            f"split_range [{lo}, {hi}) must be non-empty and within the {num_sequences} "
            "sequences of the dataset"
        )
    return lo, hi
