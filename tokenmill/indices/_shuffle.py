"""``numpy.random.RandomState.shuffle`` reproduced bit-exactly, faster, when numba is installed.

Bit-exact index builds must draw their permutations from ``RandomState(seed).shuffle``. numpy's
loop interleaves each draw (MT19937 plus a rejection loop with unpredictable branches) with a
swap at a random position, so the CPU waits on one cache miss at a time. Here a chunk's draws
are made first (MT19937 and numpy's ``random_interval`` rejection rule, ported), then its swaps
run as a branch-free loop whose independent loads overlap. The permutation and the generator
state left behind are numpy's; without numba (or for 64-bit draws) numpy's ``shuffle`` runs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import numpy as np

N = 624  # MT19937 state words
M = 397
MATRIX_A = 0x9908B0DF
UPPER_MASK = 0x80000000
LOWER_MASK = 0x7FFFFFFF
WORD = 0xFFFFFFFF
CHUNK = 1 << 20  # steps whose draws are made before their swaps (4 MiB of positions)
MAX_32BIT_DRAW = 0xFFFFFFFF  # random_interval draws 32-bit values up to this bound
_COMPILE_LOCK = threading.Lock()


def _twist(key):  # type: ignore[no-untyped-def]
    """MT19937's state regeneration (numpy's ``mt19937_gen``) on a uint32[624] key."""
    upper, lower, matrix = np.uint64(UPPER_MASK), np.uint64(LOWER_MASK), np.uint64(MATRIX_A)
    one = np.uint64(1)
    for i in range(N):
        y = (np.uint64(key[i]) & upper) | (np.uint64(key[(i + 1) % N]) & lower)
        value = np.uint64(key[(i + M) % N]) ^ (y >> one)
        if y & one:
            value ^= matrix
        key[i] = np.uint32(value & np.uint64(WORD))


def _fill_draws(key, pos, top, count, draws):  # type: ignore[no-untyped-def]
    """``random_interval(i)`` for i = top, top-1, …, top-count+1 into ``draws[0:count]``: each
    takes tempered 32-bit outputs ``y`` until ``y & mask <= i`` (``mask``: the smallest all-ones
    value >= i). Returns the key position after the last output used."""
    temper_b, temper_c = np.uint64(0x9D2C5680), np.uint64(0xEFC60000)
    word = np.uint64(WORD)
    for step in range(count):
        bound = np.uint64(top - step)
        mask = bound
        for shift in (1, 2, 4, 8, 16):
            mask |= mask >> np.uint64(shift)
        while True:
            if pos == N:
                _twist(key)
                pos = 0
            y = np.uint64(key[pos])
            pos += 1
            y ^= y >> np.uint64(11)
            y ^= (y << np.uint64(7)) & temper_b
            y ^= (y << np.uint64(15)) & temper_c
            y ^= y >> np.uint64(18)
            value = y & word & mask
            if value <= bound:
                break
        draws[step] = value
    return pos


def _shuffle_kernel(values, key, pos, draws):  # type: ignore[no-untyped-def]
    """Fisher-Yates from the last item down, as numpy's ``_shuffle_raw``, in chunks of
    ``len(draws)`` steps; ``key`` is updated in place and the new position returned."""
    top = values.shape[0] - 1
    chunk = draws.shape[0]
    while top >= 1:
        count = min(chunk, top)
        pos = _fill_draws(key, pos, top, count, draws)
        for step in range(count):
            i = top - step
            j = draws[step]
            held = values[i]
            values[i] = values[j]
            values[j] = held
        top -= count
    return pos


@functools.cache
def _compiled() -> Callable[..., int] | None:
    """The shuffle kernel compiled with numba (imported here, on first use), or None."""
    global _twist, _fill_draws
    from tokenmill.indices import _jit

    if not _jit.available():
        return None
    with _COMPILE_LOCK:  # two threads may ask at once; the helpers are swapped in only once
        if not hasattr(_fill_draws, "py_func"):
            # The kernel finds its helpers among the module's globals when it is compiled.
            _twist = _jit.compile_kernel(_twist)
            _fill_draws = _jit.compile_kernel(_fill_draws)
        return _jit.compile_kernel(_shuffle_kernel)


def shuffle(values: np.ndarray, rng: np.random.RandomState, *, engine: str | None = None) -> None:
    """``rng.shuffle(values)`` for a 1-D contiguous integer array: same permutation, same RNG
    state afterwards. ``engine`` "numba" (the default when installed) or "numpy" only changes
    the speed."""
    if values.ndim != 1 or not values.flags.c_contiguous:
        raise ValueError(f"shuffle needs a 1-D contiguous array, got shape {values.shape}")
    kernel = _compiled() if engine in (None, "numba") else None
    n = len(values)
    if kernel is None or n < 2 or n - 1 > MAX_32BIT_DRAW:
        wide = values if values.dtype == np.intp else values.astype(np.intp)
        rng.shuffle(wide)  # numpy's loop is fastest on pointer-sized items
        if wide is not values:
            values[...] = wide
        return
    state = rng.get_state(legacy=False)  # {"state": {"key": uint32[624], "pos": int}, ...}
    key = np.array(state["state"]["key"], dtype=np.uint32)
    pos = kernel(values, key, int(state["state"]["pos"]), np.empty(min(CHUNK, n), np.uint32))
    state["state"] = {"key": key, "pos": pos}
    rng.set_state(state)
