"""Growing entries that extend their predecessor (tokenmill.indices.growing_segments): only the
new rows are written, the predecessor's files are referenced as segments, and every array read
back equals, value for value and dtype for dtype, the arrays a full build of the same data
makes."""

from __future__ import annotations

import itertools
import json
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_growing_blend import _build as _build_blend
from test_growing_blend import _shards as _blend_shards

from tokenmill.errors import CacheError
from tokenmill.formats.nanoset_cache import SegmentedArray, read_description
from tokenmill.indices import growing_blend, growing_segments
from tokenmill.indices._nanoset_indices import SPLITS
from tokenmill.indices.growing_segments import NPY_HEADER
from tokenmill.indices.nanoset import Entry, IndexInputs, NanosetIndex, cache_entry
from tokenmill.indices.settings import NanosetSettings
from tokenmill.loader import open_blend
from tokenmill.storage.gc import gc
from tokenmill.verify import verify_blend

SETTINGS = NanosetSettings(
    split_spec="80,10,10", sequence_length=16, seed=7, semantics="growing", era_samples=4
)


def _data(seed: int, count: int) -> tuple[list[tuple[str, int]], np.ndarray]:
    """``count`` shards of 20-80 documents of 1-60 tokens: (shard table, lengths)."""
    rng = np.random.default_rng(seed)
    table = [(f"shard-{i:03d}", int(rng.integers(20, 80))) for i in range(count)]
    lengths = rng.integers(1, 60, size=sum(n for _, n in table)).astype(np.int32)
    return table, lengths


def _entry(
    cache: Path,
    table: list[tuple[str, int]],
    lengths: np.ndarray,
    split: str,
    previous: dict[str, Any] | None = None,
    *,
    num_samples: int | None = None,
    masked: np.ndarray | None = None,
    **kw: Any,
) -> Entry:
    """The entry of the first ``sum(table)`` sequences (content hash named by the shard count)."""
    n = sum(d for _, d in table)
    inputs = IndexInputs(lengths[:n], f"content-{len(table)}", table, masked)
    found = cache_entry(
        inputs, cache, split, replace(SETTINGS, **kw), num_samples, previous=previous
    )
    assert found is not None
    return found


def _build(
    cache: Path,
    table: list[tuple[str, int]],
    lengths: np.ndarray,
    split: str,
    previous: NanosetIndex | None = None,
    **kw: Any,
) -> NanosetIndex:
    before = None if previous is None else previous.description
    entry = _entry(cache, table, lengths, split, before, **kw)
    entry.ensure()
    return entry.load()


def _same(a: NanosetIndex, b: NanosetIndex) -> None:
    for name in ("document_index", "sample_index", "shuffle_index"):
        x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name
    assert a.description["counts"] == b.description["counts"]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("seed", [0, 1])
def test_extended_entries_equal_full_builds(tmp_path: Path, split: str, seed: int) -> None:
    """Shards arrive 1-3 at a time for 12 refreshes: each extended entry reads back as the full
    build of the same shards, its own files hold only the new rows, and compaction keeps the
    segments few (each more than twice the next)."""
    table, lengths = _data(seed, 30)
    rng = np.random.default_rng(seed)
    count, index = 4, None
    written_rows, extended = 0, 0
    while count < len(table):
        index = _build(tmp_path / "grown", table[:count], lengths, split, index)
        full = _build(tmp_path / f"full-{count}", table[:count], lengths, split)
        _same(index, full)
        own = np.load(index.paths["document"], mmap_mode="r")
        written_rows += len(own)
        segments = index.description["growth"]["segments"]
        extended += isinstance(index.document_index, SegmentedArray)
        files = index.description["files"]
        sizes = [  # array bytes of each segment (its files less their .npy headers)
            sum(files[f"{a}.{i}"]["bytes"] - NPY_HEADER for a in ("document", "sample", "shuffle"))
            for i in range(len(segments))
        ]
        assert all(x > 2 * y for x, y in itertools.pairwise(sizes))
        count += int(rng.integers(1, 4))
    assert index is not None and extended >= 5
    # each row is rewritten O(log size) times over the growth (compaction), not per refresh
    final = len(index.document_index)
    assert written_rows <= final * (2 + np.log2(final))


def test_extension_writes_only_the_new_rows(tmp_path: Path) -> None:
    """One shard more: the new entry's own document file holds that shard's train documents
    only, its description records the predecessor's files as segment 0, and reading it needs
    them (a missing segment is a CacheError naming the file)."""
    table, lengths = _data(3, 40)
    old = _build(tmp_path, table[:39], lengths, "train")
    new = _build(tmp_path, table, lengths, "train", old)
    own = np.load(new.paths["document"])
    assert len(own) == len(new.document_index) - len(old.document_index)
    assert int(own.min()) >= sum(n for _, n in table[:39])
    files = new.description["files"]
    assert files["document.0"] == old.description["files"]["document"]
    assert new.description["growth"]["segments"][0]["entry"] == old.cache_hash
    Path(old.paths["sample"]).unlink()
    with pytest.raises(CacheError, match=r"sample_index\.npy"):
        _build(tmp_path, table, lengths, "train")


def test_cap_and_changed_settings_build_whole(tmp_path: Path) -> None:
    """A predecessor with other settings (here the era) is not extended; a capped one is, up
    to the cap."""
    table, lengths = _data(4, 20)
    other = _build(tmp_path, table[:19], lengths, "train", era_samples=8)
    whole = _build(tmp_path / "b", table, lengths, "train", other)
    assert whole.description["growth"]["segments"] == []
    capped = _build(tmp_path / "c", table[:19], lengths, "train", num_samples=50)
    grown = _build(tmp_path / "c", table, lengths, "train", capped, num_samples=50)
    _same(grown, _build(tmp_path / "d", table, lengths, "train", num_samples=50))


def test_entry_without_its_segments_can_be_described(tmp_path: Path) -> None:
    """``Entry.ensure`` commits an extension without reading the segments (an S3 step holds
    only the predecessor's description): the description names them, nothing else."""
    table, lengths = _data(5, 12)
    old = _build(tmp_path / "a", table[:11], lengths, "train")
    previous = json.loads(Path(old.paths["description"]).read_text())
    made = _entry(tmp_path / "b", table, lengths, "train", previous)
    made.ensure()
    description = read_description(made.paths["description"])
    assert description is not None and "document.0" in description["files"]
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.suffix == ".npy") == sorted(
        Path(made.paths[a]).name for a in ("document", "sample", "shuffle")
    )


@pytest.mark.parametrize("weighting", [{}, {"temperature": 2.0}])
def test_blends_over_extended_entries_equal_whole_rebuilds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weighting: dict[str, float]
) -> None:
    """Three refreshes of a three-dataset blend (weighted and temperature): with extended
    entries and blend arrays every sample of every split of every version equals, token for
    token, the same builds written whole; the manifests name the segments and a full verify and
    a pickle round trip pass."""
    shards = {
        "docs": _blend_shards(1, 12),
        "code": _blend_shards(2, 12),
        "web": _blend_shards(3, 12),
    }
    grown = [_build_blend(tmp_path / "a", shards, n, f"v{n}", **weighting) for n in (8, 10, 12)]
    parts = [ds for m in grown for info in m["splits"].values() for ds in info["datasets"]]
    assert sum("document.0" in ds["index"]["files"] for ds in parts) >= 9
    splits = [info for m in grown for info in m["splits"].values()]
    assert sum("dataset_index.0" in info["files"] for info in splits) >= 3  # blend arrays too
    monkeypatch.setattr(growing_segments, "plan_extension", lambda *a, **k: None)
    monkeypatch.setattr(growing_blend, "blend_segments", lambda *a, **k: ({}, 0))
    whole = [_build_blend(tmp_path / "b", shards, n, f"v{n}", **weighting) for n in (8, 10, 12)]
    for mine, theirs in zip(grown, whole, strict=True):
        for split in theirs["splits"]:
            a = open_blend(tmp_path / "a/blends/mix", split, version=mine["version"], verify="full")
            b = open_blend(tmp_path / "b/blends/mix", split, version=theirs["version"])
            assert len(a) == len(b) > 0
            ids = np.arange(len(b))
            np.testing.assert_array_equal(a.get_batch(ids), b.get_batch(ids))
            again = pickle.loads(pickle.dumps(a))
            np.testing.assert_array_equal(again.get_batch(ids), b.get_batch(ids))
    assert verify_blend(tmp_path / "a" / "blends" / "mix" / "manifest.json", full=True) == []


def test_gc_keeps_the_segments_of_a_kept_entry(tmp_path: Path) -> None:
    """An entry kept for its dataset's content keeps the earlier entries its segments are;
    unreferenced ones go. Before segments were followed, gc removed the first entry and the
    kept one no longer opened."""
    table, lengths = _data(6, 40)
    cache = tmp_path / "nanoset"
    v1 = _build(cache, table[:30], lengths, "train")
    v2 = _build(cache, table[:35], lengths, "train", v1)
    v3 = _build(cache, table, lengths, "train", v2)
    chain = [s["entry"] for s in v3.description["growth"]["segments"]]
    assert chain and chain[0] == v1.cache_hash
    manifests = tmp_path / "merged" / "manifests"
    manifests.mkdir(parents=True)
    (manifests / "docs_text_document.manifest.json").write_text(
        json.dumps({"content_hash": "content-40"})
    )
    for path in cache.iterdir():
        os.utime(path, (1, 1))
    gc(tmp_path, keep=0)
    left = {p.name.split("-", 1)[0] for p in cache.iterdir() if p.is_file()}
    assert left == {v3.cache_hash, *chain}
    again = _build(cache, table, lengths, "train")
    _same(again, v3)


def test_gc_keeps_the_blend_versions_a_kept_version_reads(tmp_path: Path) -> None:
    """A kept growing blend version reads older versions' blend arrays as segments: gc keeps
    those versions (and removes others), and the kept one still opens in full. Before, gc
    removed every version but the current one and its arrays were gone."""
    shards = {"docs": _blend_shards(1, 14)}
    for n in (8, 9, 10, 11, 12, 13, 14):
        last = _build_blend(tmp_path, shards, n, f"v{n}")
    read = {
        Path(info["files"][key]["path"]).parent.name
        for info in last["splits"].values()
        for key in info["files"]
        if "." in key
    }
    assert read  # older versions' folders
    versions = tmp_path / "blends" / "mix" / "versions"
    for path in versions.rglob("*"):
        os.utime(path, (1, 1))
    gc(tmp_path, keep=1)
    left = {p.name for p in versions.iterdir() if p.name != ".tmp"}
    # kept: the current version, those it reads and (whole versions stay whole) theirs
    assert {last["version"][:16], *read} <= left and len(left) < 7
    for split in last["splits"]:
        assert len(open_blend(tmp_path / "blends" / "mix", split, verify="full")) > 0


def test_extension_after_a_takedown_leaves_the_masked_documents_out(tmp_path: Path) -> None:
    """Shards added after a takedown (same masks): the extended entry equals the whole build,
    and no masked document is in it."""
    table, lengths = _data(7, 30)
    masked = np.array([3, 40, 41, 500, 900], dtype=np.int64)
    old = _build(tmp_path / "a", table[:28], lengths, "train", masked=masked)
    new = _build(tmp_path / "a", table, lengths, "train", old, masked=masked)
    assert "document.0" in new.description["files"]
    _same(new, _build(tmp_path / "b", table, lengths, "train", masked=masked))
    assert not np.isin(np.asarray(new.document_index), masked).any()
