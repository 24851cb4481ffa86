"""``tokenmill pull``: exact file set, round trip through open_blend, resume, corruption, S3."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from prod_servers import S3

from tokenmill.atomic import TMP_DIR
from tokenmill.cli import main
from tokenmill.errors import CacheError, FormatError, InputError
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.loader import open_blend
from tokenmill.storage.pull import pull

MANIFEST = Path("blends/mix/manifest.json")


def files_under(root: Path) -> dict[str, bytes]:
    """``{relative path: content}`` of every file under ``root``."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def expected_files(src: Path) -> dict[str, bytes]:
    """What a pull of blend ``mix`` must copy: all but the shards and the index builders' locks."""
    return {
        k: v
        for k, v in files_under(src).items()
        if not k.startswith("tokens/") and not k.endswith(".lock")
    }


def assert_same_blend(a: Path, b: Path) -> None:
    """Both manifests open (full verification) and give identical samples in every split."""
    for split in ("train", "valid"):
        left, right = open_blend(a, split, verify="full"), open_blend(b, split, verify="full")
        assert len(left) == len(right) > 0
        everything = np.arange(len(left))
        np.testing.assert_array_equal(left.get_batch(everything), right.get_batch(everything))


def test_local_pull_copies_exactly_the_needed_files(storage_root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    report = pull(str(storage_root / MANIFEST), dest)
    assert report.manifest == dest / MANIFEST
    assert files_under(dest) == expected_files(storage_root)
    # not counted: the pointer, its version's manifest and the two dataset manifests
    assert len(report.fetched) == len(expected_files(storage_root)) - 4
    assert report.skipped == []
    assert report.bytes_fetched == sum(
        len(v) for k, v in expected_files(storage_root).items() if not k.endswith("manifest.json")
    )
    assert_same_blend(storage_root / MANIFEST, report.manifest)


def test_pull_a_named_version(storage_root: Path, tmp_path: Path) -> None:
    """After a refresh, ``--version`` pulls the previous version (manifest and files), which
    opens with the batches it had; the current pull carries the current version's manifest."""
    old = open_blend(storage_root / MANIFEST)
    before = old.get_batch(np.arange(len(old)))
    nanoset = NanosetSettings(sequence_length=16, split_spec="90,10,0", train_samples=300)
    settings = BlendSettings(nanoset, weights={"docs": 0.5, "code": 0.5})
    merged = {n: storage_root / f"merged/{n}_text_document" for n in ("docs", "code")}
    build_blend("mix", merged, storage_root / "blends/mix", storage_root / "nanoset", settings)
    assert open_blend(storage_root / MANIFEST).version != old.version
    dest = tmp_path / "dest"
    assert main(["pull", str(storage_root / MANIFEST), str(dest), "--version", old.version]) == 0
    short = f"blends/mix/versions/{old.version[:16]}/manifest.json"
    assert not (dest / MANIFEST).exists() and (dest / short).is_file()
    copy = open_blend(dest / MANIFEST, version=old.version[:16], verify="full")
    assert copy.version == old.version
    np.testing.assert_array_equal(copy.get_batch(np.arange(len(copy))), before)
    report = pull(str(storage_root / MANIFEST), dest)  # the current one beside it
    current = open_blend(report.manifest, verify="full")
    assert current.version == open_blend(dest / MANIFEST, version=current.version).version
    with pytest.raises(InputError, match=f"no version {'0' * 16} of the blend there"):
        pull(str(storage_root / MANIFEST), dest, version="0" * 16)


def test_second_pull_skips_everything(storage_root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    first = pull(str(storage_root / "blends" / "mix"), dest)  # the folder means its manifest
    mtimes = {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file()}
    again = pull(str(storage_root / MANIFEST), dest)
    assert again.fetched == [] and sorted(again.skipped) == sorted(first.fetched)
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file()} == mtimes


def test_resume_refetches_only_partial_files(storage_root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    pull(str(storage_root / MANIFEST), dest)
    merged_bin = dest / "merged" / "docs_text_document.bin"
    with open(merged_bin, "r+b") as fh:  # an interrupted copy: the first half only
        fh.truncate(merged_bin.stat().st_size // 2)
    (dest / MANIFEST).unlink()
    stale = dest / "merged" / TMP_DIR / "code_text_document.idx.tmp-4194305-abcd"
    stale.write_bytes(b"left by a killed pull")  # no pid is above 2**22
    untouched = dest / "merged" / "code_text_document.bin"
    before = untouched.stat().st_mtime_ns

    report = pull(str(storage_root / MANIFEST), dest)

    assert report.fetched == ["merged/docs_text_document.bin"]
    assert not stale.exists()
    assert untouched.stat().st_mtime_ns == before
    assert files_under(dest) == expected_files(storage_root)
    assert_same_blend(storage_root / MANIFEST, dest / MANIFEST)


def test_a_different_manifest_in_dest_is_removed_before_pulling(
    storage_root: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    pull(str(storage_root / MANIFEST), dest)
    manifest = json.loads((dest / MANIFEST).read_text())
    manifest["seed"] = 99
    (dest / MANIFEST).write_text(json.dumps(manifest))
    for root in (storage_root, dest):  # the new version cannot complete: a file is gone
        (root / "merged" / "code_text_document.bin").unlink()
    with pytest.raises(InputError, match=r"code_text_document.bin .*'code' bin.*missing"):
        pull(str(storage_root / MANIFEST), dest)
    assert not (dest / MANIFEST).exists()


@pytest.mark.parametrize(
    ("relative", "why"),
    [
        ("merged/docs_text_document.bin", "sha256 of part 1 "),  # merged: checked by parts
        ("merged/code_text_document.bin", "sha256 differs from the manifest"),
        ("blends/mix/versions/*/train-dataset_index.npy", "sha256 differs from the manifest"),
    ],
)
def test_corrupted_source_is_refused(
    storage_root: Path, tmp_path: Path, relative: str, why: str
) -> None:
    (path,) = storage_root.glob(relative)
    relative = path.relative_to(storage_root).as_posix()
    data = bytearray(path.read_bytes())
    if relative.startswith("merged/docs"):  # a byte inside the second shard's range
        data[len(data) // 2] ^= 0xFF
    else:
        data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    with pytest.raises(CacheError) as err:
        pull(str(storage_root / MANIFEST), dest)
    assert str(err.value).startswith(f"{path} (")
    assert why in str(err.value) and str(err.value).endswith("; not pulled")
    assert not (dest / relative).exists()
    assert not (dest / MANIFEST).exists()
    assert main(["pull", str(storage_root / MANIFEST), str(dest)]) == 1


def test_dataset_manifest_disagreeing_with_the_blend_is_refused(
    storage_root: Path, tmp_path: Path
) -> None:
    path = storage_root / "merged" / "manifests" / "code_text_document.manifest.json"
    recorded = json.loads(path.read_text())
    recorded["files"]["code_text_document.idx"]["sha256"] = "0" * 64
    path.write_text(json.dumps(recorded))
    with pytest.raises(FormatError, match=r"files\.code_text_document\.idx: records .* changed"):
        pull(str(storage_root / MANIFEST), tmp_path / "dest")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("/etc/passwd", "is not a relative path"),
        ("../nanoset/../../x.bin", "'..' after a folder name"),
        ("../" * 64 + "x.bin", "points outside the source root"),
    ],
)
def test_paths_escaping_the_layout_are_refused(
    storage_root: Path, tmp_path: Path, bad: str, message: str
) -> None:
    path = storage_root / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["splits"]["train"]["files"]["dataset_index"]["path"] = bad
    path.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=message):
        pull(str(path), tmp_path / "dest")
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").rglob("*.npy"))


def test_s3_pull_from_moto_server(
    s3: S3, storage_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s3.upload_tree(storage_root, "data/v1")
    uri = f"s3://{s3.bucket}/data/v1/blends/mix/manifest.json"
    dest = tmp_path / "dest"
    report = pull(uri, dest, jobs=3)
    assert report.manifest == dest / MANIFEST
    assert files_under(dest) == expected_files(storage_root)
    assert_same_blend(storage_root / MANIFEST, report.manifest)

    os.truncate(dest / "merged" / "code_text_document.bin", 10)
    folder_uri = f"s3://{s3.bucket}/data/v1/blends/mix/"
    assert main(["pull", folder_uri, str(dest), "--endpoint-url", s3.endpoint]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pulled 1 files (")
    assert str(dest / MANIFEST) in out
    assert files_under(dest) == expected_files(storage_root)


def test_s3_missing_object_and_manifest(s3: S3, storage_root: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=f"s3://{s3.bucket}/nothing/manifest.json: no blend"):
        pull(f"s3://{s3.bucket}/nothing", tmp_path / "dest")
    s3.upload_tree(storage_root, "v2")
    s3.client.delete_object(Bucket=s3.bucket, Key="v2/nanoset/" + _one_index_file(storage_root))
    with pytest.raises(InputError, match=r"s3://.*/v2/nanoset/.*index.*: missing at the source"):
        pull(f"s3://{s3.bucket}/v2/blends/mix/manifest.json", tmp_path / "dest")
    assert not (tmp_path / "dest" / MANIFEST).exists()


def _one_index_file(root: Path) -> str:
    """The name of the first Nanoset index array under ``root/nanoset``."""
    return sorted(p.name for p in (root / "nanoset").glob("*_index.npy"))[0]
