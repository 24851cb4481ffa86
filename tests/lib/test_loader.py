"""The numpy loader: FORMATS §9.3 samples, get_batch == stacked __getitem__, safety, isolation."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, reject, settings
from hypothesis import strategies as st

from tokenmill.atomic import file_sha256
from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDataset, IndexedDatasetWriter
from tokenmill.indices.nanoset import NanosetIndex, build_nanoset_indices, build_or_load
from tokenmill.indices.settings import NanosetSettings
from tokenmill.loader import BlendedDataset, NanosetDataset, open_nanoset

LENGTHS = [5, 3, 7, 4]


def write_dataset(prefix: Path, lengths: list[int], dtype: type = np.uint16) -> IndexedDataset:
    """Sequence ``s`` holds ``100·(s+1) + position`` (FORMATS §9.3): readable, distinct tokens."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for s, n in enumerate(lengths):
            writer.add_document(np.arange(n) + 100 * (s + 1), [n] if n else [])
    return IndexedDataset(prefix)


def random_dataset(prefix: Path, lengths: np.ndarray, seed: int, dtype: type) -> IndexedDataset:
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, dtype) as writer:
        writer.add_documents(rng.integers(0, 30000, int(lengths.sum())), lengths)
    return IndexedDataset(prefix)


def train_cache(prefix: Path, tmp_path: Path) -> NanosetIndex:
    """The cache entry of the whole of ``prefix`` as a train split (4-token samples, seed 42),
    built under ``tmp_path/cache``."""
    built = build_or_load(
        prefix,
        tmp_path / "cache",
        "train",
        NanosetSettings(split_spec="1,0,0", sequence_length=4, seed=42),
    )
    assert built is not None
    return built


@pytest.fixture
def four(tmp_path: Path) -> IndexedDataset:
    return write_dataset(tmp_path / "four_text_document", LENGTHS)


def nanoset(
    data: IndexedDataset, doc: list[int], sample: list[list[int]], shuffle: list[int], **kw: object
) -> NanosetDataset:
    return NanosetDataset(
        data,
        np.array(doc, np.int32),
        np.array(sample, np.int32),
        np.array(shuffle, np.uint32),
        sequence_length=4,
        **kw,
    )  # type: ignore[arg-type]


def test_vector_a_one_epoch_seed_42(four: IndexedDataset) -> None:
    ds = nanoset(four, [1, 3, 0, 2], [[0, 0], [1, 1], [2, 1], [3, 0], [3, 4]], [1, 3, 0, 2])
    assert len(ds) == 4
    expected = [[401, 402, 403, 100, 101], [300, 301, 302, 303, 304], [200, 201, 202, 400, 401]]
    assert [ds[k].tolist() for k in range(3)] == expected
    assert ds[0].dtype == np.int64
    assert ds.get_batch([0, 1, 2]).tolist() == expected


def test_vector_c_separate_final_epoch(four: IndexedDataset) -> None:
    sample = [
        [0, 0],
        [1, 1],
        [2, 2],
        [3, 1],
        [4, 1],
        [4, 5],
        [5, 2],
        [6, 1],
        [7, 1],
        [7, 5],
        [8, 2],
        [9, 2],
        [10, 1],
        [11, 2],
        [11, 6],
    ]
    shuffle = [0, 1, 8, 5, 3, 4, 7, 2, 6, 9, 11, 12, 10, 13]
    ds = nanoset(four, [1, 1, 0, 3, 2, 0, 3, 2, 3, 0, 1, 2], sample, shuffle)
    assert [ds[k].tolist() for k in range(3)] == [
        [200, 201, 202, 200, 201],
        [201, 202, 100, 101, 102],
        [301, 302, 303, 304, 305],
    ]
    assert np.array_equal(ds.get_batch(range(14)), np.stack([ds[k] for k in range(14)]))


def test_vector_d_partial_valid_sample_is_padded(four: IndexedDataset) -> None:
    ds = nanoset(
        four, [0, 1, 2, 3], [[0, 0], [0, 4], [2, 0], [2, 4], [3, 1], [3, 3]], [2, 1, 3, 0, 4]
    )
    assert ds[4].tolist() == [401, 402, 403, -1, -1]
    batch = ds.get_batch([4, 0, 4])
    assert batch.tolist() == [
        [401, 402, 403, -1, -1],
        [300, 301, 302, 303, 304],
        [401, 402, 403, -1, -1],
    ]


def test_vector_e_without_extra_token(four: IndexedDataset) -> None:
    ds = nanoset(
        four,
        [0, 1, 2, 3],
        [[0, 0], [0, 4], [1, 3], [2, 4], [3, 1]],
        [1, 2, 3, 0],
        add_extra_token=False,
    )
    expected = [
        [104, 200, 201, 202],
        [300, 301, 302, 303],
        [304, 305, 306, 400],
        [100, 101, 102, 103],
    ]
    assert [ds[k].tolist() for k in range(4)] == expected
    assert ds.get_batch(range(4)).tolist() == expected


def test_built_indices_give_the_vector_samples(tmp_path: Path, four: IndexedDataset) -> None:
    arrays = build_nanoset_indices(
        np.array(LENGTHS, np.int32), (0, 4), sequence_length=4, seed=42, num_samples=None
    )
    ds = NanosetDataset(four, *arrays, sequence_length=4)
    assert ds[0].tolist() == [401, 402, 403, 100, 101]
    built = train_cache(four.prefix, tmp_path)
    from_cache = open_nanoset(four.prefix, index=built.paths["description"])
    via_index = open_nanoset(four.prefix, built)
    for other in (from_cache, via_index):
        assert np.array_equal(other.get_batch(range(len(other))), ds.get_batch(range(len(ds))))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=60),
    sequence_length=st.integers(2, 600),
    seed=st.integers(0, 2**31 - 1),
    semantics=st.sampled_from(["megatron", "nanotron"]),
    extra=st.booleans(),
    drop_last=st.booleans(),
    epochs=st.integers(1, 3),
    wide=st.booleans(),
)
def test_get_batch_equals_stacked_getitem(
    lengths: list[int],
    sequence_length: int,
    seed: int,
    semantics: str,
    extra: bool,
    drop_last: bool,
    epochs: int,
    wide: bool,
) -> None:
    lens = np.array(lengths, dtype=np.int64)
    if semantics == "nanotron":
        extra, drop_last = True, True
    assume(int(lens.sum()) - extra >= sequence_length)
    with tempfile.TemporaryDirectory() as tmp:
        data = random_dataset(Path(tmp) / "d", lens, seed, np.int32 if wide else np.uint16)
        per_epoch = (int(lens.sum()) - extra) // sequence_length
        try:
            arrays = build_nanoset_indices(
                data.sequence_lengths,
                (0, len(data)),
                sequence_length=sequence_length,
                seed=seed,
                num_samples=per_epoch * epochs,
                semantics=semantics,
                add_extra_token=extra,
                drop_last_partial=drop_last,
            )
        except ConfigError:  # inputs the reference rejects (e.g. empty last sequence, no drop)
            reject()
        ds = NanosetDataset(data, *arrays, sequence_length=sequence_length, add_extra_token=extra)
        ks = np.random.default_rng(seed).integers(0, len(ds), 37)
        assert np.array_equal(ds.get_batch(ks), np.stack([ds[k] for k in ks]))


def test_get_batch_at_full_size_reads_every_sample(tmp_path: Path) -> None:
    """S = 2048 over a few hundred documents; every sample (and so the file's tail) is read."""
    rng = np.random.default_rng(7)
    lens = np.maximum(1, rng.lognormal(5.5, 1.2, 700).astype(np.int64))
    data = random_dataset(tmp_path / "big", lens, 7, np.uint16)
    arrays = build_nanoset_indices(
        data.sequence_lengths, (0, len(data)), sequence_length=2048, seed=3, num_samples=None
    )
    ds = NanosetDataset(data, *arrays, sequence_length=2048)
    every = np.arange(len(ds))
    assert np.array_equal(ds.get_batch(every), np.stack([ds[k] for k in every]))
    assert ds.get_batch([]).shape == (0, 2049)


def test_blended_dataset_routes_samples(tmp_path: Path, four: IndexedDataset) -> None:
    a = nanoset(four, [1, 3, 0, 2], [[0, 0], [1, 1], [2, 1], [3, 0], [3, 4]], [1, 3, 0, 2])
    other = write_dataset(tmp_path / "other", [9, 9], np.int32)
    rows = [[0, 0], [0, 4], [0, 8], [1, 3], [1, 7]]
    b = NanosetDataset(
        other,
        np.array([0, 1], np.int32),
        np.array(rows, np.int32),
        np.array([2, 0, 1, 3], np.uint32),
        sequence_length=4,
    )
    blend = BlendedDataset(
        {"a": a, "b": b}, np.array([0, 1, 0, 1, 1], np.int16), np.array([0, 0, 1, 1, 2], np.int64)
    )
    expected = [a[0], b[0], a[1], b[1], b[2]]
    assert [blend[i].tolist() for i in range(5)] == [e.tolist() for e in expected]
    assert np.array_equal(
        blend.get_batch([4, 0, 3, 1]), np.stack([expected[i] for i in (4, 0, 3, 1)])
    )
    assert blend.proportions == {"a": 0.4, "b": 0.6}


def test_out_of_range_samples_raise(four: IndexedDataset) -> None:
    ds = nanoset(four, [1, 3, 0, 2], [[0, 0], [1, 1], [2, 1], [3, 0], [3, 4]], [1, 3, 0, 2])
    with pytest.raises(IndexError, match=r"sample 4 out of range \[0, 4\)"):
        ds[4]
    with pytest.raises(IndexError, match="sample -1 out of range"):
        ds.get_batch([0, -1])


@pytest.mark.parametrize(
    ("doc", "sample", "shuffle", "field"),
    [
        ([1, 3, 0, 9], [[0, 0], [3, 4]], [0], "document_index"),
        ([1, 3, 0, 2], [[0, 0], [7, 4]], [0], "sample_index"),
        ([1, 3, 0, 2], [[0, 0], [3, 4]], [1], "shuffle_index"),
        ([1, 3, 0, 2], [[0, -2], [3, 4]], [0], "sample_index"),
    ],
)
def test_out_of_bounds_index_arrays_are_refused(
    four: IndexedDataset, doc: list[int], sample: list[list[int]], shuffle: list[int], field: str
) -> None:
    with pytest.raises(FormatError, match=field):
        nanoset(four, doc, sample, shuffle)


def test_changed_cache_file_is_refused(tmp_path: Path, four: IndexedDataset) -> None:
    built = train_cache(four.prefix, tmp_path)
    np.save(built.paths["shuffle"], np.array([{"evil": 1}, 2], dtype=object), allow_pickle=True)
    with pytest.raises(CacheError, match="the cache entry is stale or damaged: rebuild it"):
        open_nanoset(four.prefix, index=built.paths["description"])


def test_object_array_cache_is_refused_even_with_matching_hash(
    tmp_path: Path, four: IndexedDataset
) -> None:
    built = train_cache(four.prefix, tmp_path)
    path = built.paths["shuffle"]
    np.save(path, np.array([{"evil": 1}, 2], dtype=object), allow_pickle=True)
    description = json.loads(built.paths["description"].read_text())
    description["files"]["shuffle"].update(bytes=path.stat().st_size, sha256=file_sha256(path))
    built.paths["description"].write_text(json.dumps(description))
    with pytest.raises(FormatError, match=r"shuffle_index: unreadable \.npy"):
        open_nanoset(four.prefix, index=built.paths["description"])


def test_index_of_changed_dataset_is_refused(tmp_path: Path) -> None:
    prefix = tmp_path / "ds"
    write_dataset(prefix, LENGTHS)
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={})
    built = train_cache(prefix, tmp_path)
    write_dataset(prefix, [4, 3, 7, 5])
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={})
    with pytest.raises(CacheError, match="the dataset changed; rebuild the index"):
        open_nanoset(prefix, index=built)


def test_description_path_must_be_a_cache_file(tmp_path: Path, four: IndexedDataset) -> None:
    bogus = tmp_path / "x.json"
    bogus.write_text(json.dumps({}))
    with pytest.raises(ValueError, match=r"-description\.json"):
        open_nanoset(four.prefix, index=bogus)


def test_torch_adapter(four: IndexedDataset) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from tokenmill.loader import BatchSampler
    from tokenmill.loader.torch import TokenDataset, collate

    ds = nanoset(four, [1, 3, 0, 2], [[0, 0], [1, 1], [2, 1], [3, 0], [3, 4]], [1, 3, 0, 2])
    wrapped = TokenDataset(ds)
    assert len(wrapped) == 4
    assert torch.equal(wrapped[0], torch.tensor([401, 402, 403, 100, 101]))
    loader = DataLoader(wrapped, batch_sampler=BatchSampler(4, 2), collate_fn=collate)
    batches = list(loader)
    assert len(batches) == 2
    assert batches[0]["input_ids"].tolist() == [[401, 402, 403, 100], [300, 301, 302, 303]]
    assert batches[0]["labels"].tolist() == [[402, 403, 100, 101], [301, 302, 303, 304]]
    assert batches[1]["input_ids"].dtype == torch.int64
    per_sample = collate([wrapped[2], wrapped[3]])
    assert torch.equal(per_sample["labels"], batches[1]["labels"])
