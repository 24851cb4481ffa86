"""Blending: FORMATS.md §9.4/§9.5 vectors, a straightforward port of helpers.cpp as the oracle
for both engines (exhaustive small cases + hypothesis), the speculative chunking's fix-up
paths, proportion bounds, temperature weights and rejected inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.errors import ConfigError
from tokenmill.indices import _blend_kernels as kernels
from tokenmill.indices import _jit
from tokenmill.indices.blend import (
    blend_sample_counts,
    blend_size,
    build_blend_indices,
    exhaustive_blend_indices,
    normalize_weights,
    temperature_weights,
)

ENGINES = ["numpy", "numba"] if _jit.available() else ["numpy"]


def ref_blend(weights, size, limits=None):
    """helpers.cpp build_blending_indices / build_exhaustive_blending_indices, line by line."""
    w = [float(v) for v in weights]
    counts = [0] * len(w)
    dataset_index, sample_index = [], []
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_error = -1, None
        for d in range(len(w)):
            if limits is not None and counts[d] >= limits[d]:
                continue
            error = w[d] * x - float(counts[d])
            if best < 0 or error > best_error:
                best, best_error = d, error
        dataset_index.append(best)
        sample_index.append(counts[best])
        counts[best] += 1
    return np.array(dataset_index, dtype=np.int64), np.array(sample_index, dtype=np.int64)


def run_engine(engine, weights, size, limits=None):
    di, dsi, counts = kernels.greedy_blend(
        np.asarray(weights, dtype=np.float64), size, index_dtype=np.int16, limits=limits,
        engine=engine,
    )  # fmt: skip
    np.testing.assert_array_equal(counts, np.bincount(di.astype(np.int64), minlength=len(weights)))
    return di.astype(np.int64), dsi


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    """Each engine, with the numba engine's thread chunking switched on for small sizes."""
    monkeypatch.setattr(kernels, "PARALLEL_MIN_SIZE", 64)
    monkeypatch.setattr(kernels, "_threads", lambda: 5)
    monkeypatch.setattr(kernels, "default_engine", lambda: request.param)
    return request.param


# -- FORMATS §9.4 / §9.5 -------------------------------------------------------------------------
def test_three_dataset_vector(engine):
    di, dsi = build_blend_indices([0.5, 0.3, 0.2], 10)
    assert di.tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0] and di.dtype == np.int16
    assert dsi.tolist() == [0, 0, 0, 1, 1, 2, 1, 3, 2, 4] and dsi.dtype == np.int64


def test_nanotron_wraps_modulo_the_dataset_sizes(engine):
    di, dsi = build_blend_indices(
        [0.5, 0.3, 0.2], 10, semantics="nanotron", dataset_sizes=[3, 2, 100]
    )
    assert di.tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0] and di.dtype == np.uint64
    assert dsi.tolist() == [0, 0, 0, 1, 1, 2, 1, 0, 0, 1] and dsi.dtype == np.int64


def test_ties_go_to_the_lowest_index(engine):
    assert build_blend_indices([1 / 3] * 3, 9)[0].tolist() == [0, 1, 2] * 3
    assert build_blend_indices([1, 1], 6)[0].tolist() == [0, 1] * 3


def test_four_dataset_vector_is_the_loop_on_the_raw_weights(engine):
    # FORMATS §9.4 runs the loop on [0.1, 0.5, 0.3, 0.1] as given (their sum is 1 - 2**-53);
    # both references normalize first, which changes step 10.
    raw = [0.1, 0.5, 0.3, 0.1]
    di, dsi = run_engine(engine, raw, 20)
    assert di.tolist() == [1, 2, 0, 1, 3, 1, 2, 1, 2, 1, 0, 1, 2, 1, 3, 1, 2, 1, 2, 1]
    assert dsi.tolist() == [0, 0, 0, 1, 0, 2, 1, 3, 2, 4, 1, 5, 3, 6, 1, 7, 4, 8, 5, 9]
    assert build_blend_indices(raw, 20)[0].tolist()[10] == 1


def test_megatron_normalizes_twice_and_nanotron_once(engine):
    weights = [0.7, 0.2, 0.1]
    once = normalize_weights(weights)
    twice = normalize_weights(once)
    assert once.tolist() == [0.7000000000000001, 0.20000000000000004, 0.10000000000000002]
    assert twice.tolist() == [0.7, 0.19999999999999998, 0.09999999999999999]
    megatron = build_blend_indices(weights, 40)
    nanotron = build_blend_indices(weights, 40, semantics="nanotron")
    np.testing.assert_array_equal(megatron[0], ref_blend(twice, 40)[0])
    np.testing.assert_array_equal(nanotron[0].astype(np.int64), ref_blend(once, 40)[0])
    assert megatron[0].tolist()[:7] != nanotron[0].tolist()[:7]


@pytest.mark.parametrize(
    ("size", "megatron", "megatron_size", "nanotron"),
    [
        (1000, [503, 302, 201], 1000, [502, 301, 200]),
        (10, [6, 4, 3], 10, [5, 3, 2]),
        (12345, [6204, 3723, 2482], 12346, [6203, 3722, 2481]),
    ],
)
def test_sample_counts_vectors(size, megatron, megatron_size, nanotron):
    weights = [0.5, 0.3, 0.2]
    assert blend_sample_counts(weights, size) == megatron
    assert blend_size(weights, size) == megatron_size
    assert blend_sample_counts(weights, size, semantics="nanotron") == nanotron
    assert blend_size(weights, size, semantics="nanotron") == size


def test_megatron_targets_use_the_builder_normalization():
    # The builder's single pass gives 0.7000000000000001, so ceil(10·w) = 8, not 7: the
    # reference blends 13 samples for 10 requested (the second pass only feeds the loop).
    assert blend_size([0.7, 0.2, 0.1], 10) == 13
    assert blend_sample_counts([0.7, 0.2, 0.1], 10) == [9, 4, 3]
    assert blend_sample_counts([0.7, 0.2, 0.1], 10, semantics="nanotron") == [7, 2, 1]


def test_counts_accept_unnormalized_weights():
    assert blend_sample_counts([5, 3, 2], 1000) == [503, 302, 201]
    assert blend_sample_counts([2, 1], 7, semantics="nanotron") == [4, 2]


# -- oracle comparisons ------------------------------------------------------------------------
def test_every_small_integer_mix_matches_the_reference(engine):
    for k in (1, 2, 3, 4):
        for ratios in itertools.product(range(1, 4), repeat=k):
            w = normalize_weights(ratios)
            want = ref_blend(w, 120)
            got = run_engine(engine, w, 120)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])


@settings(max_examples=150, deadline=None)
@given(
    weights=st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=9),
    size=st.integers(0, 3000),
    engine_name=st.sampled_from(ENGINES),
)
def test_random_weights_match_the_reference(weights, size, engine_name):
    w = normalize_weights(weights)
    got = run_engine(engine_name, w, size)
    want = ref_blend(w, size)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@settings(max_examples=80, deadline=None)
@given(counts=st.lists(st.integers(1, 400), min_size=1, max_size=7))
def test_exhaustive_matches_the_reference(counts):
    total = sum(counts)
    want = ref_blend(np.array(counts) / float(total), total, counts)
    for engine_name in ENGINES:
        di, dsi = run_engine(engine_name, np.array(counts) / float(total), total, counts)
        np.testing.assert_array_equal(di, want[0])
        np.testing.assert_array_equal(dsi, want[1])


def test_chunked_engines_match_at_scale(engine):
    rng = np.random.default_rng(3)
    w = normalize_weights(rng.random(6))
    size = 40_000
    np.testing.assert_array_equal(run_engine(engine, w, size)[0], ref_blend(w, size)[0])


def test_chunks_that_never_meet_are_recomputed(engine, monkeypatch):
    # Guesses whose total is off by one can never meet the true run: every chunk is redone.
    monkeypatch.setattr(kernels, "guess_counts", _bad_guesses(kernels.guess_counts))
    w = normalize_weights([0.45, 0.3, 0.25])
    for limits in (None, [400, 300, 250]):
        size = 950 if limits else 2000
        got = run_engine(engine, w, size, limits)
        want = ref_blend(w, size, limits)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def _bad_guesses(real):
    def guess(w, limits, steps):
        g = real(w, limits, steps)
        g[1:, 0] += 1
        return g

    return guess


# -- properties ----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=8), size=st.integers(1, 2000))
def test_counts_track_the_weights(weights, size):
    di, _ = build_blend_indices(weights, size)
    w = normalize_weights(normalize_weights(weights))
    onehot = np.zeros((size + 1, len(w)))
    onehot[np.arange(1, size + 1), di.astype(np.int64)] = 1
    counts = np.cumsum(onehot, axis=0)  # counts after i samples
    ideal = np.arange(size + 1)[:, None] * w[None, :]
    assert np.all(counts <= ideal + 1 + 1e-9)  # never more than one sample ahead
    assert np.all(counts >= ideal - (len(w) - 1) - 1e-9)


def test_counts_can_fall_more_than_one_behind():
    # The greedy keeps every dataset within one sample *ahead*; behind, it can lag by more.
    di, _ = build_blend_indices([1, 1, 1, 5], 5)
    counts = np.bincount(di, minlength=4)
    assert counts.tolist() == [1, 1, 1, 2]
    assert 5 * normalize_weights([1, 1, 1, 5])[3] - counts[3] == 1.125


def test_exhaustive_uses_every_sample_once(engine):
    di, dsi = exhaustive_blend_indices([5, 1, 3])
    assert di.dtype == np.int16 and dsi.dtype == np.int64
    assert len(di) == 9
    for d, n in enumerate([5, 1, 3]):
        assert dsi[di == d].tolist() == list(range(n))
    np.testing.assert_array_equal(di, ref_blend(np.array([5, 1, 3]) / 9.0, 9, [5, 1, 3])[0])


def test_megatron_oversampling_is_an_error():
    with pytest.raises(ConfigError, match=r"dataset 0 is sampled 5 times .* has 4 samples"):
        build_blend_indices([0.5, 0.3, 0.2], 10, dataset_sizes=[4, 3, 2])
    di, _ = build_blend_indices([0.5, 0.3, 0.2], 10, dataset_sizes=[5, 3, 2])
    assert len(di) == 10


# -- temperature ---------------------------------------------------------------------------------
def test_temperature_weights():
    sizes = [100, 300, 600]
    np.testing.assert_allclose(temperature_weights(sizes, 1.0), [0.1, 0.3, 0.6])
    flat = temperature_weights(sizes, 2.0)
    expected = np.sqrt([0.1, 0.3, 0.6])
    np.testing.assert_allclose(flat, expected / expected.sum())
    assert temperature_weights(sizes, 1e9) == pytest.approx([1 / 3] * 3)
    assert temperature_weights(sizes, 5.0).sum() == pytest.approx(1.0)


@pytest.mark.parametrize("temperature", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_bad_temperatures(temperature):
    with pytest.raises(ConfigError, match="temperature"):
        temperature_weights([1, 2], temperature)


# -- rejected inputs -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([], "non-empty"),
        ([0.5, -0.1], "finite and non-negative"),
        ([0.5, float("nan")], "finite and non-negative"),
        ([0.5, float("inf")], "finite and non-negative"),
        ([0.0, 0.0], "positive, finite sum"),
        ([1e308, 1e308], "positive, finite sum"),
        (["a"], "list of numbers"),
        ([[0.5, 0.5]], "non-empty list"),
    ],
)
def test_bad_weights(weights, message):
    with pytest.raises(ConfigError, match=message):
        build_blend_indices(weights, 10)
    with pytest.raises(ConfigError, match=message):
        blend_sample_counts(weights, 10, semantics="nanotron")


def test_other_rejections():
    with pytest.raises(ConfigError, match="every weight > 0"):
        build_blend_indices([0.5, 0.0, 0.5], 10)
    assert len(build_blend_indices([0.5, 0.0, 0.5], 10, semantics="nanotron")[0]) == 10
    with pytest.raises(ConfigError, match="size must be a non-negative integer"):
        build_blend_indices([1, 2], -1)
    with pytest.raises(ConfigError, match="semantics"):
        blend_size([1, 2], 5, semantics="fairseq")
    with pytest.raises(ConfigError, match="2 entries for 3 weights"):
        build_blend_indices([1, 2, 3], 5, dataset_sizes=[4, 4])
    with pytest.raises(ConfigError, match="dataset 1 is empty"):
        build_blend_indices([1, 1], 5, semantics="nanotron", dataset_sizes=[9, 0])
    with pytest.raises(ConfigError, match="counts must all be >= 1"):
        exhaustive_blend_indices([3, 0])
    with pytest.raises(ConfigError, match="whole numbers"):
        exhaustive_blend_indices([3, 1.5])
    assert build_blend_indices([1], 0)[0].shape == (0,)
