"""Blend manifests: build, open, relocate, refuse stale/partial/tampered artifacts, CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_pairs import MIX, build_blend_at, random_dataset

from tokenmill import verify
from tokenmill.atomic import TMP_DIR, file_sha256
from tokenmill.cli import main
from tokenmill.commands.blend_report import describe_blend
from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats.blend_manifest import manifest_digest, read_blend_manifest, seal
from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.indices import blend_build as blend_manifest
from tokenmill.indices.blend_plan import skipped_warnings
from tokenmill.indices.blend_versioning import prepare_blend
from tokenmill.indices.nanoset import NanosetIndex
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.loader import open_blend
from tokenmill.storage.versions import write_pointer
from tokenmill.verify import verify_blend

S = 8


@pytest.fixture
def root(tmp_path: Path) -> Path:
    random_dataset(tmp_path / "merged" / "docs_text_document", 120, 1)
    random_dataset(tmp_path / "merged" / "code_text_document", 80, 2, np.int32)
    return tmp_path


def datasets(root: Path) -> dict[str, Path]:
    return {"docs": root / "merged/docs_text_document", "code": root / "merged/code_text_document"}


def build(root: Path, **kw: object) -> dict:
    settings = {**MIX, "sequence_length": S, "test_samples": 10, **kw}
    return build_blend_at(root, "mix", datasets(root), **settings)


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
    names = sorted(p.name for p in (root / "blends/mix").iterdir())
    assert names == [TMP_DIR, "manifest.json", "versions"]  # .tmp/: the writers' (empty)
    assert list((root / "blends/mix" / TMP_DIR).iterdir()) == []
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


# -- empty splits: a dataset with no sample in a split is left out of it ---------------------------


def small_and_large(tmp_path: Path) -> dict[str, Path]:
    """docs: 1200 sequences (test range [1199, 1200) with "949,50,1"); code: 80 sequences
    (test range [80, 80): empty)."""
    return {
        "docs": random_dataset(tmp_path / "merged/docs_text_document", 1200, 1),
        "code": random_dataset(tmp_path / "merged/code_text_document", 80, 2),
    }


def build_default_split(tmp_path: Path, sets: dict[str, Path], name: str, **kw: object) -> dict:
    settings: dict = {"weights": {n: w for n, w in (("docs", 0.7), ("code", 0.3)) if n in sets}}
    settings.update(sequence_length=S, seed=5, train_samples=51)
    settings.update(kw)
    return build_blend_at(tmp_path, name, sets, **settings)


def test_a_dataset_with_an_empty_test_split_is_left_out_of_it(tmp_path: Path) -> None:
    manifest = build_default_split(tmp_path, small_and_large(tmp_path), "mix")
    test = manifest["splits"]["test"]
    assert [d["name"] for d in test["datasets"]] == ["docs"]
    assert [s["name"] for s in test["skipped"]] == ["code"]
    assert "no sequences in split 'test'" in test["skipped"][0]["reason"]
    assert "[80, 80]" in test["skipped"][0]["reason"]
    assert manifest["splits"]["train"]["skipped"] == manifest["splits"]["valid"]["skipped"] == []
    warnings = skipped_warnings(manifest)
    assert len(warnings) == 1
    assert "dataset 'code' is left out of split 'test'" in warnings[0]
    assert verify_blend(tmp_path / "blends/mix", full=True) == []
    ds = open_blend(tmp_path / "blends/mix", split="test", verify="full")
    assert ds.names == ["docs"] and len(ds) == test["size"] > 0
    assert set(ds.dataset_index.tolist()) == {0}
    assert "left out: code (no sequences in split 'test'" in describe_blend(tmp_path / "blends/mix")


def test_a_weighted_split_renormalizes_over_the_datasets_left(tmp_path: Path) -> None:
    """With a requested size the split is the blend of the remaining datasets alone: what
    Megatron builds when the empty dataset is not configured for that split."""
    sets = small_and_large(tmp_path)
    both = build_default_split(tmp_path, sets, "mix", test_samples=10)
    alone = build_default_split(tmp_path, {"docs": sets["docs"]}, "alone", test_samples=10)
    test, test_alone = both["splits"]["test"], alone["splits"]["test"]
    assert test["size"] == test_alone["size"] == 10  # not ceil(10*0.7) = 7
    assert test["datasets"][0]["num_samples"] == test_alone["datasets"][0]["num_samples"] == 11
    assert (
        test["datasets"][0]["index"]["cache_hash"]
        == (test_alone["datasets"][0]["index"]["cache_hash"])
    )
    for array in ("dataset_index", "dataset_sample_index"):
        assert test["files"][array]["sha256"] == test_alone["files"][array]["sha256"]
    shares = verify.realized_shares(both, tmp_path / "blends/mix/manifest.json")
    assert [(s.dataset, s.requested) for s in shares if s.split == "test"] == [("docs", 1.0)]
    # the train split still blends both with the configured weights
    assert [d["name"] for d in both["splits"]["train"]["datasets"]] == ["docs", "code"]


def test_a_split_empty_in_every_dataset_is_absent(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """120 and 80 sequences with "949,50,1": no test sequences in either (this used to fail
    with "counts must all be >= 1" naming no dataset)."""
    manifest = build(root, split_spec="949,50,1", test_samples=None)
    assert sorted(manifest["splits"]) == ["train", "valid"]
    assert skipped_warnings(manifest) == [
        "blend 'mix': split 'test' is absent: every dataset's test split is empty with "
        "split '949,50,1'"
    ]
    with pytest.raises(ConfigError, match="has no 'test' split"):
        open_blend(root / "blends/mix", split="test")
    assert len(open_blend(root / "blends/mix", split="valid")) > 0


def test_a_split_too_short_for_one_sample_is_left_out(tmp_path: Path) -> None:
    """Enough sequences, too few tokens: the exhaustive valid split has no sample of it."""
    short = tmp_path / "merged/short_text_document"
    with IndexedDatasetWriter(short, np.uint16) as writer:
        writer.add_documents(np.arange(100), np.ones(100, dtype=np.int64))
    write_dataset_manifest(short, kind="merged", inputs=[], config={}, counts={})
    sets = {"docs": random_dataset(tmp_path / "merged/docs_text_document", 400, 1), "short": short}
    weights = {"docs": 1, "short": 1}
    fields = {"sequence_length": 16, "split_spec": "80,10,10", "train_samples": 20}
    manifest = build_blend_at(tmp_path, "mix", sets, weights=weights, **fields)
    valid = manifest["splits"]["valid"]
    assert [d["name"] for d in valid["datasets"]] == ["docs"]
    assert valid["skipped"][0]["name"] == "short"
    assert "10 sequences hold 10 tokens" in valid["skipped"][0]["reason"]
    # with a requested size Megatron repeats the split: it is blended
    assert [d["name"] for d in manifest["splits"]["train"]["datasets"]] == ["docs", "short"]


def test_an_index_error_names_the_dataset_and_split(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kw: object) -> None:
        raise ConfigError("the split holds 1 token(s)")

    monkeypatch.setattr(blend_manifest, "build_or_load", refuse)
    with pytest.raises(ConfigError, match="blend 'mix': dataset 'docs' split 'train': the split"):
        build(root)


def test_edited_skipped_list_is_refused(root: Path) -> None:
    manifest = build(root, split_spec="949,50,1", test_samples=None)
    mpath = root / "blends/mix/manifest.json"
    for skipped in ([{"name": "docs", "reason": "x"}], [{"name": "nope", "reason": "x"}], [1]):
        edited = json.loads(json.dumps(manifest))
        edited["splits"]["valid"]["skipped"] = skipped
        mpath.write_text(json.dumps(seal(edited)))
        assert any("split 'valid' skipped" in p for p in verify_blend(mpath)), skipped


# -- add_extra_token and drop_last_partial_validation ----------------------------------------------


def test_flags_enter_the_version_the_manifest_and_match_tokenmill_index(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    default = build(root)
    assert default["add_extra_token"] is True and default["drop_last_partial_validation"] is True
    only_drop = build(root, drop_last_partial_validation=False)
    flagged = build(root, add_extra_token=False, drop_last_partial_validation=False)
    assert flagged["version"] != default["version"]
    assert flagged["add_extra_token"] is False
    assert flagged["drop_last_partial_validation"] is False
    assert len({default["version"], flagged["version"], only_drop["version"]}) == 3
    assert (
        prepare_blend(
            "mix",
            datasets(root),
            root / "blends/mix",
            root / "nanoset",
            BlendSettings(
                NanosetSettings(
                    sequence_length=S,
                    split_spec="80,10,10",
                    seed=5,
                    train_samples=51,
                    test_samples=10,
                    add_extra_token=False,
                    drop_last_partial_validation=False,
                ),
                weights={"docs": 0.7, "code": 0.3},
            ),
        ).version
        == flagged["version"]
    )
    # the valid index (one epoch) is the one `tokenmill index` builds with the flags
    argv = ["index", "--dataset", str(root / "merged/docs_text_document"), "--cache-dir",
            str(root / "nanoset"), "--sequence-length", str(S), "--split", "80,10,10",
            "--seed", "5", "--no-extra-token", "--keep-last-partial-valid"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    cache_hash = flagged["splits"]["valid"]["datasets"][0]["index"]["cache_hash"]
    assert f"cache {cache_hash}" in out.split("valid:")[1].splitlines()[0]
    index = json.loads(
        (root / "blends/mix" / flagged["splits"]["valid"]["datasets"][0]["index"]["files"]
         ["description"]["path"]).read_text()
    )  # fmt: skip
    assert index["key"]["add_extra_token"] is False and index["key"]["drop_last_partial"] is False
    test_index = flagged["splits"]["test"]["datasets"][0]["index"]["files"]["description"]
    test_key = json.loads((root / "blends/mix" / test_index["path"]).read_text())["key"]
    assert test_key["drop_last_partial"] is True  # train and test always drop
    valid = open_blend(root / "blends/mix", split="valid", verify="full")
    assert valid.width == S
    assert verify_blend(root / "blends/mix", full=True) == []


def test_kept_partial_valid_sample_is_padded(root: Path) -> None:
    build(root, drop_last_partial_validation=False)
    kept = open_blend(root / "blends/mix", split="valid")
    build(root)
    dropped = open_blend(root / "blends/mix", split="valid")
    assert len(kept) == len(dropped) + 2  # one padded sample more per dataset
    assert any((kept[i] == -1).any() for i in range(len(kept)))
    assert not any((dropped[i] == -1).any() for i in range(len(dropped)))


def test_edited_drop_last_flag_is_refused(root: Path) -> None:
    manifest = build(root)
    mpath = root / "blends/mix/manifest.json"
    mpath.write_text(json.dumps(seal({**manifest, "drop_last_partial_validation": False})))
    problems = verify_blend(mpath)
    assert any("drop_last_partial False" in p and "'valid'" in p for p in problems), problems
    mpath.write_text(json.dumps(seal({**manifest, "drop_last_partial_validation": "no"})))
    with pytest.raises(FormatError, match="drop_last_partial_validation"):
        read_blend_manifest(mpath)


def test_nanotron_refuses_the_megatron_flags(root: Path) -> None:
    with pytest.raises(ConfigError, match="nanotron semantics always adds the extra token"):
        build(root, semantics="nanotron", drop_last_partial_validation=False)


def test_cli_blend_flags_help_and_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["blend", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--add-extra-token, --no-add-extra-token" in text
    assert "--drop-last-partial-validation, --no-drop-last-partial-validation" in text
    assert "default: on" in text and "(default: 949,50,1)" in text
    sets = small_and_large(tmp_path)
    argv = ["blend", "--dataset", f"docs={sets['docs']}", "--dataset", f"code={sets['code']}",
            "--weight", "docs=7", "--weight", "code=3", "--output", str(tmp_path / "blends/cli"),
            "--sequence-length", str(S), "--train-samples", "51", "--seed", "5",
            "--no-add-extra-token", "--no-drop-last-partial-validation"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "warning: blend 'cli': dataset 'code' is left out of split 'test'" in captured.err
    manifest = read_blend_manifest(tmp_path / "blends/cli")
    assert manifest["add_extra_token"] is False
    assert manifest["drop_last_partial_validation"] is False


def readme_blend_command() -> list[str]:
    """The ``tokenmill blend`` command line of README.md (continuation lines joined)."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("tokenmill blend "):
            command = line
            while command.rstrip().endswith("\\"):
                command = command.rstrip()[:-1] + " " + next(lines).strip()
            words = shlex.split(command, comments=True)
            assert words[:2] == ["tokenmill", "blend"]
            return words[1:]
    raise AssertionError("README.md has no `tokenmill blend` line")


def test_readme_blend_example_runs_on_the_demo_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``make demo`` leaves data/merged/<ds>/current.json -> <v16>/<ds>_text_document; the
    README's command, run from the repo root, blends them (the small datasets have no test
    sequences with the default split: that split is left out, not an error)."""
    for ds, n_docs, seed in (("docs", 300, 1), ("code", 200, 2)):
        version = f"{seed}" * 64
        random_dataset(
            tmp_path / f"data/merged/{ds}/{version[:16]}/{ds}_text_document", n_docs, seed
        )
        write_pointer(
            tmp_path / f"data/merged/{ds}/current.json",
            version,
            f"{version[:16]}/{ds}_text_document",
        )
    monkeypatch.chdir(tmp_path)
    argv = readme_blend_command()
    assert main(argv) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    manifest = read_blend_manifest(tmp_path / "data/blends/mix/manifest.json")
    assert [d["prefix"] for d in manifest["datasets"]] == [
        "../../merged/docs/1111111111111111/docs_text_document",
        "../../merged/code/2222222222222222/code_text_document",
    ]
    assert manifest["splits"]["train"]["size"] >= 2000 and "train: " in out
    assert "test" not in manifest["splits"] and "split 'test' is absent" in err
    assert verify_blend(tmp_path / "data/blends/mix", full=True) == []
