"""Blend manifests: build, open, relocate, refuse stale/partial/tampered artifacts, CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from tokenmill import blend_manifest
from tokenmill._atomic import file_sha256
from tokenmill.blend_manifest import build_blend, describe_blend, read_blend_manifest, verify_blend
from tokenmill.cli import main
from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.loader import open_blend
from tokenmill.loader._manifest import manifest_digest, seal
from tokenmill.manifest import write_dataset_manifest
from tokenmill.nanoset import NanosetIndex

S = 8


def make_dataset(prefix: Path, n_docs: int, seed: int, dtype: type = np.uint16) -> Path:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, n_docs)
    with IndexedDatasetWriter(prefix, dtype) as writer:
        writer.add_documents(rng.integers(0, 60000, int(lengths.sum())), lengths)
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={})
    return prefix


@pytest.fixture
def root(tmp_path: Path) -> Path:
    make_dataset(tmp_path / "merged" / "docs_text_document", 120, 1)
    make_dataset(tmp_path / "merged" / "code_text_document", 80, 2, np.int32)
    return tmp_path


def datasets(root: Path) -> dict[str, Path]:
    return {"docs": root / "merged/docs_text_document", "code": root / "merged/code_text_document"}


def build(root: Path, **kw: object) -> dict:
    settings: dict = {
        "weights": {"docs": 0.7, "code": 0.3},
        "sequence_length": S,
        "split_spec": "80,10,10",
        "seed": 5,
        "train_samples": 51,
        "test_samples": 10,
    }
    settings.update(kw)
    return build_blend("mix", datasets(root), root / "blends/mix", root / "nanoset", **settings)


def test_manifest_records_sizes_paths_and_is_read_back(root: Path) -> None:
    manifest = build(root)
    mpath = root / "blends/mix/manifest.json"
    assert read_blend_manifest(mpath) == json.loads(mpath.read_text()) == manifest
    assert [d["name"] for d in manifest["datasets"]] == ["docs", "code"]
    assert manifest["datasets"][0]["prefix"] == "../../merged/docs_text_document"
    train = manifest["splits"]["train"]
    # megatron: blend size = ceil(51·0.7) + ceil(51·0.3) = 36 + 16; index sizes ceil(t·1.005)
    assert train["size"] == 52
    assert [d["num_samples"] for d in train["datasets"]] == [37, 17]
    assert [d["samples_used"] for d in train["datasets"]] == [36, 16]
    v16 = manifest["version"][:16]
    assert len(manifest["version"]) == 64
    assert manifest["manifest_sha256"] == manifest_digest(manifest)
    assert train["files"]["dataset_index"]["path"] == f"versions/{v16}/train-dataset_index.npy"
    cache = train["datasets"][0]["index"]["files"]["shuffle"]["path"]
    assert cache.startswith("../../nanoset/") and cache.endswith("-Nanoset-train-shuffle_index.npy")
    assert manifest["splits"]["valid"]["mode"] == "exhaustive"
    assert manifest["splits"]["test"]["size"] == 10
    assert verify_blend(mpath) == [] and verify_blend(mpath, full=True) == []
    # The version's own manifest: the same content, paths relative to its own folder.
    own = read_blend_manifest(root / f"blends/mix/versions/{v16}/manifest.json")
    assert own["version"] == manifest["version"] and own["splits"]["train"]["size"] == 52
    assert own["splits"]["train"]["files"]["dataset_index"]["path"] == "train-dataset_index.npy"
    assert own["datasets"][0]["prefix"] == "../../../../merged/docs_text_document"
    assert sorted(p.name for p in (root / "blends/mix").iterdir()) == ["manifest.json", "versions"]
    assert verify_blend(root / f"blends/mix/versions/{v16}", full=True) == []


def test_open_blend_samples_come_from_the_named_datasets(root: Path) -> None:
    build(root)
    ds = open_blend(root / "blends/mix/manifest.json", split="train")
    assert len(ds) == 52 and ds.width == S + 1
    for i in range(len(ds)):
        part = ds.datasets[ds.names[int(ds.dataset_index[i])]]
        assert np.array_equal(ds[i], part[int(ds.dataset_sample_index[i])])
    batch = ds.get_batch(np.arange(len(ds))[::-1])
    assert batch.dtype == np.int64
    assert np.array_equal(batch, np.stack([ds[i] for i in range(len(ds))][::-1]))
    assert ds.proportions == {"docs": 36 / 52, "code": 16 / 52}


def test_opened_blend_survives_pickling(root: Path) -> None:
    """DataLoader workers started with ``spawn`` receive the dataset pickled."""
    build(root)
    ds = open_blend(root / "blends/mix")
    pickled = pickle.dumps(ds)
    tokens = (root / "merged/docs_text_document.bin").read_bytes()
    assert tokens[64:128] not in pickled  # index arrays travel, the token file is re-mapped
    copy = pickle.loads(pickled)
    assert np.array_equal(copy.get_batch(range(len(ds))), ds.get_batch(range(len(ds))))
    assert copy.names == ds.names and copy.proportions == ds.proportions


def test_valid_without_a_size_uses_every_sample_once(root: Path) -> None:
    manifest = build(root)
    valid = open_blend(root / "blends/mix", split="valid")
    lengths = [len(valid.datasets[n]) for n in valid.names]
    assert len(valid) == sum(lengths) == manifest["splits"]["valid"]["size"]
    pairs = set(zip(valid.dataset_index.tolist(), valid.dataset_sample_index.tolist(), strict=True))
    assert pairs == {(d, k) for d, n in enumerate(lengths) for k in range(n)}


def test_nanotron_sizes(root: Path) -> None:
    manifest = build(root, semantics="nanotron")
    train, valid = manifest["splits"]["train"], manifest["splits"]["valid"]
    assert train["size"] == 51
    assert [d["num_samples"] for d in train["datasets"]] == [
        int(51 * 0.7 * 1.005),
        int(51 * 0.3 * 1.005),
    ]
    assert valid["mode"] == "weighted"
    assert valid["size"] == sum(d["length"] for d in valid["datasets"])
    ds = open_blend(root / "blends/mix", split="valid")
    assert np.array_equal(ds.get_batch(range(len(ds))), np.stack([ds[i] for i in range(len(ds))]))


def test_temperature_weights_follow_token_counts(root: Path) -> None:
    manifest = build(root, weights=None, temperature=2.0)
    tokens = {d["name"]: d["num_tokens"] for d in manifest["datasets"]}
    raw = {n: t**0.5 for n, t in tokens.items()}
    expect = {n: v / sum(raw.values()) for n, v in raw.items()}
    got = manifest["weighting"]["normalized"]
    assert all(math.isclose(got[n], expect[n], rel_tol=1e-12) for n in expect)
    assert manifest["weighting"]["temperature"] == 2.0


def test_a_copied_blend_opens_elsewhere(
    root: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    build(root)
    before = open_blend(root / "blends/mix").get_batch(range(20))
    elsewhere = tmp_path_factory.mktemp("copy") / "tree"
    shutil.copytree(root, elsewhere)
    shutil.rmtree(root)
    assert np.array_equal(open_blend(elsewhere / "blends/mix").get_batch(range(20)), before)


def test_changed_dataset_is_refused_with_what_to_rebuild(root: Path) -> None:
    build(root)
    with open(root / "merged/code_text_document.bin", "ab") as fh:
        fh.write(b"\0\0\0\0")
    with pytest.raises(CacheError) as err:
        open_blend(root / "blends/mix")
    text = str(err.value)
    assert "dataset 'code' bin" in text and "changed after the blend was built" in text
    assert "rebuild blend 'mix'" in text and "tokenmill blend --output" in text


def test_same_size_token_change_is_caught_by_full_verification(root: Path) -> None:
    build(root)
    path = root / "merged/docs_text_document.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert verify_blend(root / "blends/mix") == []
    open_blend(root / "blends/mix")
    problems = verify_blend(root / "blends/mix", full=True)
    assert len(problems) == 1 and "docs_text_document.bin: sha256 differs" in problems[0]
    with pytest.raises(CacheError, match="sha256 differs"):
        open_blend(root / "blends/mix", verify="full")


def test_missing_index_cache_is_refused(root: Path) -> None:
    manifest = build(root)
    entry = manifest["splits"]["train"]["datasets"][1]["index"]["files"]["sample"]
    (root / "blends/mix" / entry["path"]).unlink()
    with pytest.raises(CacheError, match=r"split 'train' dataset 'code' index cache .*: missing"):
        open_blend(root / "blends/mix")
    open_blend(root / "blends/mix", split="test")


def test_partial_blend_without_manifest_is_refused(root: Path) -> None:
    build(root)
    (root / "blends/mix/manifest.json").unlink()
    with pytest.raises(FormatError, match="manifest: missing: the blend was never completed"):
        open_blend(root / "blends/mix")


def test_malformed_manifest_is_a_format_error(root: Path) -> None:
    build(root)
    mpath = root / "blends/mix/manifest.json"
    manifest = json.loads(mpath.read_text())
    del manifest["splits"]["train"]["files"]
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=r"manifest_sha256: .* edited or damaged"):
        open_blend(mpath)
    mpath.write_text(json.dumps(seal(manifest)))
    with pytest.raises(FormatError, match=r"manifest: malformed \(KeyError\('files'\)\)"):
        open_blend(mpath)


def snapshot(top: Path) -> dict[str, bytes]:
    """Every file under ``top`` with its bytes."""
    return {p.relative_to(top).as_posix(): p.read_bytes() for p in top.rglob("*") if p.is_file()}


def test_failed_rebuild_leaves_the_previous_version_current(root: Path) -> None:
    build(root)
    before = snapshot(root / "blends")
    (root / "merged/code_text_document.idx").unlink()
    with pytest.raises(FormatError, match=r"code_text_document\.idx: file: missing"):
        build(root, seed=6)
    assert snapshot(root / "blends") == before


def test_tampered_object_array_is_refused_even_with_matching_hash(root: Path) -> None:
    manifest = build(root)
    blend_dir = root / "blends/mix"
    npy = blend_dir / "versions" / manifest["version"][:16] / "train-dataset_sample_index.npy"
    np.save(npy, np.array([{"x": 1}] * 52, dtype=object), allow_pickle=True)
    with pytest.raises(CacheError, match=r"train-dataset_sample_index\.npy"):
        open_blend(blend_dir)
    mpath = blend_dir / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["splits"]["train"]["files"]["dataset_sample_index"].update(
        bytes=npy.stat().st_size, sha256=file_sha256(npy)
    )
    mpath.write_text(json.dumps(seal(manifest)))  # a buggy writer: consistent, sealed, wrong
    with pytest.raises(FormatError, match=r"dataset_sample_index: unreadable \.npy"):
        open_blend(blend_dir)


def test_describe_blend_shows_weights_against_realized(root: Path) -> None:
    build(root)
    text = describe_blend(root / "blends/mix/manifest.json")
    assert "blend 'mix': semantics megatron, sequence length 8" in text
    assert "train: 52 samples (weighted, requested 51)" in text
    docs_row = next(
        line for line in text.splitlines() if line.startswith("docs") and "0.7000" in line
    )
    assert f"{36 / 52:.4f}" in docs_row and "36" in docs_row.split()


def test_oversampling_is_an_error_naming_the_setting(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blend that needs more samples of a dataset than its index holds is refused."""
    real = blend_manifest.build_or_load

    def short_index(*args: object, **kw: object) -> NanosetIndex:
        index = real(*args, **kw)  # type: ignore[arg-type]
        assert index is not None
        return dataclasses.replace(index, shuffle_index=index.shuffle_index[:5])

    monkeypatch.setattr(blend_manifest, "build_or_load", short_index)
    with pytest.raises(ConfigError) as err:
        build(root)
    assert "blend 'mix' split 'train' (datasets in order: docs, code): dataset 0" in str(err.value)
    assert "oversampling" in str(err.value) and "mid_level_dataset_surplus" in str(err.value)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"weights": {"docs": 1.0}}, "weights name"),
        ({"temperature": 2.0}, "exactly one of weights and temperature"),
        ({"weights": {"docs": 0.0, "code": 0.0}}, "not all 0"),
        ({"train_samples": 0}, "train_samples must be an integer >= 1"),
        ({"semantics": "fairseq"}, "semantics must be one of"),
    ],
)
def test_bad_settings(root: Path, kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(root, **kw)


def test_cli_blend_builds_and_prints_the_table(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "blend",
        "--dataset",
        f"docs={root / 'merged/docs_text_document'}",
        "--dataset",
        f"code={root / 'merged/code_text_document'}",
        "--weight",
        "docs=7",
        "--weight",
        "code=3",
        "--output",
        str(root / "blends/cli"),
        "--sequence-length",
        str(S),
        "--split",
        "80,10,10",
        "--train-samples",
        "51",
        "--seed",
        "5",
        "--test-samples",
        "10",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "blend 'cli'" in out and "train: 52 samples" in out
    cli_manifest = read_blend_manifest(root / "blends/cli")
    assert f"version {cli_manifest['version']} (versions/{cli_manifest['version'][:16]}/)" in out
    assert (
        cli_manifest["splits"]["train"]["files"]["dataset_index"]["sha256"]
        == build(root)["splits"]["train"]["files"]["dataset_index"]["sha256"]
    )
    assert (root / "blends/cli/cache").is_dir()
    assert main([("docs=x" if a == "docs=7" else a) for a in args]) == 2
    assert "not a number" in capsys.readouterr().err
