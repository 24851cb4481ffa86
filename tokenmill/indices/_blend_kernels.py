"""The greedy blending loop of Megatron's helpers.cpp, bit-exact and fast (FORMATS.md §7.1/§7.4).

At step ``i`` the loop picks the dataset ``d`` with the largest ``w[d]·max(i, 1) − c[d]``
(double precision, multiply then subtract, ties to the lowest index) and counts it; in the
exhaustive variant a dataset drops out once ``c[d]`` reaches its limit.

The state after step ``i`` is the count vector: two runs that reach the same counts at the same
step agree from then on, and a run started from slightly wrong counts is observed to reach the
true ones within at most a few hundred steps. So the range is cut into chunks simulated at once
from guessed start counts (largest-remainder rounding of ``w·i``), then checked in order: each
is re-run from its true start counts until the two runs meet (or to its end). Exactness does
not rest on the observation, only speed does; the result does not depend on the chunking.

Engines: numba kernels on worker threads when numba is installed, else numpy stepping all
chunks in lock-step; both make every decision with the reference's IEEE operations.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tokenmill.indices import _jit

PARALLEL_MIN_SIZE = 1 << 20


def _choose(w, limits, counts, x):  # type: ignore[no-untyped-def]
    """Index of the largest ``w·x − c`` among datasets under their limit (empty ``limits``: no
    limit), scanned as the C++: ascending, replacing the best only on a strictly greater error."""
    if limits.shape[0] == 0:
        best, best_error = 0, w[0] * x - counts[0]
        for d in range(1, w.shape[0]):
            error = w[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        return best
    best, best_error = -1, -np.inf
    for d in range(w.shape[0]):
        if counts[d] < limits[d]:
            error = w[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
    return best


def _run_chunk(w, limits, counts, start, stop, di, dsi):  # type: ignore[no-untyped-def]
    """Steps ``[start, stop)`` from ``counts`` (updated in place)."""
    for i in range(start, stop):
        best = _choose(w, limits, counts, max(float(i), 1.0))
        di[i] = best
        dsi[i] = np.int64(counts[best])
        counts[best] += 1.0


def _fix_chunk(w, limits, counts, start, stop, di, dsi, diff):  # type: ignore[no-untyped-def]
    """Re-run a speculated chunk from its true ``counts`` until it meets the speculation;
    ``diff`` (true − speculated counts, all zero on a meet) is kept up to date from ``di``."""
    nonzero = 0
    for d in range(w.shape[0]):
        nonzero += diff[d] != 0
    i = start
    while i < stop and nonzero > 0:
        best = _choose(w, limits, counts, max(float(i), 1.0))
        guessed = np.int64(di[i])
        di[i] = best
        dsi[i] = np.int64(counts[best])
        counts[best] += 1.0
        if best != guessed:
            nonzero -= (diff[best] != 0) + (diff[guessed] != 0)
            diff[best] += 1.0
            diff[guessed] -= 1.0
            nonzero += (diff[best] != 0) + (diff[guessed] != 0)
        i += 1


if _jit.available():
    _choose = _jit.compile_kernel(_choose, inline=True)
    _run_chunk = _jit.compile_kernel(_run_chunk)
    _fix_chunk = _jit.compile_kernel(_fix_chunk)


def default_engine() -> str:
    """``"numba"`` when numba is importable, else ``"numpy"``."""
    return "numba" if _jit.available() else "numpy"


def greedy_blend(
    weights: np.ndarray,
    size: int,
    *,
    index_dtype: type,
    limits: np.ndarray | None = None,
    engine: str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index, final counts) of ``size`` greedy steps with
    ``weights`` as given (normalized); ``limits`` switches to the exhaustive variant. ``engine``
    ("numba"/"numpy", default: the fastest available) never changes the result."""
    w = np.ascontiguousarray(weights, dtype=np.float64)
    lim = np.empty(0) if limits is None else np.asarray(limits, dtype=np.float64)
    di: np.ndarray = np.empty(size, dtype=index_dtype)
    dsi = np.empty(size, dtype=np.int64)
    engine = engine or default_engine()
    if engine == "numba" and _jit.available():
        counts = _greedy_threads(w, lim, size, di, dsi)
    elif engine in ("numba", "numpy"):
        counts = _greedy_lockstep(w, lim, size, di, dsi)
    else:
        raise ValueError(f"engine must be 'numba' or 'numpy', got {engine!r}")
    return di, dsi, counts.astype(np.int64)


def greedy_continue(
    weights: np.ndarray, counts: np.ndarray, start: int, stop: int, *, index_dtype: type
) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) of steps ``[start, stop)`` of the plain loop from
    ``counts`` (after ``start`` steps, e.g. with other weights: a grown temperature blend); one
    thread, numba when available (pure Python is slow past ~10^6 steps)."""
    w = np.ascontiguousarray(weights, dtype=np.float64)
    state = np.array(counts, dtype=np.float64)
    di: np.ndarray = np.empty(max(stop, start), dtype=index_dtype)
    dsi = np.empty(max(stop, start), dtype=np.int64)
    _run_chunk(w, np.empty(0), state, start, stop, di, dsi)
    return di[start:], dsi[start:]


def guess_counts(w: np.ndarray, limits: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Plausible counts after ``steps`` steps (largest-remainder rounding of ``steps·w``)."""
    ideal = steps.astype(np.float64)[:, None] * w[None, :]
    guess = np.floor(ideal)
    missing = np.clip(steps - guess.sum(axis=1).astype(np.int64), 0, len(w))
    order = np.argsort(guess - ideal, axis=1, kind="stable")
    ranks = np.argsort(order, axis=1, kind="stable")
    guess += ranks < missing[:, None]
    return guess if limits.size == 0 else np.minimum(guess, limits[None, :])


def _threads() -> int:
    """Worker threads for the numba engine: the CPUs this process may use (at most 8)."""
    return max(1, min(len(os.sched_getaffinity(0)), 8))


def _greedy_threads(
    w: np.ndarray, lim: np.ndarray, size: int, di: np.ndarray, dsi: np.ndarray
) -> np.ndarray:
    """numba engine: one speculated chunk per CPU, then the in-order fix-ups."""
    parts = _threads() if size >= PARALLEL_MIN_SIZE else 1
    bounds = [size * j // parts for j in range(parts + 1)]
    starts = guess_counts(w, lim, np.array(bounds[:-1], dtype=np.int64))

    def run(j: int) -> np.ndarray:
        counts = starts[j].copy()
        _run_chunk(w, lim, counts, bounds[j], bounds[j + 1], di, dsi)
        return counts

    if parts == 1:
        return run(0)
    with ThreadPoolExecutor(max_workers=parts) as pool:
        ends = list(pool.map(run, range(parts)))
    true = ends[0]
    for j in range(1, parts):
        diff = true - starts[j]
        _fix_chunk(w, lim, true.copy(), bounds[j], bounds[j + 1], di, dsi, diff)
        true = ends[j] + diff
    return true


def _greedy_lockstep(
    w: np.ndarray, lim: np.ndarray, size: int, di: np.ndarray, dsi: np.ndarray
) -> np.ndarray:
    """numpy engine: all chunks step together, then fix-up passes (see module docstring)."""
    if size == 0:
        return np.zeros(len(w))
    chunk = max(16, min(4096, math.isqrt(size)))
    starts = np.arange(0, size, chunk, dtype=np.int64)
    guessed = guess_counts(w, lim, starts)
    counts = guessed.T.copy()
    _run_rows(w, lim, counts, starts, size, di, dsi)
    ends = counts.T
    stops = np.minimum(starts + chunk, size)
    first, true = 1, ends[0].copy()
    while first < len(starts):
        begin = np.vstack([true[None, :], ends[first:-1]])
        diff = begin - guessed[first:]
        written = _fix_rows(w, lim, begin.T.copy(), starts[first:], stops[first:], di, diff)
        unmet = np.flatnonzero(diff.any(axis=1))
        last = len(starts) - 1 if unmet.size == 0 else first + int(unmet[0])
        for step, rows, best, taken in written:
            valid = rows <= last - first
            i = starts[first + rows[valid]] + step
            di[i] = best[valid]
            dsi[i] = taken[valid]
        true = ends[last] + diff[last - first]
        first = last + 1
    return true


def _run_rows(w, lim, counts, starts, size, di, dsi):  # type: ignore[no-untyped-def]
    """Step every chunk (a column of ``counts``, shape K × chunks) to its end, writing output."""
    num_rows = counts.shape[1]
    chunk = int(starts[1] - starts[0]) if num_rows > 1 else size
    last_length = size - int(starts[-1])
    flat = counts.reshape(-1)
    for step in range(chunk):
        n = num_rows if step < last_length else num_rows - 1
        i = starts[:n] + step
        best = _argmax_columns(w, lim, counts[:, :n], i)
        cells = best * num_rows + np.arange(n)
        di[i] = best
        dsi[i] = flat[cells]
        flat[cells] += 1.0


def _fix_rows(w, lim, counts, starts, stops, di, diff):  # type: ignore[no-untyped-def]
    """Re-run chunks from their assumed true start ``counts`` until each meets its speculation
    (``diff``, rows × K, kept up to date; ``di`` holds the speculated choices): the re-run
    choices as ``(step, rows, choice, sample)`` batches."""
    num_rows = counts.shape[1]
    flat = counts.reshape(-1)
    active = np.flatnonzero(diff.any(axis=1))
    written = []
    step = 0
    while active.size:
        i = starts[active] + step
        best = _argmax_columns(w, lim, counts[:, active], i)
        cells = best * num_rows + active
        written.append((step, active, best, flat[cells].copy()))
        flat[cells] += 1.0
        diff[active, best] += 1.0
        diff[active, di[i].astype(np.int64)] -= 1.0
        step += 1
        active = active[(i + 1 < stops[active]) & diff[active].any(axis=1)]
    return written


def _argmax_columns(w, lim, counts, steps):  # type: ignore[no-untyped-def]
    """Per column: the first dataset with the largest ``w·max(i, 1) − c`` (under its limit)."""
    x = np.maximum(steps, 1).astype(np.float64)
    errors = w[:, None] * x[None, :]
    errors -= counts
    if lim.size:
        errors[counts >= lim[:, None]] = -np.inf
    if len(w) > 32:
        return errors.argmax(axis=0)
    top = errors.max(axis=0)
    best = np.full(len(x), len(w) - 1)
    for d in range(len(w) - 2, -1, -1):
        np.copyto(best, d, where=errors[d] == top)
    return best
