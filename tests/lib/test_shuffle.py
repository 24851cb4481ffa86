"""``tokenmill.indices._shuffle``: the compiled Fisher-Yates gives numpy's ``RandomState.shuffle``
permutation and leaves the generator in the same state, for every length and dtype."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.indices import _jit, _shuffle

ENGINES = ["numpy", "numba"] if _jit.available() else ["numpy"]
DTYPES = [np.int32, np.uint32, np.int64, np.intp]


def reference(n: int, seed: int) -> tuple[np.ndarray, np.random.RandomState]:
    rng = np.random.RandomState(seed)
    values = np.arange(n, dtype=np.intp)
    rng.shuffle(values)
    return values, rng


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 623, 624, 625, 1249, 65_537, 300_001])
def test_same_permutation_and_state_as_numpy(engine: str, dtype: type, n: int) -> None:
    expected, ref_rng = reference(n, 1234)
    rng = np.random.RandomState(1234)
    values = np.arange(n, dtype=dtype)
    _shuffle.shuffle(values, rng, engine=engine)
    assert values.dtype == dtype
    assert np.array_equal(values, expected)
    assert rng.randint(0, 2**31, 8).tolist() == ref_rng.randint(0, 2**31, 8).tolist()


@pytest.mark.parametrize("engine", ENGINES)
def test_chunks_and_consecutive_shuffles(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Draws made chunk by chunk (here 1000 steps) and two shuffles in a row from one RNG."""
    monkeypatch.setattr(_shuffle, "CHUNK", 1000)
    rng, ref = np.random.RandomState(7), np.random.RandomState(7)
    for n in (5_000, 2_345):
        values, expected = np.arange(n, dtype=np.int32), np.arange(n)
        _shuffle.shuffle(values, rng, engine=engine)
        ref.shuffle(expected)
        assert np.array_equal(values, expected)
    assert rng.get_state(legacy=True)[2] == ref.get_state(legacy=True)[2]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 5_000), seed=st.integers(0, 2**32 - 1), offset=st.integers(-50, 50))
def test_any_seed_length_and_values(n: int, seed: int, offset: int) -> None:
    expected, ref_rng = reference(n, seed)
    rng = np.random.RandomState(seed)
    values = np.arange(n, dtype=np.int64) + offset
    _shuffle.shuffle(values, rng)
    assert np.array_equal(values, expected + offset)
    assert rng.random_sample() == ref_rng.random_sample()


def test_refuses_a_strided_array() -> None:
    with pytest.raises(ValueError, match=r"1-D contiguous array, got shape \(5,\)"):
        _shuffle.shuffle(np.arange(10)[::2], np.random.RandomState(0))
