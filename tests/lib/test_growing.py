"""Growing index semantics (tokenmill.indices.growing): stable identity splits, prefix-stable
packing and era shuffling, so a version that only appends shards extends the previous one
sample for sample (compared on the assembled tokens, through the loader)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_pairs import index_of, random_dataset

from tokenmill.cli import main
from tokenmill.errors import ConfigError
from tokenmill.formats.dataset_manifest import dataset_manifest_path, write_dataset_manifest
from tokenmill.formats.indexed import IndexedDataset, IndexedDatasetWriter
from tokenmill.indices import growing
from tokenmill.indices._nanoset_indices import SPLITS
from tokenmill.indices.nanoset import entry_key
from tokenmill.indices.settings import NanosetSettings
from tokenmill.loader._datasets import NanosetDataset

SPEC = "80,10,10"


def _shards(seed: int, count: int) -> list[tuple[str, np.ndarray]]:
    """``count`` shards (A, B, …) of random one-sequence documents: (key, lengths)."""
    rng = np.random.default_rng(seed)
    return [
        (f"shard-{chr(65 + i)}", rng.integers(1, 90, size=int(rng.integers(20, 120))))
        for i in range(count)
    ]


def _merged(tmp: Path, name: str, shards: list[tuple[str, np.ndarray]]) -> IndexedDataset:
    """The shards' documents in merge order as one pair (tokens: deterministic per document)."""
    with IndexedDatasetWriter(tmp / name, np.uint16) as writer:
        for key, lengths in shards:
            rng = np.random.default_rng(zlib.crc32(key.encode()))
            writer.add_documents(rng.integers(0, 60000, size=int(lengths.sum())), lengths)
    return IndexedDataset(tmp / name)


def _table(shards: list[tuple[str, np.ndarray]]) -> list[tuple[str, int]]:
    return [(key, len(lengths)) for key, lengths in shards]


def _open(data: IndexedDataset, shards, split: str, **kw) -> NanosetDataset:  # type: ignore[no-untyped-def]
    kw = {"split_spec": SPEC, "sequence_length": 16, "seed": 7, "num_samples": None, **kw}
    doc, sample, shuffle, _ = growing.build_growing_indices(
        data.sequence_lengths, _table(shards), split, era_samples=8, **kw
    )
    return NanosetDataset(data, doc, sample, shuffle, sequence_length=kw["sequence_length"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_appending_shards_extends_every_split(tmp_path: Path, seed: int) -> None:
    """v1 = shards A..J, v2 = A..L: sample i of every split is the same tokens for i < len(v1)."""
    shards = _shards(seed, 12)
    v1, v2 = _merged(tmp_path, "v1", shards[:10]), _merged(tmp_path, "v2", shards)
    grew = 0
    for split in SPLITS:
        old, new = _open(v1, shards[:10], split), _open(v2, shards, split)
        assert len(old) > 0 and len(new) >= len(old)
        grew += len(new) - len(old)
        ids = np.arange(len(old))
        np.testing.assert_array_equal(new.get_batch(ids), old.get_batch(ids))
    assert grew > 0


def test_splits_are_stable_disjoint_and_near_the_fractions() -> None:
    shards = _shards(3, 12)
    before = growing.document_splits(_table(shards[:10]), SPEC, 7)
    after = growing.document_splits(_table(shards), SPEC, 7)
    np.testing.assert_array_equal(after[: len(before)], before)  # no document changes split
    ids = {s: set(growing.split_documents(_table(shards), SPEC, 7, s).tolist()) for s in SPLITS}
    assert not ids["train"] & (ids["valid"] | ids["test"]) and not ids["valid"] & ids["test"]
    assert sum(map(len, ids.values())) == len(after)
    shares = np.bincount(after, minlength=3) / len(after)
    np.testing.assert_allclose(shares, [0.8, 0.1, 0.1], atol=0.03)


def test_split_depends_on_identity_not_position() -> None:
    """A shard's documents keep their splits wherever the shard sits and whatever surrounds it;
    another key or seed gives another assignment."""
    table = [("a", 500), ("b", 700), ("c", 300)]
    alone = growing.document_splits([("b", 700)], SPEC, 7)
    np.testing.assert_array_equal(growing.document_splits(table, SPEC, 7)[500:1200], alone)
    moved = growing.document_splits([("c", 300), ("b", 700)], SPEC, 7)
    np.testing.assert_array_equal(moved[300:], alone)
    assert not np.array_equal(growing.document_splits([("z", 700)], SPEC, 7), alone)
    assert not np.array_equal(growing.document_splits([("b", 700)], SPEC, 8), alone)


def test_zero_weight_split_gets_no_document() -> None:
    splits = growing.document_splits([("a", 20000)], "90,10,0", 1)
    assert set(np.unique(splits).tolist()) == {0, 1}
    assert set(np.unique(growing.document_splits([("a", 20000)], "1,0,0", 1))) == {0}


def test_eras_partial_tail_held_back_and_cap(tmp_path: Path) -> None:
    """Only whole eras are emitted; each era is a permutation of its own samples; the cap cuts
    the order without changing it."""
    shards = _shards(4, 10)
    sizes = np.concatenate([lengths for _, lengths in shards])
    kw = {"split_spec": SPEC, "sequence_length": 16, "seed": 7, "era_samples": 8}
    _, sample, shuffle, plan = growing.build_growing_indices(
        sizes, _table(shards), "train", num_samples=None, **kw
    )
    assert plan.emitted == plan.available // 8 * 8 and plan.available - plan.emitted < 8
    assert len(shuffle) == plan.emitted and len(sample) == plan.emitted + 1
    eras = shuffle.astype(np.int64).reshape(-1, 8)
    np.testing.assert_array_equal(np.sort(eras, axis=1), np.arange(plan.emitted).reshape(-1, 8))
    assert not np.array_equal(eras, np.arange(plan.emitted).reshape(-1, 8))  # shuffled
    capped = growing.build_growing_indices(sizes, _table(shards), "train", num_samples=13, **kw)
    np.testing.assert_array_equal(capped[2], shuffle[:13])
    assert capped[3].num_samples == 13 and capped[3].counts()["num_samples"] == 13


def test_valid_and_test_keep_merge_order_and_hold_back_nothing() -> None:
    """Held-out splits are not shuffled (an era of 1): every whole sample is emitted, in order,
    whatever era_samples says; the key records the effective era."""
    shards = _shards(6, 4)
    sizes = np.concatenate([lengths for _, lengths in shards])
    for split in ("valid", "test"):
        _, sample, shuffle, plan = growing.build_growing_indices(
            sizes, _table(shards), split, split_spec=SPEC, sequence_length=16, seed=7,
            num_samples=None, era_samples=1000,
        )  # fmt: skip
        assert plan.emitted == plan.available > 0 and len(sample) == plan.available + 1
        np.testing.assert_array_equal(shuffle, np.arange(plan.available))
    found = entry_key(
        sizes.size,
        "h",
        "valid",
        NanosetSettings(sequence_length=16, semantics="growing", era_samples=1000),
        shards=_table(shards),
    )
    assert found is not None and found[0]["era_samples"] == 1


def test_packing_matches_megatron_over_the_unshuffled_split() -> None:
    """The sample index is Megatron's over the split's documents in merge order (one epoch)."""
    from tokenmill.indices._sample_index import build_sample_index

    shards = _shards(5, 6)
    sizes = np.concatenate([lengths for _, lengths in shards]).astype(np.int32)
    doc, sample, _, plan = growing.build_growing_indices(
        sizes, _table(shards), "train", split_spec=SPEC, sequence_length=16, seed=7,
        num_samples=None, era_samples=4,
    )  # fmt: skip
    full = build_sample_index(
        sizes, doc, sequence_length=16, total_tokens=plan.tokens, drop_last=True, extra=1
    )
    np.testing.assert_array_equal(sample, full[: plan.emitted + 1])
    assert doc.dtype == np.int32 and np.all(np.diff(doc) > 0)


def test_empty_split_has_no_samples() -> None:
    _, sample, shuffle, plan = growing.build_growing_indices(
        np.array([3, 4], dtype=np.int32), [("a", 2)], "valid", split_spec=SPEC,
        sequence_length=16, seed=7, num_samples=None,
    )  # fmt: skip
    assert len(shuffle) == 0 and sample.shape == (1, 2) and plan.num_samples == 0


def test_shard_table_from_manifest_and_plain_pair(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "plain", np.uint16) as writer:
        writer.add_documents(np.arange(10), np.array([3, 7]))
    assert growing.shard_table(tmp_path / "plain") == [("plain", 2)]
    write_dataset_manifest(
        tmp_path / "plain", kind="tokens", inputs=[], config={},
        counts={"documents": 2, "sequences": 2, "tokens": 10},
    )  # fmt: skip
    assert growing.shard_table(tmp_path / "plain") == [("plain", 2)]
    manifest = {"prefix": "m", "shards": [
        {"key": "a", "content_hash": "x", "documents": 4, "sequences": 4},
        {"key": "b", "content_hash": "y", "documents": 1, "sequences": 1},
    ]}  # fmt: skip
    assert growing.shard_table(manifest) == [("a", 4), ("b", 1)]
    manifest["shards"][1]["sequences"] = 2
    with pytest.raises(ConfigError, match="one sequence per document"):
        growing.shard_table(manifest)


def test_sequence_count_must_match_the_table() -> None:
    with pytest.raises(ConfigError, match="one sequence per document"):
        growing.build_growing_indices(
            np.array([3, 4, 5], dtype=np.int32), [("a", 2)], "train", split_spec=SPEC,
            sequence_length=4, seed=1, num_samples=None,
        )  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=12),
    seq=st.integers(2, 9),
    era=st.integers(1, 6),
    cut=st.integers(1, 11),
)
def test_prefix_property_on_index_arrays(sizes: list[int], seq: int, era: int, cut: int) -> None:
    """For random shard sizes and any cut, v_cut's arrays are a prefix of v_all's (row values of
    the sample index, the emitted order of the shuffle index)."""
    rng = np.random.default_rng(sum(sizes) + seq)
    table = [(f"s{i}", n) for i, n in enumerate(sizes)]
    cut = min(cut, len(table))
    lengths = rng.integers(1, 20, size=sum(sizes)).astype(np.int32)
    for split in SPLITS:
        kw = {"split_spec": SPEC, "sequence_length": seq, "seed": 3, "num_samples": None}
        old = growing.build_growing_indices(
            lengths[: sum(sizes[:cut])], table[:cut], split, era_samples=era, **kw
        )
        new = growing.build_growing_indices(lengths, table, split, era_samples=era, **kw)
        n = len(old[2])
        np.testing.assert_array_equal(new[0][: len(old[0])], old[0])
        np.testing.assert_array_equal(new[1][: len(old[1])], old[1])
        np.testing.assert_array_equal(new[2][:n], old[2])


# -- the Nanoset cache and the CLI ---------------------------------------------------------------
def _sharded(prefix: Path, sizes: list[int], seed: int = 0) -> Path:
    """A merged pair of ``sum(sizes)`` documents whose manifest lists its shards (as a virtual
    merge records them)."""
    random_dataset(prefix, sum(sizes), seed, counted=True, lengths=(5, 40))
    path = dataset_manifest_path(prefix)
    manifest = json.loads(path.read_text())
    manifest["shards"] = [
        {"key": f"k{i}", "content_hash": f"h{i}", "documents": n, "sequences": n}
        for i, n in enumerate(sizes)
    ]
    path.write_text(json.dumps(manifest))
    return prefix


def test_cache_entry_of_growing_semantics(tmp_path: Path) -> None:
    prefix = _sharded(tmp_path / "m", [60, 80, 40])
    settings = {"sequence_length": 8, "seed": 3, "split_spec": SPEC, "semantics": "growing"}
    index = index_of(prefix, tmp_path / "cache", split="train", era_samples=4, **settings)
    assert index is not None
    expected = growing.build_growing_indices(
        IndexedDataset(prefix).sequence_lengths, growing.shard_table(prefix), "train",
        split_spec=SPEC, sequence_length=8, seed=3, num_samples=None, era_samples=4,
    )  # fmt: skip
    for got, want in zip(
        (index.document_index, index.sample_index, index.shuffle_index), expected, strict=False
    ):
        np.testing.assert_array_equal(got, want)
    key = index.description["key"]
    assert key["split_range"] is None and key["era_samples"] == 4
    assert key["shard_table_sha256"] == growing.shard_table_hash(growing.shard_table(prefix))
    assert index.description["counts"]["num_samples"] == len(index) > 0
    # the era size and the shard table are part of the key: never a wrong hit
    other_era = index_of(prefix, tmp_path / "cache", split="train", era_samples=8, **settings)
    assert other_era is not None and other_era.cache_hash != index.cache_hash
    table = growing.shard_table(prefix)
    renamed = [(f"x{key}", n) for key, n in table]
    values = NanosetSettings(era_samples=4, **settings)
    found = entry_key(180, "same", "train", values, shards=renamed)
    same = entry_key(180, "same", "train", values, shards=table)
    assert found is not None and same is not None and found[1] != same[1]


def test_reference_cache_keys_do_not_change() -> None:
    """megatron/nanotron keys carry no growing field, whatever era_samples is passed."""
    for semantics in ("megatron", "nanotron"):
        a = entry_key(100, "h", "train", NanosetSettings(sequence_length=8, semantics=semantics))
        b = entry_key(
            100,
            "h",
            "train",
            NanosetSettings(sequence_length=8, semantics=semantics, era_samples=3),
        )
        assert a == b and a is not None
        assert "era_samples" not in a[0] and "shard_table_sha256" not in a[0]


def test_growing_refuses_partial_samples_and_mismatched_tables(tmp_path: Path) -> None:
    values = NanosetSettings(sequence_length=8, semantics="growing")
    keep = NanosetSettings(
        sequence_length=8, semantics="growing", drop_last_partial_validation=False
    )
    with pytest.raises(ConfigError, match="drop_last_partial_validation must be true"):
        entry_key(10, "h", "valid", keep, shards=[("a", 10)])
    with pytest.raises(ConfigError, match="one sequence per document"):
        entry_key(11, "h", "valid", values, shards=[("a", 10)])
    with pytest.raises(ConfigError, match="shard table"):
        entry_key(10, "h", "valid", values)
    only_train = NanosetSettings(sequence_length=8, semantics="growing", split_spec="1,0,0")
    assert entry_key(10, "h", "valid", only_train, shards=[("a", 10)]) is None


def test_cli_index_growing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = _sharded(tmp_path / "m", [300, 200])
    argv = ["index", "--dataset", str(prefix), "--cache-dir", str(tmp_path / "c")]
    argv += ["--sequence-length", "8", "--split", SPEC, "--semantics", "growing"]
    assert main([*argv, "--era-samples", "16"]) == 0
    out = capsys.readouterr().out
    assert "held back until the era fills" in out and "train:" in out
