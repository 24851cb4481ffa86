"""Nanoset split ranges and indices: FORMATS.md §9 vectors, a straightforward port of the
references as an oracle (hypothesis), sample-tiling properties, dtype rules and rejections."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.errors import ConfigError
from tokenmill.indices import _jit, _sample_index
from tokenmill.indices._nanoset_indices import parse_split, shuffle_index_dtype
from tokenmill.indices._sample_index import build_sample_index, count_samples, sample_index_dtype
from tokenmill.indices.nanoset import build_nanoset_indices, split_ranges

LENGTHS = [5, 3, 7, 4]
SAMPLE_ENGINES = ["numpy", "numba"] if _jit.available() else ["numpy"]


# -- oracle: the references, ported line by line (slow, obviously correct) -------------------
class RefAbort(Exception):
    """Where the reference asserts, aborts or divides by zero."""


def ref_sample_idx(sizes, doc_idx, seq, epochs, tokens, drop_last, extra):
    if drop_last:
        num = (epochs * tokens - extra) // seq
    else:
        num = math.ceil(float(np.float32(epochs * tokens - extra) / np.float32(seq)))
    rows, d, off = [(0, 0)], 0, 0
    for k in range(1, num + 1):
        need = seq + extra
        while need != 0:
            avail = int(sizes[doc_idx[d]]) - off
            need -= avail
            if need <= 0:
                off += need + avail - extra
                need = 0
            elif d == len(doc_idx) - 1:
                if k != num:
                    raise RefAbort("end of data before the last sample")
                off = int(sizes[doc_idx[d]]) - extra
                break
            else:
                d, off = d + 1, 0
        rows.append((d, off))
    out = np.array(rows, dtype=np.int64)
    if out.min() < 0:
        raise RefAbort("negative offset")
    return out.astype(np.int32)


def ref_megatron(sizes, lo, hi, seq, seed, num_samples, extra=1, drop_last=True):
    indices = np.arange(lo, hi, dtype=np.int32)
    tokens = int(np.sum(np.asarray(sizes, dtype=np.int32)[indices]))
    if tokens <= 1 or seq <= 1:
        raise RefAbort("helpers.cpp asserts")
    epochs, total_tokens = 1, tokens
    if num_samples is not None:
        while total_tokens < num_samples * seq + extra:
            epochs, total_tokens = epochs + 1, total_tokens + tokens
    separate = False
    if epochs > 1:
        sans = ((epochs - 1) * tokens - extra) // seq
        per_epoch = (tokens - extra) // seq
        separate = num_samples - sans < int(0.80 * per_epoch)
    rs = np.random.RandomState(seed)

    def doc_index(n_epochs):
        grid = np.mgrid[0:n_epochs, 0 : len(indices)][1]
        grid[:] = indices
        flat = grid.reshape(-1).astype(np.int32)
        rs.shuffle(flat)
        return flat

    doc = np.concatenate([doc_index(epochs - 1), doc_index(1)]) if separate else doc_index(epochs)
    sample = ref_sample_idx(sizes, doc, seq, epochs, tokens, drop_last, extra)
    total = len(sample) - 1
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first_n = sans if separate else total
    shuffle = np.arange(0, first_n, dtype=dtype)
    rs.shuffle(shuffle)
    if first_n != total:
        last = np.arange(first_n, total, dtype=dtype)
        rs.shuffle(last)
        shuffle = np.concatenate([shuffle, last])
    return doc, sample, shuffle


def ref_nanotron(sizes, lo, hi, seq, seed, num_samples):
    rs = np.random.RandomState(seed)
    doc = np.arange(lo, hi, dtype=np.int32)
    rs.shuffle(doc)
    tokens = int(np.sum(np.asarray(sizes)[lo:hi]))
    if tokens == 0 or seq <= 1:
        raise RefAbort("empty")
    sample = ref_sample_idx(sizes, doc, seq, 1, tokens, True, 1)
    per_epoch = len(sample) - 1
    shuffle = np.arange(0, per_epoch, dtype=np.uint32)
    rs.shuffle(shuffle)
    if num_samples is not None:
        if per_epoch == 0:
            raise RefAbort("ZeroDivisionError")
        shuffle = np.concatenate([shuffle] * (int(num_samples / per_epoch) + 1))
    return doc, sample, shuffle


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


# -- FORMATS §9.2 split ranges ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "n", "megatron", "nanotron"),
    [
        ("15,15,70", 10, [(0, 2), (2, 3), (3, 10)], [(0, 1), (1, 3), (3, 10)]),
        ("1,1,1", 10, [(0, 3), (3, 7), (7, 10)], [(0, 4), (4, 7), (7, 10)]),
        ("949,50,1", 1000, [(0, 949), (949, 999), (999, 1000)], None),
        ("90,5,5", 21, [(0, 19), (19, 20), (20, 21)], None),
        ("98,2,0", 7, [(0, 7), (7, 7), None], [(0, 7), (7, 7), None]),
    ],
)
def test_split_range_vectors(spec, n, megatron, nanotron):
    assert split_ranges(spec, n, "megatron") == megatron
    assert split_ranges(spec, n, "nanotron") == (nanotron or megatron)


def test_split_parsing_matches_megatron():
    assert parse_split("949,50,1") == [0.949, 0.05, 0.001]
    assert parse_split("99,1") == [0.99, 0.01, 0.0]
    assert split_ranges("99 / 1 / 0", 100, "megatron") == [(0, 99), (99, 100), None]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("-1,2,3", "must not be negative"),
        ("1,2,3,4", "at most 3 weights"),
        ("0,0,0", "positive, finite sum"),
        ("", "positive, finite sum"),
        ("1.2.3,1", "could not convert"),
    ],
)
def test_bad_split_strings_are_rejected(spec, message):
    with pytest.raises(ConfigError, match=message):
        split_ranges(spec, 10, "megatron")


# -- FORMATS §9.3 index vectors -----------------------------------------------------------------
@pytest.mark.parametrize("semantics", ["megatron", "nanotron"])
def test_one_epoch_vector(semantics):
    doc, sample, shuffle = build_nanoset_indices(
        LENGTHS, (0, 4), sequence_length=4, seed=42, num_samples=None, semantics=semantics
    )
    assert doc.tolist() == [1, 3, 0, 2] and doc.dtype == np.int32
    assert sample.tolist() == [[0, 0], [1, 1], [2, 1], [3, 0], [3, 4]]
    assert sample.dtype == np.int32
    assert shuffle.tolist() == [1, 3, 0, 2] and shuffle.dtype == np.uint32


@pytest.mark.parametrize(("num_samples", "copies"), [(4, 2), (10, 3)])
def test_nanotron_tiles_the_shuffle_index(num_samples, copies):
    doc, sample, shuffle = build_nanoset_indices(
        LENGTHS, (0, 4), sequence_length=4, seed=42, num_samples=num_samples, semantics="nanotron"
    )
    assert doc.tolist() == [1, 3, 0, 2]
    assert sample.tolist() == [[0, 0], [1, 1], [2, 1], [3, 0], [3, 4]]
    assert shuffle.tolist() == [1, 3, 0, 2] * copies and shuffle.dtype == np.uint32


def test_megatron_two_epochs_joint_shuffle():
    doc, sample, shuffle = build_nanoset_indices(
        LENGTHS, (0, 4), sequence_length=4, seed=42, num_samples=8
    )
    assert doc.tolist() == [1, 1, 0, 3, 2, 0, 3, 2]
    assert sample.tolist() == [
        [0, 0], [1, 1], [2, 2], [3, 1], [4, 1], [4, 5], [5, 2], [6, 1], [7, 1], [7, 5]
    ]  # fmt: skip
    assert shuffle.tolist() == [4, 7, 0, 3, 5, 8, 2, 1, 6]


def test_megatron_separate_final_epoch():
    doc, sample, shuffle = build_nanoset_indices(
        LENGTHS, (0, 4), sequence_length=4, seed=42, num_samples=10
    )
    assert doc.tolist() == [1, 1, 0, 3, 2, 0, 3, 2, 3, 0, 1, 2]
    assert sample[-5:].tolist() == [[8, 2], [9, 2], [10, 1], [11, 2], [11, 6]]
    assert shuffle.tolist() == [0, 1, 8, 5, 3, 4, 7, 2, 6, 9, 11, 12, 10, 13]
    tokens = _stream_tokens(LENGTHS, doc)
    assert _sample(tokens, sample, shuffle, 0, 1).tolist() == [200, 201, 202, 200, 201]
    assert _sample(tokens, sample, shuffle, 2, 1).tolist() == [301, 302, 303, 304, 305]


def test_valid_keeps_the_last_partial_sample():
    doc, sample, shuffle = build_nanoset_indices(
        LENGTHS, (0, 4), sequence_length=4, seed=1234, num_samples=None, drop_last_partial=False
    )
    assert doc.tolist() == [0, 1, 2, 3]
    assert sample.tolist() == [[0, 0], [0, 4], [2, 0], [2, 4], [3, 1], [3, 3]]
    assert shuffle.tolist() == [2, 1, 3, 0, 4]
    last = _sample(_stream_tokens(LENGTHS, doc), sample, np.arange(5), 4, 1)
    assert last.tolist() == [401, 402, 403]  # the loader pads it to S + 1


def test_without_extra_token():
    _, sample, shuffle = build_nanoset_indices(
        LENGTHS, (0, 4), sequence_length=4, seed=1234, num_samples=None, add_extra_token=False
    )
    assert sample.tolist() == [[0, 0], [0, 4], [1, 3], [2, 4], [3, 1]]
    assert shuffle.tolist() == [1, 2, 3, 0]


def test_each_split_restarts_the_random_state():
    lengths = [5, 3, 7, 4, 6, 9]
    _, sample, shuffle = build_nanoset_indices(
        lengths, (4, 5), sequence_length=4, seed=42, num_samples=None
    )
    assert sample.tolist() == [[0, 0], [0, 4]] and shuffle.tolist() == [0]
    _, sample, shuffle = build_nanoset_indices(
        lengths, (5, 6), sequence_length=4, seed=42, num_samples=None
    )
    assert sample.tolist() == [[0, 0], [0, 4], [0, 8]] and shuffle.tolist() == [1, 0]


# -- oracle comparisons ------------------------------------------------------------------------
lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=lengths_st,
    data=st.data(),
    seq=st.integers(2, 17),
    seed=st.integers(0, 2**32 - 1),
    num_samples=st.none() | st.integers(0, 150),
    extra=st.booleans(),
    drop_last=st.booleans(),
)
def test_megatron_matches_the_reference(lengths, data, seq, seed, num_samples, extra, drop_last):
    lo = data.draw(st.integers(0, len(lengths) - 1))
    hi = data.draw(st.integers(lo + 1, len(lengths)))
    try:
        want = ref_megatron(lengths, lo, hi, seq, seed, num_samples, int(extra), drop_last)
    except RefAbort:
        with pytest.raises(ConfigError):
            build_nanoset_indices(
                lengths, (lo, hi), sequence_length=seq, seed=seed, num_samples=num_samples,
                add_extra_token=extra, drop_last_partial=drop_last,
            )  # fmt: skip
        return
    got = build_nanoset_indices(
        lengths, (lo, hi), sequence_length=seq, seed=seed, num_samples=num_samples,
        add_extra_token=extra, drop_last_partial=drop_last,
    )  # fmt: skip
    assert_same(got, want)


@settings(max_examples=200, deadline=None)
@given(
    lengths=lengths_st,
    seq=st.integers(2, 17),
    seed=st.integers(0, 2**32 - 1),
    num_samples=st.none() | st.integers(0, 150),
)
def test_nanotron_matches_the_reference(lengths, seq, seed, num_samples):
    try:
        want = ref_nanotron(lengths, 0, len(lengths), seq, seed, num_samples)
    except RefAbort:
        with pytest.raises(ConfigError):
            build_nanoset_indices(
                lengths, (0, len(lengths)), sequence_length=seq, seed=seed,
                num_samples=num_samples, semantics="nanotron",
            )  # fmt: skip
        return
    got = build_nanoset_indices(
        lengths, (0, len(lengths)), sequence_length=seq, seed=seed, num_samples=num_samples,
        semantics="nanotron",
    )  # fmt: skip
    assert_same(got, want)


def test_a_larger_multi_epoch_index_matches_the_reference():
    rng = np.random.default_rng(7)
    lengths = np.maximum(0, rng.lognormal(3.0, 1.0, size=3000)).astype(np.int32)
    for num_samples in (5000, 9000, 13000):  # joint and separate final epochs
        got = build_nanoset_indices(
            lengths, (100, 2900), sequence_length=64, seed=99, num_samples=num_samples
        )
        assert_same(got, ref_megatron(lengths, 100, 2900, 64, 99, num_samples))


# -- properties --------------------------------------------------------------------------------
def _stream_tokens(lengths, doc):
    """Token ``100·(seq+1) + position`` of every sequence, in document_index order."""
    return [np.arange(n, dtype=np.int64) + 100 * (int(s) + 1) for s, n in
            ((s, lengths[s]) for s in doc)]  # fmt: skip


def _sample(parts, sample, shuffle, k, extra):
    """FORMATS §5.5: tokens of sample ``k`` (no padding)."""
    j = int(shuffle[k])
    (b, bo), (e, eo) = sample[j], sample[j + 1]
    if b == e:
        return parts[b][bo : eo + extra]
    pieces = [parts[b][bo:], *parts[b + 1 : e], parts[e][: eo + extra]]
    return np.concatenate(pieces)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=20),
    seq=st.integers(2, 12),
    seed=st.integers(0, 1000),
    num_samples=st.none() | st.integers(0, 60),
    semantics=st.sampled_from(["megatron", "nanotron"]),
)
def test_samples_tile_the_shuffled_stream(lengths, seq, seed, num_samples, semantics):
    if sum(lengths) < 2 or (semantics == "nanotron" and num_samples is not None
                            and sum(lengths) <= seq):  # fmt: skip
        return
    doc, sample, shuffle = build_nanoset_indices(
        lengths, (0, len(lengths)), sequence_length=seq, seed=seed, num_samples=num_samples,
        semantics=semantics,
    )  # fmt: skip
    parts = _stream_tokens(lengths, doc)
    stream = np.concatenate(parts)
    num = len(sample) - 1
    assert sorted(set(shuffle.tolist())) == list(range(num))
    assert len(shuffle) >= (num_samples or 0)
    for k in range(len(shuffle)):
        j = int(shuffle[k])
        tokens = _sample(parts, sample, shuffle, k, 1)
        assert len(tokens) == seq + 1
        np.testing.assert_array_equal(tokens, stream[j * seq : j * seq + seq + 1])


# -- dtypes, counts, rejections ----------------------------------------------------------------
def test_dtype_rules():
    assert sample_index_dtype(2**31 - 1, 100) == np.int32
    assert sample_index_dtype(2**31, 100) == np.int64
    assert shuffle_index_dtype(2**32 - 3, "megatron") == np.uint32
    assert shuffle_index_dtype(2**32 - 2, "megatron") == np.int64
    assert shuffle_index_dtype(2**32 - 2, "nanotron") == np.uint32


def test_partial_sample_count_is_single_precision():
    # 2**24 + 1 rounds to 2**24 in float32: helpers.cpp counts one sample fewer than exact ceil
    assert count_samples(2**24 + 2, 2, 1, drop_last=False) == 2**23
    assert count_samples(2**25 + 7, 2, 1, drop_last=False) == 2**24 + 4  # exact: 2**24 + 3
    assert count_samples(19, 4, 1, drop_last=False) == 5
    assert count_samples(19, 4, 1, drop_last=True) == 4


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=20),
    epochs=st.integers(1, 3),
    seq=st.integers(2, 12),
    seed=st.integers(0, 1000),
    extra=st.integers(0, 1),
    drop_last=st.booleans(),
    engine=st.sampled_from(SAMPLE_ENGINES),
)
def test_sample_index_engines_match_the_loop(lengths, epochs, seq, seed, extra, drop_last, engine):
    sizes = np.array(lengths, dtype=np.int32)
    doc = np.tile(np.arange(len(lengths), dtype=np.int32), epochs)
    np.random.RandomState(seed).shuffle(doc)
    tokens = int(sizes.sum())
    if tokens < 2:
        return
    args = {"sequence_length": seq, "total_tokens": epochs * tokens, "drop_last": drop_last,
            "extra": extra, "engine": engine}  # fmt: skip
    try:
        want = ref_sample_idx(sizes, doc, seq, epochs, tokens, drop_last, extra)
    except RefAbort:
        with pytest.raises(ConfigError):
            build_sample_index(sizes, doc, **args)
        return
    got = build_sample_index(sizes, doc, **args)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("engine", SAMPLE_ENGINES)
def test_an_end_of_data_row_before_the_last_sample_is_rejected(monkeypatch, engine):
    monkeypatch.setattr(_sample_index, "count_samples", lambda *args: 6)
    with pytest.raises(ConfigError, match="sample 5 of 6 runs past the end of the data"):
        build_sample_index(
            np.array(LENGTHS, dtype=np.int32), np.arange(4, dtype=np.int32),
            sequence_length=4, total_tokens=19, drop_last=False, extra=1, engine=engine,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sequence_length": 1}, "sequence_length must be >= 2"),
        ({"sequence_length": 0}, "sequence_length must be >= 2"),
        ({"seed": -1}, r"seed must be in \[0, 4294967295\]"),
        ({"seed": 2**32}, r"seed must be in \[0, 4294967295\]"),
        ({"num_samples": -5}, "num_samples must be >= 0"),
        ({"split_range": (2, 2)}, r"split_range \[2, 2\) must be non-empty"),
        ({"split_range": (0, 9)}, "within the 4 sequences"),
        ({"semantics": "fairseq"}, "semantics must be one of"),
        ({"semantics": "nanotron", "add_extra_token": False}, "must be True"),
        ({"semantics": "nanotron", "num_samples": 3, "sequence_length": 30}, "no training sample"),
        ({"sequence_lengths": [0, 1, 0, 0]}, "holds 1 token"),
        ({"sequence_lengths": [3, -1, 2, 2]}, "negative length"),
    ],
)
def test_rejected_inputs_name_the_setting(kwargs, message):
    args = {
        "sequence_lengths": LENGTHS, "split_range": (0, 4), "sequence_length": 4, "seed": 1,
        "num_samples": None,
    } | kwargs  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        build_nanoset_indices(args.pop("sequence_lengths"), args.pop("split_range"), **args)


def test_nanotron_rejects_an_empty_valid_range():
    ranges = split_ranges("98,2,0", 7, "nanotron")
    with pytest.raises(ConfigError, match="must be non-empty"):
        build_nanoset_indices(
            [3] * 7, ranges[1], sequence_length=2, seed=1, num_samples=None, semantics="nanotron"
        )
