"""The Nanoset index cache: naming and key, reuse, rebuild of partial entries, refusal of
foreign ones, object arrays, N processes starting at once, and the ``tokenmill index`` CLI."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from tiny_pairs import index_of, random_pair

from tokenmill.atomic import TMP_DIR
from tokenmill.cli import main
from tokenmill.errors import CacheError, FormatError
from tokenmill.formats import nanoset_cache as _index_cache
from tokenmill.formats.nanoset_cache import exclusive_lock
from tokenmill.indices import nanoset
from tokenmill.indices.nanoset import (
    build_nanoset_indices,
    build_or_load,
    split_ranges,
    verify_index,
)
from tokenmill.indices.settings import NanosetSettings

NUM_SEQUENCES = 200


def make_dataset(prefix: Path, seed: int = 0) -> Path:
    """``NUM_SEQUENCES`` random documents (no manifest)."""
    return random_pair(prefix, NUM_SEQUENCES, seed, lengths=(1, 60), vocab=50000)


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    return make_dataset(tmp_path / "data" / "corpus_text_document")


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the split of every index computation build_or_load does."""
    calls: list[str] = []
    real = nanoset.compute_indices

    def counting(*args, **kwargs):
        calls.append("build")
        return real(*args, **kwargs)

    monkeypatch.setattr(nanoset, "compute_indices", counting)
    return calls


def test_build_names_files_by_the_key_hash(dataset, tmp_path, builds):
    cache_dir = tmp_path / "cache"
    index = build_or_load(dataset, cache_dir, "train", NanosetSettings(sequence_length=16), 500)
    assert index is not None and builds == ["build"]
    key = index.description["key"]
    assert index.cache_hash == hashlib.md5(json.dumps(key, indent=4).encode()).hexdigest()
    assert list(key) == [
        "class", "format_version", "dataset_content_hash", "semantics", "split", "split_spec",
        "split_range", "sequence_length", "seed", "num_samples", "add_extra_token",
        "drop_last_partial",
    ]  # fmt: skip
    base = f"{index.cache_hash}-Nanoset-train"
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted(
        [f"{base}-{n}_index.npy" for n in ("document", "sample", "shuffle")]
        + [f"{base}-description.json", TMP_DIR]
    )  # no lock file stays
    assert list((cache_dir / TMP_DIR).iterdir()) == []  # nor a temp
    assert {k: p.name for k, p in index.paths.items()}["description"] == f"{base}-description.json"
    lengths = np.load(index.paths["sample"])  # plain .npy files
    assert lengths.dtype == np.int32
    want = build_nanoset_indices(
        _lengths(dataset), split_ranges("949,50,1", NUM_SEQUENCES, "megatron")[0],
        sequence_length=16, seed=1234, num_samples=500,
    )  # fmt: skip
    for got, expected in zip(
        (index.document_index, index.sample_index, index.shuffle_index), want, strict=True
    ):
        assert isinstance(got, np.memmap) and got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)
    assert len(index) == len(want[2]) >= 500
    assert index.description["counts"]["num_samples"] == len(index)


def test_second_call_loads_without_building(dataset, tmp_path, builds):
    first = build_or_load(dataset, tmp_path, "valid", NanosetSettings(sequence_length=8))
    again = build_or_load(dataset, tmp_path, "valid", NanosetSettings(sequence_length=8))
    assert builds == ["build"]
    assert again.cache_hash == first.cache_hash
    np.testing.assert_array_equal(again.shuffle_index, first.shuffle_index)


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 7},
        {"num_samples": 301},
        {"sequence_length": 9},
        {"split_spec": "90,5,5"},
        {"semantics": "nanotron"},
        {"add_extra_token": False},
        {"split": "valid", "drop_last_partial_validation": False},
    ],
)
def test_every_setting_changes_the_hash(dataset, tmp_path, change):
    base = {"split": change.get("split", "train"), "sequence_length": 8, "num_samples": 300}
    first = index_of(dataset, tmp_path, **base)
    other = index_of(dataset, tmp_path, **(base | change))
    assert other.cache_hash != first.cache_hash


def test_new_data_changes_the_hash(tmp_path):
    a = build_or_load(
        make_dataset(tmp_path / "a", seed=1),
        tmp_path / "c",
        "valid",
        NanosetSettings(sequence_length=8),
    )
    b = build_or_load(
        make_dataset(tmp_path / "b", seed=2),
        tmp_path / "c",
        "valid",
        NanosetSettings(sequence_length=8),
    )
    assert a.cache_hash != b.cache_hash


def test_empty_split_is_none(dataset, tmp_path):
    assert (
        build_or_load(
            dataset, tmp_path, "test", NanosetSettings(split_spec="99,1,0", sequence_length=8)
        )
        is None
    )
    assert (
        build_or_load(
            dataset, tmp_path, "valid", NanosetSettings(split_spec="1000,1,0", sequence_length=8)
        )
        is None
    )


@pytest.mark.parametrize("damage", ["no_description", "truncated_array", "missing_array", "object"])
def test_partial_or_damaged_entries_are_rebuilt(dataset, tmp_path, builds, damage):
    index = build_or_load(dataset, tmp_path, "train", NanosetSettings(sequence_length=8))
    good = np.array(index.sample_index)
    paths = index.paths
    del index
    if damage == "no_description":
        paths["description"].unlink()
    elif damage == "truncated_array":
        data = paths["sample"].read_bytes()
        paths["sample"].write_bytes(data[:-8])
    elif damage == "missing_array":
        paths["shuffle"].unlink()
    else:
        np.save(paths["sample"], np.array([{"a": 1}], dtype=object), allow_pickle=True)
    rebuilt = build_or_load(dataset, tmp_path, "train", NanosetSettings(sequence_length=8))
    assert builds == ["build", "build"]
    np.testing.assert_array_equal(rebuilt.sample_index, good)


def test_object_arrays_are_refused(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    record = {"bytes": path.stat().st_size, "dtype": "|O", "shape": [1]}
    with pytest.raises(FormatError, match=r"x\.npy: array: unreadable \.npy"):
        _index_cache.load_array(path, record)


def test_a_foreign_description_is_refused(dataset, tmp_path):
    index = build_or_load(dataset, tmp_path, "train", NanosetSettings(sequence_length=8))
    description = json.loads(index.paths["description"].read_text())
    description["key"]["seed"] = 99
    index.paths["description"].write_text(json.dumps(description))
    with pytest.raises(CacheError, match="remove the entry's files to rebuild"):
        build_or_load(dataset, tmp_path, "train", NanosetSettings(sequence_length=8))


def test_full_verification_detects_a_changed_byte(dataset, tmp_path):
    index = build_or_load(dataset, tmp_path, "train", NanosetSettings(sequence_length=8))
    verify_index(index)
    path = index.paths["document"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="sha256 differs"):
        verify_index(index)


# -- concurrency -------------------------------------------------------------------------------
RANK_TIMEOUT = 300  # seconds: a hung rank fails the test instead of the whole run


def _rank(args: tuple[str, str, multiprocessing.synchronize.Barrier]) -> tuple[int, list[str]]:
    """One "training rank": wait for all, then build_or_load; report builds and array hashes."""
    prefix, cache_dir, barrier = args
    calls = []
    real = nanoset.compute_indices

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    nanoset.compute_indices = counting
    barrier.wait(RANK_TIMEOUT)
    index = build_or_load(prefix, cache_dir, "train", NanosetSettings(sequence_length=8), 4000)
    digests = [
        hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
        for a in (index.document_index, index.sample_index, index.shuffle_index)
    ]
    return len(calls), digests


def test_concurrent_ranks_build_once(dataset, tmp_path):
    # ProcessPoolExecutor, not multiprocessing.Pool: Pool.__exit__ terminates its workers, and
    # that can race its worker-handler thread and hang for ever on a loaded machine.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(4, mp_context=ctx) as pool:
        barrier = manager.Barrier(4)
        args = (str(dataset), str(tmp_path / "c"), barrier)
        futures = [pool.submit(_rank, args) for _ in range(4)]
        results = [f.result(timeout=RANK_TIMEOUT) for f in futures]
    assert sum(n for n, _ in results) == 1
    assert len({tuple(d) for _, d in results}) == 1


# -- CLI ---------------------------------------------------------------------------------------
def test_cli_builds_every_split(dataset, tmp_path, capsys):
    argv = ["index", "--dataset", str(dataset), "--cache-dir", str(tmp_path / "c"),
            "--sequence-length", "8", "--split", "90,10,0", "--train-samples", "1000"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "train: " in out and "valid: " in out and "test: empty split" in out
    assert out.count("description: ") == 2
    assert len(list((tmp_path / "c").glob("*-description.json"))) == 2
    assert main(argv) == 0
    assert capsys.readouterr().out == out


def test_cli_usage_errors_exit_2(dataset, tmp_path, capsys):
    argv = ["index", "--dataset", str(dataset), "--cache-dir", str(tmp_path / "c"),
            "--sequence-length", "8", "--semantics", "nanotron", "--no-extra-token"]  # fmt: skip
    assert main(argv) == 2
    assert "add_extra_token" in capsys.readouterr().err


def _lengths(prefix: Path) -> np.ndarray:
    from tokenmill.formats.indexed import IndexedDataset

    return np.array(IndexedDataset(prefix).sequence_lengths)


def test_lock_file_is_removed_on_release_and_holders_never_overlap(tmp_path):
    """Each holder unlinks the lock file before unlocking; waiters that locked the removed file
    retry on the new one, so no two hold it at once and nothing stays behind."""
    path = tmp_path / "entry.lock"
    inside: list[int] = []
    overlaps: list[list[int]] = []

    def work(i: int) -> None:
        for _ in range(40):
            with exclusive_lock(path):
                inside.append(i)
                if len(inside) > 1:
                    overlaps.append(list(inside))
                time.sleep(0.0005)
                inside.remove(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=RANK_TIMEOUT)
    assert overlaps == [] and inside == []
    assert list(tmp_path.iterdir()) == []
