"""Megatron's ``build_sample_idx`` (FORMATS.md §5.4), bit-exact, two ways.

Row ``k`` is ``(position in document_index, token offset)`` where sample ``k`` starts. With
numba the C++ loop itself is compiled (:func:`_fill_rows`); without it the index is vectorized:
away from the very end, sample ``k`` starts at token ``k·S`` of the concatenated stream, in the
document counted by how many documents end at or before ``k·S + extra − 1`` (one cumulative sum
and one count, no per-sample loop). The last row of a keep-partial index may instead be the
"end of data" row ``(n − 1, len − extra)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from tokenmill.errors import ConfigError

INT32_MAX = int(np.iinfo(np.int32).max)


def sample_index_dtype(document_index_length: int, max_sequence_length: int) -> np.dtype:
    """int32 unless a document position or a length exceeds INT32_MAX (Megatron helpers.py)."""
    biggest = max(document_index_length, max_sequence_length)
    return np.dtype(np.int32 if biggest <= INT32_MAX else np.int64)


def count_samples(total_tokens: int, sequence_length: int, extra: int, drop_last: bool) -> int:
    """Number of samples ``M`` in an index over ``total_tokens`` tokens; keeping the last partial
    sample rounds up in single precision as helpers.cpp (``ceil(float(E·T − extra) / S)``)."""
    if drop_last:
        return (total_tokens - extra) // sequence_length
    quotient = np.float32(total_tokens - extra) / np.float32(sequence_length)
    return int(np.ceil(quotient))


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    *,
    sequence_length: int,
    total_tokens: int,
    drop_last: bool,
    extra: int,
    dtype: np.dtype | None = None,
    engine: str | None = None,
) -> np.ndarray:
    """The ``(M + 1, 2)`` sample index of helpers.cpp over ``document_index`` (shuffled ids into
    ``sizes``, ``total_tokens`` = ``E·T`` long); ``dtype`` defaults to Megatron's rule, ``engine``
    ("numba"/"numpy") never changes the result. ConfigError where the reference aborts."""
    n = len(document_index)
    num_samples = count_samples(total_tokens, sequence_length, extra, drop_last)
    if dtype is None:
        dtype = sample_index_dtype(n, int(sizes.max()) if len(sizes) else 0)
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[0] = 0
    if num_samples == 0:
        return out
    lengths = sizes[document_index]
    kernel = _compiled_fill_rows() if engine in (None, "numba") else None
    if kernel is not None:
        early = kernel(lengths, sequence_length, extra, out)
    else:
        early = _fill_rows_vectorized(lengths, sequence_length, extra, out)
    if early:
        raise ConfigError(
            f"sample {early} of {num_samples} runs past the end of the data: the single-"
            "precision sample count of drop_last_partial=False overshoots for a split this "
            "large (Megatron aborts here); keep drop_last_partial=True"
        )
    if out[-1, 1] < 0:
        raise ConfigError(
            "drop_last_partial=False: the last sequence of the split is empty, so the "
            "partial final sample would start at offset -1 (Megatron asserts here); "
            "keep drop_last_partial=True"
        )
    return out


def _fill_rows(lengths, seq, extra, out):  # type: ignore[no-untyped-def]
    """helpers.cpp's loop over the stream's sequence ``lengths``: rows 1..M of ``out``; returns
    the sample that ran past the end of the data before the last (the reference aborts), or 0."""
    last = lengths.shape[0] - 1
    num_samples = out.shape[0] - 1
    d = 0
    offset = 0
    for k in range(1, num_samples + 1):
        need = seq + extra
        while need != 0:
            length = np.int64(lengths[d]) - offset
            need -= length
            if need <= 0:
                offset += need + length - extra
                need = 0
            elif d == last:
                if k != num_samples:
                    return k
                offset = np.int64(lengths[d]) - extra
                break
            else:
                d += 1
                offset = 0
        out[k, 0] = d
        out[k, 1] = offset
    return 0


@functools.cache
def _compiled_fill_rows() -> Callable[..., int] | None:
    """:func:`_fill_rows` compiled with numba (imported only here, on first use), or None."""
    from tokenmill.indices import _jit

    return _jit.compile_kernel(_fill_rows) if _jit.available() else None


def _fill_rows_vectorized(lengths: np.ndarray, seq: int, extra: int, out: np.ndarray) -> int:
    """:func:`_fill_rows` as a cumulative sum plus a count (see the module docstring)."""
    n = len(lengths)
    num_samples = len(out) - 1
    ends = np.cumsum(lengths, dtype=np.int64)
    positions = _first_documents(ends, seq, extra, num_samples)
    past_end = positions >= n
    if past_end.any():
        first = int(np.argmax(past_end)) + 1
        if first != num_samples:
            return first
        positions[-1] = n - 1
    offsets = np.arange(1, num_samples + 1, dtype=np.int64)
    offsets *= seq
    offsets -= ends[positions]
    offsets += lengths[positions]
    if past_end.any():
        offsets[-1] = int(lengths[n - 1]) - extra
    out[1:, 0] = positions
    out[1:, 1] = offsets
    return 0


def _first_documents(
    ends: np.ndarray, sequence_length: int, extra: int, num_samples: int
) -> np.ndarray:
    """For k = 1..M, the number of documents ending at or before token ``k·S + extra − 1``:
    document j does for every ``k >= (ends[j] − extra + S) // S``, counted in linear time."""
    first_sample = ends + (sequence_length - extra)
    first_sample //= sequence_length
    np.minimum(first_sample, num_samples + 1, out=first_sample)
    per_sample = np.bincount(first_sample, minlength=num_samples + 2)
    return np.cumsum(per_sample[: num_samples + 1])[1:]
