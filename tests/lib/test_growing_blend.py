"""Blends under growing semantics: a version built after shards were appended extends the
previous one in every split (same tokens for every old sample, through open_blend), for
weighted and temperature blends; held-out documents never reach train; anything else (an
edited shard, a changed setting, a lower cap) records ``extends: null``."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_pairs import blend_values

from tokenmill.cli import main
from tokenmill.commands.blend_report import describe_blend
from tokenmill.errors import ConfigError
from tokenmill.formats.blend_manifest import read_blend_manifest
from tokenmill.formats.dataset_manifest import dataset_manifest_path, write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.indices._blend_kernels import greedy_blend
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.growing_blend import grow_blend
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.loader import FollowGrowth, newest_extension, open_blend, reopen_if_extended

SETTINGS = {"sequence_length": 8, "split_spec": "80,10,10", "seed": 5, "era_samples": 4}


def _shards(seed: int, count: int) -> list[tuple[str, list[np.ndarray]]]:
    """``count`` shards of 25..40 random documents of 5..40 tokens: (key, documents)."""
    rng = np.random.default_rng(seed)
    return [
        (
            f"s{seed}-{i:02d}",
            [rng.integers(0, 50000, size=int(n)) for n in rng.integers(5, 40, size=25 + i % 16)],
        )
        for i in range(count)
    ]


def _merged(prefix: Path, shards: list[tuple[str, list[np.ndarray]]]) -> Path:
    """A merged version of ``shards`` in order, its manifest listing them as a virtual merge
    does (key, content hash, counts)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _, docs in shards:
            for doc in docs:
                writer.add_document(doc)
    docs_total = sum(len(d) for _, d in shards)
    tokens = sum(int(x.size) for _, d in shards for x in d)
    counts = {"documents": docs_total, "sequences": docs_total, "tokens": tokens}
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts=counts)
    path = dataset_manifest_path(prefix)
    manifest = json.loads(path.read_text())
    manifest["shards"] = [
        {
            "key": key,
            "content_hash": hashlib.sha256(b"".join(d.tobytes() for d in docs)).hexdigest(),
            "documents": len(docs),
            "sequences": len(docs),
        }
        for key, docs in shards
    ]
    path.write_text(json.dumps(manifest))
    return prefix


@pytest.fixture
def shards() -> dict[str, list[tuple[str, list[np.ndarray]]]]:
    return {"docs": _shards(1, 12), "code": _shards(2, 12), "web": _shards(3, 12)}


def _build(root: Path, shards, upto: int, tag: str, **kw):  # type: ignore[no-untyped-def]
    datasets = {
        name: _merged(root / "merged" / name / tag / f"{name}_text_document", parts[:upto])
        for name, parts in shards.items()
    }
    weights = {"docs": 0.5, "code": 0.3, "web": 0.2}
    kw = {"weights": {n: weights[n] for n in shards}, "train_samples": None, **SETTINGS, **kw}
    if "temperature" in kw:
        del kw["weights"]
    return build_blend("mix", datasets, root / "blends" / "mix", root / "cache",
                       blend_values(semantics="growing", **kw))  # fmt: skip


def _documents(ds, name: str) -> set[int]:  # type: ignore[no-untyped-def]
    return set(np.asarray(ds.datasets[name].document_index).tolist())


@pytest.mark.parametrize("weighting", [{}, {"temperature": 2.0}])
def test_a_grown_blend_extends_every_split(tmp_path: Path, shards, weighting) -> None:  # type: ignore[no-untyped-def]
    v1 = _build(tmp_path, shards, 10, "v1", **weighting)
    v2 = _build(tmp_path, shards, 12, "v2", **weighting)
    assert v1["extends"] is None and v2["extends"] == v1["version"] != v2["version"]
    if weighting:  # the temperature weights followed the token counts
        assert v1["weighting"]["normalized"] != v2["weighting"]["normalized"]
    pointer = tmp_path / "blends" / "mix"
    grew = 0
    assert set(v1["splits"]) == {"train", "valid", "test"}
    for split in v1["splits"]:
        old = open_blend(pointer, split, version=v1["version"], verify="full")  # still opens
        new = open_blend(pointer, split, verify="full")
        assert new.extends == v1["version"] and old.extends is None
        assert len(old) > 0 and len(new) >= len(old)
        grew += len(new) - len(old)
        ids = np.arange(len(old))
        np.testing.assert_array_equal(new.get_batch(ids), old.get_batch(ids))
    assert grew > 0
    for name in shards:  # held-out documents of v1 never reach v2's train, nor v1's train v2's
        old = {
            s: _documents(open_blend(pointer, s, version=v1["version"]), name) for s in v1["splits"]
        }
        new = {s: _documents(open_blend(pointer, s), name) for s in v2["splits"]}
        assert not (old["valid"] | old["test"]) & new["train"]
        assert not old["train"] & (new["valid"] | new["test"])
        shares = np.array([len(new[s]) for s in ("train", "valid", "test")]) / sum(
            len(v) for v in new.values()
        )
        np.testing.assert_allclose(shares, [0.8, 0.1, 0.1], atol=0.06)


def test_rebuilding_unchanged_inputs_reuses_the_version(tmp_path: Path, shards) -> None:  # type: ignore[no-untyped-def]
    v1 = _build(tmp_path, shards, 10, "v1")
    v2 = _build(tmp_path, shards, 12, "v2")
    again = _build(tmp_path, shards, 12, "v2")
    assert again == v2 and again["extends"] == v1["version"]


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 6},
        {"era_samples": 8},
        {"weights": {"docs": 0.4, "code": 0.4, "web": 0.2}},
        {"train_samples": 3},  # a cap below the previous train size
    ],
)
def test_changed_settings_extend_nothing(tmp_path: Path, shards, change) -> None:  # type: ignore[no-untyped-def]
    _build(tmp_path, shards, 10, "v1")
    assert _build(tmp_path, shards, 12, "v2", **change)["extends"] is None


def test_an_edited_shard_extends_nothing(tmp_path: Path, shards) -> None:  # type: ignore[no-untyped-def]
    _build(tmp_path, shards, 10, "v1")
    key, docs = shards["code"][3]
    shards["code"][3] = (key, [*docs[:-1], docs[-1][::-1].copy()])  # same counts, new tokens
    v2 = _build(tmp_path, shards, 12, "v2")
    assert v2["extends"] is None
    assert open_blend(tmp_path / "blends" / "mix", "train").extends is None


def test_the_cap_cuts_and_a_raised_cap_still_extends(tmp_path: Path, shards) -> None:  # type: ignore[no-untyped-def]
    v1 = _build(tmp_path, shards, 10, "v1", train_samples=20)
    assert v1["splits"]["train"]["size"] == 20 and v1["splits"]["train"]["samples_requested"] == 20
    v2 = _build(tmp_path, shards, 12, "v2", train_samples=40)
    assert v2["extends"] == v1["version"] and v2["splits"]["train"]["size"] == 40
    assert "growing, weighted, cap 40, extends" in describe_blend(tmp_path / "blends" / "mix")


def test_growing_blend_never_oversamples() -> None:
    """The blend stops at the first sample a dataset cannot supply, and is a prefix of the blend
    over larger datasets; continuing from a prefix with the same weights replays it."""
    small = grow_blend([0.7, 0.3], [30, 100], None)
    large = grow_blend([0.7, 0.3], [300, 100], None)
    counts = np.bincount(small[0].astype(np.int64), minlength=2)
    assert counts[0] == 30 and counts[1] <= 100
    np.testing.assert_array_equal(large[0][: len(small[0])], small[0])
    np.testing.assert_array_equal(large[1][: len(small[1])], small[1])
    again = grow_blend([0.7, 0.3], [300, 100], None, previous=small)
    np.testing.assert_array_equal(again[0], large[0])
    assert len(grow_blend([0.5, 0.5], [0, 100], None)[0]) == 0
    with pytest.raises(ConfigError, match="every weight > 0"):
        grow_blend([1.0, 0.0], [10, 10], None)


def test_grow_blend_is_the_full_greedy_cut_at_the_first_overflow() -> None:
    """For random weights, sizes and caps: the blend equals Megatron's greedy run to the end and
    cut at the first pick a dataset cannot supply (the search bound never cuts it short), and a
    continuation with other weights keeps its prefix and never oversamples."""
    rng = np.random.default_rng(0)
    for _ in range(150):
        k = int(rng.integers(1, 5))
        w, sizes = rng.random(k) + 0.01, rng.integers(0, 400, size=k)
        cap = None if rng.random() < 0.5 else int(rng.integers(0, 800))
        di, dsi = grow_blend(w, sizes, cap)
        stop = int(sizes.sum()) if cap is None else min(cap, int(sizes.sum()))
        full_di, full_dsi, _ = greedy_blend(w / w.sum(), stop, index_dtype=np.int16)
        over = full_dsi >= sizes[full_di.astype(np.int64)]
        end = int(np.argmax(over)) if over.any() else stop
        np.testing.assert_array_equal(di, full_di[:end])
        np.testing.assert_array_equal(dsi, full_dsi[:end])
        half = len(di) // 2
        grown = grow_blend(rng.random(k) + 0.01, sizes, cap, previous=(di[:half], dsi[:half]))
        np.testing.assert_array_equal(grown[0][:half], di[:half])
        assert np.all(np.bincount(grown[0].astype(np.int64), minlength=k) <= sizes)


def test_train_samples_null_is_for_growing_only(tmp_path: Path, shards) -> None:  # type: ignore[no-untyped-def]
    prefix = _merged(tmp_path / "m" / "docs_text_document", shards["docs"][:3])
    with pytest.raises(ConfigError, match="train_samples"):
        build_blend(
            "x",
            {"docs": prefix},
            tmp_path / "x",
            tmp_path / "c",
            BlendSettings(
                NanosetSettings(sequence_length=8, train_samples=None), weights={"docs": 1}
            ),
        )
    built = build_blend(
        "x",
        {"docs": prefix},
        tmp_path / "x",
        tmp_path / "c",
        BlendSettings(NanosetSettings(sequence_length=8, train_samples=10), weights={"docs": 1}),
    )
    assert "extends" not in built and open_blend(tmp_path / "x").extends is None


def test_cli_blend_growing(tmp_path: Path, shards, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    prefix = _merged(tmp_path / "m" / "docs_text_document", shards["docs"])
    argv = ["blend", "--dataset", f"docs={prefix}", "--weight", "docs=1", "--output"]
    argv += [str(tmp_path / "b"), "--sequence-length", "8", "--split", "80,10,10"]
    assert main([*argv, "--semantics", "growing", "--era-samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "extends nothing (built from scratch)" in out
    manifest = read_blend_manifest(tmp_path / "b")
    assert manifest["growing"]["era_samples"] == 4 and manifest["splits"]["train"]["size"] > 0


# -- training follows growth -----------------------------------------------------------------------
def test_follow_growth_switches_at_a_step_boundary_without_replay_or_gap(
    tmp_path: Path, shards
) -> None:  # type: ignore[no-untyped-def]
    """A job trained on v1 switches to v2 at a checkpoint: the batches it already consumed are
    v2's first batches, and it continues at the same step into data v1 did not have."""
    v1 = _build(tmp_path, shards, 10, "v1")
    pointer = tmp_path / "blends" / "mix"
    follow = FollowGrowth(pointer, "train", global_batch_size=8, rank=1, world_size=2)
    assert follow.version == v1["version"] and not follow.refresh()  # nothing newer yet
    sampler = follow.sampler(0)
    seen = [follow.ds.get_batch(ix) for ix in sampler]  # every whole batch of v1
    step = sampler.total_steps
    v2 = _build(tmp_path, shards, 12, "v2")
    assert newest_extension(pointer, v1["version"]) == v2["version"]
    assert follow.refresh() and follow.version == v2["version"]
    replay = [follow.ds.get_batch(follow.sampler(0).indices(s)) for s in range(step)]
    np.testing.assert_array_equal(np.stack(replay), np.stack(seen))
    assert len(follow.sampler(step)) > 0  # more steps from the same step on
    # resuming from a checkpoint that recorded v1 reaches v2 the same way
    resumed = FollowGrowth(pointer, global_batch_size=8, version=v1["version"])
    assert resumed.version == v1["version"] and resumed.refresh()


def test_follow_growth_stays_when_the_new_version_does_not_extend(tmp_path: Path, shards) -> None:  # type: ignore[no-untyped-def]
    v1 = _build(tmp_path, shards, 10, "v1")
    pointer = tmp_path / "blends" / "mix"
    ds = open_blend(pointer, "train")
    _build(tmp_path, shards, 12, "v2", seed=9)  # another split assignment: no extension
    assert newest_extension(pointer, v1["version"]) is None
    assert reopen_if_extended(ds, pointer) is ds


def test_chains_of_versions_are_followed(tmp_path: Path, shards) -> None:  # type: ignore[no-untyped-def]
    v1 = _build(tmp_path, shards, 9, "v1")
    _build(tmp_path, shards, 10, "v2")
    v3 = _build(tmp_path, shards, 12, "v3")
    pointer = tmp_path / "blends" / "mix"
    old = open_blend(pointer, "valid", version=v1["version"])
    new = reopen_if_extended(old, pointer)
    assert new.version == v3["version"] and new.split == "valid"
    ids = np.arange(len(old))
    np.testing.assert_array_equal(new.get_batch(ids), old.get_batch(ids))


def test_torch_growth_loader(tmp_path: Path, shards) -> None:  # type: ignore[no-untyped-def]
    torch_adapter = pytest.importorskip("tokenmill.loader.torch")
    _build(tmp_path, shards, 10, "v1")
    follow = FollowGrowth(tmp_path / "blends" / "mix", global_batch_size=4)
    first = next(iter(torch_adapter.growth_loader(follow, 2)))
    np.testing.assert_array_equal(
        first["input_ids"].numpy(), follow.ds.get_batch(np.arange(8, 12))[:, :-1]
    )


def test_a_dataset_without_a_whole_era_holds_its_split_at_zero(tmp_path: Path, shards) -> None:  # type: ignore[no-untyped-def]
    """A dataset whose train split has no whole era yet stays in the blend with length 0: the
    split stops before its first pick, and the blend opens (fully verified) all the same."""
    tiny = {"docs": shards["docs"], "code": shards["code"][:1]}
    manifest = _build(tmp_path, tiny, 12, "v1", era_samples=64)
    train = manifest["splits"]["train"]
    assert [ds["length"] for ds in train["datasets"]][1] == 0 and train["size"] <= 3
    assert train["datasets"][0]["length"] >= 64
    ds = open_blend(tmp_path / "blends" / "mix", "train", verify="full")
    assert len(ds) == train["size"]


def test_a_current_version_without_its_folder_is_not_extended(tmp_path: Path, shards) -> None:  # type: ignore[no-untyped-def]
    """The predecessor's arrays must be there to be kept: with its version folder gone (e.g.
    removed by hand), the next build extends nothing and is built from scratch."""
    v1 = _build(tmp_path, shards, 10, "v1", temperature=2.0)
    shutil.rmtree(tmp_path / "blends" / "mix" / "versions" / v1["version"][:16])
    v2 = _build(tmp_path, shards, 12, "v2", temperature=2.0)
    assert v2["extends"] is None
    assert len(open_blend(tmp_path / "blends" / "mix", "train", verify="full")) > 0
