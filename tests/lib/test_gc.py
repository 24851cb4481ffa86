"""``tokenmill gc``: exactly the old, unreferenced versions and cache entries go; current,
pinned and referenced ones stay; dry runs remove nothing; S3 roots work the same way."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_versions import make_merged

from tokenmill.atomic import TMP_DIR
from tokenmill.cli import main
from tokenmill.formats.dataset_manifest import (
    read_dataset_manifest,
)
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.nanoset import build_or_load
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.loader import open_blend
from tokenmill.storage.gc import gc
from tokenmill.storage.pull import pull
from tokenmill.storage.versions import write_pointer

DAY = 86400


def merged_version(root: Path, ds: str, digit: str, seed: int) -> Path:
    """``merged/<ds>/<v16>/<ds>_text_document`` made current through ``current.json``."""
    version = digit * 64
    prefix = root / f"merged/{ds}/{digit * 16}/{ds}_text_document"
    make_merged(prefix, 60, seed)
    write_pointer(root / f"merged/{ds}/current.json", version, f"{digit * 16}/{prefix.name}")
    return prefix


def blend(root: Path, docs: Path, code: Path) -> str:
    manifest = build_blend(
        "mix",
        {"docs": docs, "code": code},
        root / "blends/mix",
        root / "nanoset",
        BlendSettings(
            NanosetSettings(sequence_length=8, split_spec="90,10,0", train_samples=40),
            weights={"docs": 0.5, "code": 0.5},
        ),
    )
    return str(manifest["version"])


def age(paths: list[Path], days: float) -> None:
    when = time.time() - days * DAY
    for path in paths:
        for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
            os.utime(p, (when, when))


def tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def store(tmp_path: Path) -> dict:
    """Three refreshes: docs v1 -> v2 -> v3 (code v1 throughout), one blend version each,
    aged 30, 10 and 0 days; the caches of each blend version recorded."""
    root = tmp_path / "root"
    code = merged_version(root, "code", "c", 9)
    versions, caches, docs = [], [], []
    for digit, days, seed in (("1", 30, 1), ("2", 10, 2), ("3", 0, 3)):
        before = tree(root / "nanoset") if (root / "nanoset").exists() else set()
        docs.append(merged_version(root, "docs", digit, seed))
        versions.append(blend(root, docs[-1], code))
        caches.append(tree(root / "nanoset") - before)
        age([root / f"blends/mix/versions/{versions[-1][:16]}", docs[-1].parent], days)
        age([root / "nanoset" / name for name in caches[-1]], days)
    return {"root": root, "versions": versions, "caches": caches, "docs": docs}


def files_of(root: Path, folder: str) -> set[str]:
    return {f"{folder}/{name}" for name in tree(root / folder)}


def test_keep_one_removes_exactly_the_old_versions_and_their_caches(store: dict) -> None:
    root, (v1, v2, v3) = store["root"], store["versions"]
    current = open_blend(root / "blends/mix")
    batch = current.get_batch(np.arange(len(current)))
    before = tree(root)
    expected = set()
    for version, docs in zip((v1, v2), store["docs"], strict=False):
        expected |= files_of(root, f"blends/mix/versions/{version[:16]}")
        expected |= files_of(root, docs.parent.relative_to(root).as_posix())
        content = read_dataset_manifest(docs)["content_hash"]
        for description in (root / "nanoset").glob("*-description.json"):  # docs caches only
            if json.loads(description.read_text())["key"]["dataset_content_hash"] == content:
                stem = description.name.removesuffix("-description.json")
                expected |= {f"nanoset/{p.name}" for p in (root / "nanoset").glob(f"{stem}-*")}
    assert len([k for k in expected if k.startswith("nanoset/")]) == 2 * 2 * 4  # 2 splits
    sizes = {k: (root / k).stat().st_size for k in expected}
    old_docs = [d.parent for d in store["docs"][:2]]
    assert all((folder / TMP_DIR).is_dir() for folder in old_docs)  # its writers' (empty)
    dry = gc(root, keep=1, dry_run=True)
    assert tree(root) == before  # a dry run removes nothing
    assert {k for r in dry.removed for k in r.keys} == expected
    report = gc(root, keep=1)
    assert {k for r in report.removed for k in r.keys} == expected
    assert tree(root) == before - expected
    assert sorted((r.kind, r.version) for r in report.removed if r.kind != "nanoset") == [
        ("blend", v1[:16]),
        ("blend", v2[:16]),
        ("merged", "1" * 16),
        ("merged", "2" * 16),
    ]
    assert report.bytes == dry.bytes == sum(sizes.values())
    survivor = open_blend(root / "blends/mix", verify="full")
    assert survivor.version == v3
    assert np.array_equal(survivor.get_batch(np.arange(len(batch))), batch)
    assert not (root / "blends/mix/versions" / v1[:16]).exists()
    assert not [folder for folder in old_docs if folder.exists()]  # .tmp/ did not keep them
    assert gc(root, keep=1).removed == []  # nothing more to do


def test_pinned_and_referenced_versions_stay(store: dict) -> None:
    root, (v1, v2, v3) = store["root"], store["versions"]
    pinned = open_blend(root / "blends/mix", version=v1)
    batch = pinned.get_batch(np.arange(len(pinned)))
    report = gc(root, keep=0, keep_versions=[v1])
    removed = {(r.kind, r.version) for r in report.removed if r.kind != "nanoset"}
    assert removed == {("blend", v2[:16]), ("merged", "2" * 16)}  # docs v1: v1 reads it
    again = open_blend(root / "blends/mix", version=v1[:16], verify="full")
    assert np.array_equal(again.get_batch(np.arange(len(again))), batch)
    assert open_blend(root / "blends/mix").version == v3  # current, with --keep 0
    assert (root / "merged/code/cccccccccccccccc").is_dir()


def test_older_than_spares_recent_versions(store: dict) -> None:
    root, (v1, v2, _) = store["root"], store["versions"]
    report = gc(root, keep=0, older_than_days=20)
    assert {(r.kind, r.version) for r in report.removed if r.kind != "nanoset"} == {
        ("blend", v1[:16]),
        ("merged", "1" * 16),
    }
    assert {r.keys[0].split("/")[0] for r in report.removed} == {"blends", "merged", "nanoset"}
    assert (root / "blends/mix/versions" / v2[:16] / "manifest.json").is_file()


def test_cli_prints_one_line_per_removal_and_totals(
    store: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    root, (v1, v2, _) = store["root"], store["versions"]
    assert main(["gc", str(root), "--keep", "1", "--keep-version", v2[:16], "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"would remove blend mix {v1[:16]}: ") for line in out)
    assert not any(v2[:16] in line for line in out)
    assert out[-1].startswith("total: would remove 2 versions and ")
    assert (root / "blends/mix/versions" / v1[:16]).is_dir()
    assert main(["gc", str(root), "--keep", "1", "--keep-version", "xyz"]) == 2


def test_a_version_without_manifest_is_left_alone(store: dict) -> None:
    """A build or an upload in progress (no manifest yet) is not a version gc may judge."""
    root = store["root"]
    partial = root / "blends/mix/versions/abcdefabcdefabcd"
    partial.mkdir()
    (partial / "train-dataset_index.npy").write_bytes(b"x")
    age([partial], 100)
    report = gc(root, keep=0)
    assert (partial / "train-dataset_index.npy").is_file()
    assert [line.split(":")[0] for line in report.incomplete] == ["blend mix abcdefabcdefabcd"]
    assert any(
        line.startswith("left alone: blend mix abcdefabcdefabcd: no manifest")
        for line in report.lines()
    )


def test_s3_root(store: dict, s3: Any, tmp_path: Path) -> None:
    """The same selection on ``s3://bucket/prefix`` (all uploaded at once: ``--keep 0`` keeps
    only what is current or referenced); the blend still pulls and opens afterwards."""
    root, (v1, v2, v3) = store["root"], store["versions"]
    s3.upload_tree(root, "data")
    local = gc(root, keep=0, dry_run=True)
    uri = f"s3://{s3.bucket}/data"
    assert main(["gc", uri, "--keep", "0", "--dry-run", "--endpoint-url", s3.endpoint]) == 0
    report = gc(uri, keep=0)
    assert {(r.kind, r.version) for r in report.removed if r.kind != "nanoset"} == {
        ("blend", v1[:16]),
        ("blend", v2[:16]),
        ("merged", "1" * 16),
        ("merged", "2" * 16),
    }
    gone = {k for r in report.removed for k in r.keys}
    assert gone == {k for r in local.removed for k in r.keys}
    assert s3.keys("data/") == sorted(f"data/{k}" for k in tree(root) - gone)
    pulled = pull(f"{uri}/blends/mix/manifest.json", tmp_path / "dest")
    assert open_blend(pulled.manifest, verify="full").version == v3


def test_an_unversioned_pair_and_its_caches_stay(store: dict) -> None:
    """``merged/<prefix>`` pairs outside any version are never removed, nor the cache entries
    built for their content (``merged/manifests/`` is not taken for a dataset)."""
    root = store["root"]
    flat = make_merged(root / "merged/flat_text_document", 60, 7)
    build_or_load(flat, root / "nanoset", "train", NanosetSettings(sequence_length=8))
    ours = {k for k in tree(root) if "flat" in k}
    entry = {f"nanoset/{p.name}" for p in (root / "nanoset").iterdir() if p.is_file()} - {
        k for c in store["caches"] for k in (f"nanoset/{n}" for n in c)
    }
    assert entry and ours
    age([root / k for k in ours | entry], 30)
    report = gc(root, keep=1)
    removed = {k for r in report.removed for k in r.keys}
    assert not removed & (ours | entry)
    assert {r.name for r in report.removed if r.kind == "merged"} == {"docs"}
    assert (ours | entry) <= tree(root)


@pytest.mark.parametrize("damage", ["truncated", "not JSON", "missing", "deep", "huge int"])
def test_an_unreadable_blend_pointer_stops_gc(
    store: dict, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The blend pointer names the current version: unreadable, gc cannot tell which version
    must stay, so it removes nothing and exits 1 naming the pointer (as for a merged one)."""
    root = store["root"]
    pointer = root / "blends/mix/manifest.json"
    raw = pointer.read_bytes()
    if damage == "missing":
        pointer.unlink()
    else:
        pointer.write_bytes(
            {
                "truncated": raw[: len(raw) // 2],
                "not JSON": b"\x00garbage",
                "deep": b"[" * 100_000,
                "huge int": b'{"version": ' + b"7" * 5000 + b"}",
            }[damage]
        )
    before = tree(root)
    assert main(["gc", str(root), "--keep", "0"]) == 1
    err = capsys.readouterr().err
    assert "blends/mix/manifest.json: pointer:" in err and "gc stops" in err
    assert "Traceback" not in err
    assert tree(root) == before


@pytest.mark.parametrize("refresh", ["new version", "back to an old version"])
def test_a_refresh_between_listings_keeps_what_it_made_current(
    store: dict, refresh: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refresh lands after gc listed ``blends/`` and ``merged/`` but before ``nanoset/``: the
    version it made current, its merged datasets and its index caches all stay."""
    from tokenmill.storage.store import LocalStore

    root = store["root"]
    code = root / "merged/code/cccccccccccccccc/code_text_document"
    listing = LocalStore.files
    made: list[str] = []

    def files(self: LocalStore, top: str) -> Any:
        if top == "nanoset" and not made:
            if refresh == "new version":
                made.append(blend(root, merged_version(root, "docs", "4", 4), code))
            else:  # a rebuild of the inputs of v2 (e.g. a reverted edit): v2 is current again
                made.append(blend(root, store["docs"][1], code))
        return listing(self, top)

    monkeypatch.setattr(LocalStore, "files", files)
    gc(root, keep=1)
    assert made
    survivor = open_blend(root / "blends/mix", verify="full")
    assert survivor.version == made[0]


@pytest.mark.parametrize("victim", ["blend", "merged", "nanoset"])
def test_a_gc_killed_mid_removal_is_finished_by_the_next(
    store: dict,
    victim: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Killed after a version's manifest (an entry's description) went but before its data: the
    next gc finds the tombstone, removes the rest and says so; nothing stays behind forever."""
    from tokenmill.storage.store import LocalStore

    root, v2 = store["root"], store["versions"][1]
    folder = {
        "blend": f"blends/mix/versions/{v2[:16]}/",
        "merged": "merged/docs/2222222222222222/",
        "nanoset": "nanoset/",
    }[victim]
    real = LocalStore.delete
    killed: list[str] = []

    def delete(self: LocalStore, keys: Any) -> None:
        if not killed and len(keys) > 1 and all(k.startswith(folder) for k in keys):
            killed.extend(keys)  # the commit file went; the kill lands before the data
            raise KeyboardInterrupt
        real(self, keys)

    monkeypatch.setattr(LocalStore, "delete", delete)
    with pytest.raises(KeyboardInterrupt):
        gc(root, keep=1)
    monkeypatch.setattr(LocalStore, "delete", real)
    assert killed and all((root / k).is_file() for k in killed)
    assert main(["gc", str(root), "--keep", "1"]) == 0
    out = capsys.readouterr().out
    assert (
        f"finished removing {victim} " in out and "(an interrupted gc left it half-removed)" in out
    )
    assert not any((root / k).exists() for k in killed)
    assert not any("gc-removing" in k for k in tree(root))
    if victim != "nanoset":
        assert not (root / folder).exists()
    assert open_blend(root / "blends/mix", verify="full").version == store["versions"][2]


def test_a_pin_matching_nothing_is_refused_unless_forced(
    store: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--keep-version`` with a typo would remove the version it meant to keep: refused (exit
    2, the known versions listed, nothing removed) unless ``--force``."""
    root, (v1, _, _) = store["root"], store["versions"]
    typo = "f" + v1[1:16]
    before = tree(root)
    assert main(["gc", str(root), "--keep", "1", "--keep-version", typo]) == 2
    err = capsys.readouterr().err
    assert f"--keep-version {typo}: matches no blend or merged version" in err
    assert f"blend mix {v1[:16]}" in err and "merged docs 1111111111111111" in err
    assert "--force" in err
    assert tree(root) == before
    assert main(["gc", str(root), "--keep", "1", "--keep-version", typo, "--force"]) == 0
    assert not (root / "blends/mix/versions" / v1[:16]).exists()


def test_a_worker_reopening_a_removed_version_gets_a_cache_error(store: dict) -> None:
    """A DataLoader worker (re)started after gc removed the job's unpinned version unpickles
    its dataset: a CacheError naming the blend version and ``tokenmill gc``, not a bare
    FileNotFoundError on some index file."""
    import pickle

    from tokenmill.errors import CacheError

    root, v1 = store["root"], store["versions"][0]
    job = pickle.dumps(open_blend(root / "blends/mix", version=v1))
    gc(root, keep=1)
    with pytest.raises(CacheError) as caught:
        pickle.loads(job)
    message = str(caught.value)
    assert v1 in message and "tokenmill gc" in message and "--keep-version" in message
    nano = open_blend(root / "blends/mix").datasets["docs"]
    job = pickle.dumps(nano)
    for path in (root / "nanoset").glob(f"{nano.version}-*"):
        path.unlink()
    with pytest.raises(CacheError, match=f"index cache {nano.version}.*tokenmill gc"):
        pickle.loads(job)


def test_a_rebuild_over_a_half_removed_entry_is_left_alone(store: dict) -> None:
    """Files newer than a tombstone belong to a build that reuses the name (e.g. a Nanoset
    entry rebuilt after an interrupted removal): gc does not finish that removal over it."""
    root = store["root"]
    stem = next(iter(store["caches"][0])).rsplit("-", 1)[0]
    stem = "-".join(stem.split("-")[:3])
    (root / f"nanoset/{stem}-description.json").unlink()  # the removal's first step
    tomb = root / f"nanoset/{stem}-gc-removing.json"
    tomb.write_text("{}")
    age([tomb], 100)  # the entry files (30 days old) were written after it
    rebuilt = sorted((root / "nanoset").glob(f"{stem}-*.npy"))
    assert rebuilt
    report = gc(root, keep=1)
    assert not report.finished and all(p.is_file() for p in rebuilt)
