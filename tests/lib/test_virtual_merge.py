"""Virtual merged datasets: a manifest of shard pairs reads exactly as their physical merge."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_pairs import blend_values, index_of, random_dataset, split_fields

from tokenmill.cli import main
from tokenmill.errors import CacheError, FormatError
from tokenmill.formats.blend_manifest import read_blend_manifest, seal, verify_manifest
from tokenmill.formats.dataset_manifest import (
    dataset_manifest_path,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.formats.merge import merge_datasets, virtual_merge
from tokenmill.formats.virtual_merge import VirtualDataset, block_list_digest
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.nanoset import build_or_load
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.loader import open_blend, open_nanoset
from tokenmill.storage.versions import read_pointer
from tokenmill.tokenize.merged_versions import merged_version
from tokenmill.verify import verify_blend, verify_dataset

FLAGS = (
    {},
    {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True},
    {"create_attention_mask": True, "inter_document_masking": True},
)


def _shards(folder: Path, sizes: list[int], seed: int, dtype: type = np.uint16) -> list[Path]:
    return [
        random_dataset(
            folder / f"part-{i:05d}_text_document",
            n,
            seed + i,
            dtype,
            kind="tokens",
            counted=True,
            lengths=(1, 40),
        )
        for i, n in enumerate(sizes)
    ]


def _merges(tmp_path: Path, name: str, sizes: list[int], seed: int) -> tuple[Path, Path]:
    shards = _shards(tmp_path / "tokens" / name, sizes, seed)
    physical = merge_datasets(shards, tmp_path / "physical" / f"{name}_text_document").prefix
    keys = [(p.name.removesuffix("_text_document"), p) for p in shards]
    virtual = virtual_merge(keys, tmp_path / "virtual" / "v1" / f"{name}_text_document").prefix
    return physical, virtual


def test_a_virtual_merge_reads_as_the_physical_merge(tmp_path: Path) -> None:
    physical, virtual = _merges(tmp_path, "docs", [7, 1, 30, 12], seed=3)
    assert not Path(f"{virtual}.bin").exists() and not Path(f"{virtual}.idx").exists()
    with open_dataset(physical) as p, open_dataset(virtual) as v:
        assert isinstance(v, VirtualDataset)
        assert (len(v), v.num_documents, v.num_tokens) == (len(p), p.num_documents, p.num_tokens)
        assert np.array_equal(v.sequence_lengths, p.sequence_lengths)
        assert np.array_equal(v.document_indices, p.document_indices)
        for i in range(len(p)):
            assert np.array_equal(v[i], p[i])
    manifest = read_dataset_manifest(virtual)
    assert manifest["kind"] == "virtual_merge" and manifest["extends"] is None
    assert [s["key"] for s in manifest["shards"]] == [f"part-{i:05d}" for i in range(4)]
    assert verify_dataset(virtual) == []


def test_the_manifest_refers_to_block_lists_and_a_version_1_manifest_still_opens(
    tmp_path: Path,
) -> None:
    physical, virtual = _merges(tmp_path, "docs", [7, 1, 30, 12], seed=5)
    path = dataset_manifest_path(virtual)
    manifest = json.loads(path.read_text())
    assert manifest["format_version"] == 2 and "block_sha256" not in path.read_text()
    for shard in manifest["shards"]:  # only the digest of each shard's own lists
        own = read_dataset_manifest(virtual.parent / shard["prefix"])["files"]
        for kind in ("bin", "idx"):
            recorded = own[f"{Path(shard['prefix']).name}.{kind}"]["block_sha256"]
            info = shard["files"][kind]
            assert info.pop("block_list_sha256") == block_list_digest(recorded)
            info["block_sha256"] = recorded  # as version 1 had it
    path.write_text(json.dumps({**manifest, "format_version": 1}))
    with open_dataset(physical) as p, open_dataset(virtual) as v:
        assert [v[i].tolist() for i in range(len(v))] == [p[i].tolist() for i in range(len(p))]
        kept = v.manifest["shards"]  # what the reader holds: no block lists
        assert all("block_sha256" not in f for s in kept for f in s["files"].values())
    assert verify_dataset(virtual) == []
    path.write_text(json.dumps({**manifest, "format_version": 2}))  # lists inline: not version 2
    with pytest.raises(FormatError, match=r"shards\[0\]\.files\.bin: a version-2 merge records"):
        read_dataset_manifest(virtual)
    path.write_text(json.dumps({**manifest, "format_version": 3}))
    with pytest.raises(FormatError, match=r"format_version: 3; this reader opens \[1, 2\]"):
        read_dataset_manifest(virtual)


@pytest.mark.parametrize("semantics", ["megatron", "nanotron"])
def test_every_sample_over_a_virtual_merge_equals_the_physical_one(
    tmp_path: Path, semantics: str
) -> None:
    physical, virtual = _merges(tmp_path, "docs", [9, 3, 25, 14, 6], seed=11)
    for split in ("train", "valid", "test"):
        settings = split_fields(split, semantics, train_samples=40)
        opened = [
            open_nanoset(prefix, index_of(prefix, tmp_path / f"cache-{n}", **settings))
            for n, prefix in enumerate((physical, virtual))
        ]
        a, b = opened
        assert len(a) == len(b) > 0
        everything = np.arange(len(a))
        assert np.array_equal(a.get_batch(everything), b.get_batch(everything))
        for k in (0, len(a) - 1):
            assert np.array_equal(a[k], b[k])
        for flags in FLAGS:
            ta = a.get_training_batch(everything, eod_id=0, **flags)
            tb = b.get_training_batch(everything, eod_id=0, **flags)
            assert ta.keys() == tb.keys()
            for key in ta:
                assert np.array_equal(ta[key], tb[key]), (split, key, flags)


def test_a_blend_of_virtual_merges_equals_the_blend_of_physical_ones(tmp_path: Path) -> None:
    docs = _merges(tmp_path, "docs", [20, 8, 31], seed=21)
    code = _merges(tmp_path, "code", [15, 27], seed=41)
    settings = {
        "weights": {"docs": 0.7, "code": 0.3},
        "sequence_length": 12,
        "split_spec": "90,5,5",
        "train_samples": 60,
    }
    opened = []
    for mode in (0, 1):
        sets = {"docs": docs[mode], "code": code[mode]}
        out = tmp_path / "blends" / f"mix{mode}"
        build_blend("mix", sets, out, tmp_path / f"nanoset{mode}", blend_values(**settings))
        assert verify_blend(out, full=True) == []
        opened.append({s: open_blend(out, s) for s in ("train", "valid", "test")})
    for split in ("train", "valid", "test"):
        a, b = opened[0][split], opened[1][split]
        assert len(a) == len(b) > 0
        ids = np.arange(len(a))
        assert np.array_equal(a.get_batch(ids), b.get_batch(ids))
        for flags in FLAGS:
            ta = a.get_training_batch(ids, eod_id=0, **flags)
            tb = b.get_training_batch(ids, eod_id=0, **flags)
            assert all(np.array_equal(ta[k], tb[k]) for k in ta)


def test_a_shard_changed_after_the_merge_is_refused_naming_it(tmp_path: Path) -> None:
    _, virtual = _merges(tmp_path, "docs", [5, 6], seed=5)
    sets = {"docs": virtual}
    out = tmp_path / "blends" / "one"
    build_blend(
        "one",
        sets,
        out,
        tmp_path / "nanoset",
        BlendSettings(NanosetSettings(sequence_length=4, train_samples=10), weights={"docs": 1}),
    )
    shard = tmp_path / "tokens" / "docs" / "part-00001_text_document.bin"
    shard.write_bytes(shard.read_bytes() + b"\0\0")
    with pytest.raises(CacheError, match="part-00001"):
        open_blend(out, "train")
    with pytest.raises(FormatError, match="part-00001"):
        open_dataset(virtual)[6]


@pytest.mark.parametrize("kind", ["manifest", "idx"])
def test_a_blend_record_naming_another_dataset_file_is_a_format_error(
    tmp_path: Path, kind: str
) -> None:
    """A dataset's file record (a virtual merge's manifest, a physical pair's ``.idx``) must be
    the file of the dataset's own prefix: one pointing at another dataset's file, even a
    complete one, is refused naming the field, never checked as if it were this dataset's."""
    physical, virtual = _merges(tmp_path, "docs", [5, 6], seed=5)
    other_physical, other_virtual = _merges(tmp_path, "code", [4, 7], seed=6)
    own, other = (virtual, other_virtual) if kind == "manifest" else (physical, other_physical)
    out = tmp_path / "blends" / "mix"
    settings = NanosetSettings(sequence_length=4, train_samples=10)
    weights = {"docs": 1.0, "code": 1.0}
    build_blend(
        "mix",
        {"docs": own, "code": other},
        out,
        tmp_path / "nanoset",
        BlendSettings(settings, weights=weights),
    )
    mpath = out / "manifest.json"
    manifest = read_blend_manifest(mpath)
    docs, code = (next(d for d in manifest["datasets"] if d["name"] == n) for n in ("docs", "code"))
    docs["files"][kind] = code["files"][kind]
    mpath.write_text(json.dumps(seal(manifest)))
    with pytest.raises(
        FormatError, match=rf"datasets\.docs\.files\.{kind}: .* is not the {kind} file"
    ):
        verify_manifest(mpath)


def test_tokenmill_merge_writes_the_physical_pair_of_a_virtual_merge(tmp_path: Path) -> None:
    physical, virtual = _merges(tmp_path, "docs", [4, 9, 2], seed=8)
    out = tmp_path / "again" / "docs_text_document"
    assert main(["merge", "--input", str(virtual), "--output-prefix", str(out)]) == 0
    for suffix in (".bin", ".idx"):
        assert Path(f"{out}{suffix}").read_bytes() == Path(f"{physical}{suffix}").read_bytes()


def test_a_virtual_merge_opens_after_its_tree_is_moved(tmp_path: Path) -> None:
    _, virtual = _merges(tmp_path, "docs", [4, 9], seed=8)
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    shutil.copytree(tmp_path, moved)
    with open_dataset(moved / virtual.relative_to(tmp_path)) as v:
        assert v.shard_prefix(1).is_relative_to(moved)
        assert len(v[12]) > 0


@pytest.mark.parametrize(
    "prefix", ["/etc/passwd", "x/../../y", "", "a\x01b"], ids=["abs", "mid", "empty", "ctl"]
)
def test_a_tampered_shard_path_is_a_format_error(tmp_path: Path, prefix: str) -> None:
    _, virtual = _merges(tmp_path, "docs", [3], seed=1)
    path = dataset_manifest_path(virtual)
    manifest = json.loads(path.read_text())
    manifest["shards"][0]["prefix"] = prefix
    path.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="prefix"):
        read_dataset_manifest(virtual)


def test_index_cache_over_a_virtual_merge_keys_on_its_content(tmp_path: Path) -> None:
    physical, virtual = _merges(tmp_path, "docs", [12, 12], seed=2)
    a = build_or_load(virtual, tmp_path / "c", "train", NanosetSettings(sequence_length=8))
    b = build_or_load(physical, tmp_path / "c", "train", NanosetSettings(sequence_length=8))
    assert a is not None and b is not None
    assert (
        a.description["key"]["dataset_content_hash"]
        == read_dataset_manifest(virtual)["content_hash"]
    )
    assert np.array_equal(a.shuffle_index, b.shuffle_index)
    assert np.array_equal(a.sample_index, b.sample_index)


def test_pull_copies_a_blend_of_virtual_merges_with_its_shards(tmp_path: Path) -> None:
    from tokenmill.storage.pull import pull

    root = tmp_path / "root"
    _, virtual = _merges(root, "docs", [6, 10, 4], seed=13)
    out = root / "blends" / "one"
    build_blend(
        "one",
        {"docs": virtual},
        out,
        root / "nanoset",
        BlendSettings(NanosetSettings(sequence_length=6, train_samples=20), weights={"docs": 1}),
    )
    dest = tmp_path / "copy"
    pull(str(out / "manifest.json"), dest)
    copies = list(dest.rglob("manifest.json"))
    pointer = next(p for p in copies if p.parent.name == "one")
    a, b = open_blend(out, "train", verify="full"), open_blend(pointer, "train", verify="full")
    ids = np.arange(len(a))
    assert np.array_equal(a.get_batch(ids), b.get_batch(ids))
    assert len(list(dest.rglob("part-*_text_document.bin"))) == 3
    shards = sorted(dest.rglob("manifests/part-*_text_document.manifest.json"))  # block lists
    assert [p.read_bytes() for p in shards] == [
        dataset_manifest_path(p.with_suffix("")).read_bytes()
        for p in sorted((root / "tokens" / "docs").glob("part-*_text_document.bin"))
    ]


def test_pull_fsyncs_the_removal_of_another_versions_manifest_before_fetching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull of another version removes the blend manifest in place first; its folder is
    fsynced then, before any file is renamed into place (those renames fsync their own
    folders), so a crash never leaves the old manifest over the new files."""
    from tokenmill.storage import pull as pull_module
    from tokenmill.storage import pull_blocks

    root = tmp_path / "root"
    _, virtual = _merges(root, "docs", [6, 10, 4], seed=13)
    out = root / "blends" / "one"

    def build(samples: int) -> None:
        nanoset = NanosetSettings(sequence_length=6, train_samples=samples)
        build_blend(
            "one", {"docs": virtual}, out, root / "nanoset", BlendSettings(nanoset, {"docs": 1})
        )

    build(20)
    dest = tmp_path / "copy"
    local = pull_module.pull(str(out / "manifest.json"), dest).manifest
    build(30)
    events: list[str] = []
    real_commit = pull_blocks.commit

    def watched(tmp: Path, final: Path) -> None:
        events.append(f"commit {Path(final).name}")
        real_commit(tmp, final)

    monkeypatch.setattr(pull_blocks, "commit", watched)
    monkeypatch.setattr(
        pull_module, "fsync_dir", lambda d: events.append(f"fsync {d}"), raising=False
    )
    pull_module.pull(str(out / "manifest.json"), dest)
    assert events and events[0] == f"fsync {local.parent}", events[:3]
    assert any(e.startswith("commit ") for e in events)


def test_pull_refuses_a_shard_block_list_the_merge_did_not_record(tmp_path: Path) -> None:
    from tokenmill.storage.pull import pull

    root = tmp_path / "root"
    _, virtual = _merges(root, "docs", [6, 10], seed=17)
    settings = BlendSettings(NanosetSettings(sequence_length=6, train_samples=20), {"docs": 1})
    build_blend("one", {"docs": virtual}, root / "blends" / "one", root / "nanoset", settings)
    shard = dataset_manifest_path(root / "tokens" / "docs" / "part-00001_text_document")
    manifest = json.loads(shard.read_text())
    manifest["files"]["part-00001_text_document.bin"]["block_sha256"][0] = "0" * 64
    shard.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=r"part-00001_text_document.manifest.json: block_sha256"):
        pull(str(root / "blends" / "one" / "manifest.json"), tmp_path / "copy")


def test_inspect_and_verify_take_a_virtual_merge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    physical, virtual = _merges(tmp_path, "docs", [5, 7], seed=4)
    assert main(["inspect", str(virtual)]) == 0
    shown = capsys.readouterr().out
    assert main(["inspect", str(physical)]) == 0
    assert shown.split("\n", 1)[1] == capsys.readouterr().out.split("\n", 1)[1]
    assert main(["verify", str(virtual)]) == 0
    shard = tmp_path / "tokens" / "docs" / "part-00000_text_document.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["verify", str(virtual)]) == 1
    assert "sha256" in capsys.readouterr().out


def test_gc_removes_an_old_virtual_version_and_keeps_the_current_readable(
    tmp_path: Path,
) -> None:
    from tokenmill.storage.versions import write_pointer
    from tokenmill.tokenize.merged_versions import extends, merged_version

    shards = _shards(tmp_path / "tokens" / "docs", [5, 8, 6], seed=30)
    keyed = [(p.name.removesuffix("_text_document"), p) for p in shards]
    folder = tmp_path / "merged" / "docs"
    made = []
    for n in (2, 3):
        ids = [(k, read_dataset_manifest(p)["content_hash"]) for k, p in keyed[:n]]
        version = merged_version("text", ids, "virtual")
        previous = made[-1] if made else None
        base = extends(previous[0], read_dataset_manifest(previous[1]), ids) if previous else None
        prefix = folder / version[:16] / "docs_text_document"
        virtual_merge(keyed[:n], prefix, extends=base)
        write_pointer(folder / "current.json", version, f"{version[:16]}/{prefix.name}")
        made.append((version, prefix))
    assert read_dataset_manifest(made[1][1])["extends"] == made[0][0]
    out = tmp_path / "blends" / "mix"
    build_blend(
        "mix",
        {"docs": made[1][1]},
        out,
        tmp_path / "nanoset",
        BlendSettings(NanosetSettings(sequence_length=4, train_samples=12), weights={"docs": 1}),
    )
    assert main(["gc", str(tmp_path), "--keep", "1"]) == 0
    assert not made[0][1].parent.exists() and made[1][1].parent.is_dir()
    assert all(Path(f"{p}.bin").is_file() for p in shards)  # shards are read in place
    assert len(open_blend(out, "train", verify="full")) == 12


def test_tokenmill_merge_versions_makes_reuses_and_extends_versions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tokenmill merge --versions DIR`` lays versions out as the pipeline's ``merged/<ds>/``:
    the version is the library's hash of the shards (the asset's), unchanged shards keep it and
    write nothing, appended shards extend it, reordered ones do not."""
    shards = _shards(tmp_path / "tokens" / "docs", [5, 8, 3, 6], seed=2)
    folder = tmp_path / "merged" / "docs"

    def merge(*inputs: Path, mode: str = "virtual") -> dict:
        args = ["merge", "--input", *map(str, inputs), "--versions", str(folder), "--merge", mode]
        assert main(args) == 0
        record = read_pointer(folder / "current.json")
        assert record is not None
        return record

    first = merge(*shards[:2])
    keys = [(p.name.removesuffix("_text_document"), p) for p in shards]
    identities = [(k, str(read_dataset_manifest(p)["content_hash"])) for k, p in keys[:2]]
    assert first["version"] == merged_version("text", identities, "virtual")
    out = folder / str(first["target"])
    assert out == folder / first["version"][:16] / "docs_text_document"
    physical = merge_datasets(shards[:2], tmp_path / "physical" / "docs_text_document").prefix
    with open_dataset(physical) as p, open_dataset(out) as v:
        assert [v[i].tolist() for i in range(len(v))] == [p[i].tolist() for i in range(len(p))]
    written = dataset_manifest_path(out).stat().st_mtime_ns
    assert merge(*shards[:2]) == first and "reused" in capsys.readouterr().out
    assert dataset_manifest_path(out).stat().st_mtime_ns == written

    grown = merge(*shards)
    assert grown["version"] != first["version"]
    assert read_dataset_manifest(folder / str(grown["target"]))["extends"] == first["version"]
    assert verify_dataset(out) == []  # the old version stays as it was
    reordered = merge(shards[1], shards[0], *shards[2:])
    assert read_dataset_manifest(folder / str(reordered["target"]))["extends"] is None

    copied = merge(*shards[:2], mode="physical")
    target = folder / str(copied["target"])
    for suffix in (".bin", ".idx"):
        assert Path(f"{target}{suffix}").read_bytes() == Path(f"{physical}{suffix}").read_bytes()


@pytest.mark.parametrize("flag", [["--name", "x"], ["--text-key", "t"], ["--merge", "physical"]])
def test_merge_options_of_versions_are_refused_without_it(
    tmp_path: Path, flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    shards = _shards(tmp_path / "tokens" / "docs", [3, 2], seed=4)
    args = ["merge", "--input", *map(str, shards), "--output-prefix", str(tmp_path / "o"), *flag]
    assert main(args) == 2
    assert f"{flag[0]} applies to --versions only" in capsys.readouterr().err
    assert not (tmp_path / "o.bin").exists()
