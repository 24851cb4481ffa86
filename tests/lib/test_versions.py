"""Versioned blends: immutable versions behind an atomic pointer, reuse of an unchanged build,
failed builds that move nothing, pinned versions, O(1) opens and pickles, no ``.bin`` read."""

from __future__ import annotations

import errno
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from tiny_pairs import MIX, blend_values, build_blend_at, random_pair

from tokenmill.atomic import TMP_DIR, file_sha256
from tokenmill.cli import main
from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats import blend_manifest as blend_reader
from tokenmill.formats import dataset_manifest
from tokenmill.formats.blend_manifest import read_blend_manifest
from tokenmill.formats.dataset_manifest import (
    bin_parts,
    read_dataset_manifest,
    write_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.indices import blend_build as blend_manifest
from tokenmill.indices import blend_plan
from tokenmill.indices.blend_versioning import prepare_blend
from tokenmill.indices.nanoset import build_or_load
from tokenmill.indices.settings import NanosetSettings
from tokenmill.loader import open_blend, open_nanoset
from tokenmill.storage import versions as pointer_store
from tokenmill.verify import verify_blend

S = 8


def make_merged(prefix: Path, n_docs: int, seed: int, dtype: type = np.uint16) -> Path:
    """A merged dataset whose manifest records the ``.bin`` by parts (two shards)."""
    first = random_pair(prefix.parent / "shards" / "a", n_docs // 2, seed, dtype)
    second = random_pair(prefix.parent / "shards" / "b", n_docs - n_docs // 2, seed + 1, dtype)
    with IndexedDatasetWriter(prefix, dtype) as writer:
        writer.add_index(first)
        writer.add_index(second)
    parts = bin_parts(first) + bin_parts(second)
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={}, bin_parts=parts)
    return prefix


@pytest.fixture
def root(tmp_path: Path) -> Path:
    make_merged(tmp_path / "merged/docs/v1/docs_text_document", 120, 1)
    make_merged(tmp_path / "merged/code/v1/code_text_document", 80, 3, np.int32)
    return tmp_path


# The blend every test here builds (``build``) or names (``prepare_blend``).
SETTINGS: dict = {**MIX, "sequence_length": S}


def mix_datasets(root: Path, docs: str = "v1") -> dict[str, Path]:
    return {
        "docs": root / f"merged/docs/{docs}/docs_text_document",
        "code": root / "merged/code/v1/code_text_document",
    }


def build(root: Path, docs: str = "v1", **kw: object) -> dict:
    return build_blend_at(root, "mix", mix_datasets(root, docs), **{**SETTINGS, **kw})


def files(top: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under ``top``: bytes, inode and mtime (a rewrite changes the last two)."""
    return {
        p.relative_to(top).as_posix(): (p.read_bytes(), p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(top.rglob("*"))
        if p.is_file()
    }


def everything(ds: object) -> np.ndarray:
    return ds.get_batch(np.arange(len(ds)))  # type: ignore[attr-defined]


def test_rebuilding_an_unchanged_blend_reuses_its_version(root: Path) -> None:
    first = build(root)
    v16 = first["version"][:16]
    before = files(root / "blends")
    assert sorted(before) == [
        "mix/manifest.json",
        *(f"mix/versions/{v16}/{n}" for n in sorted(["manifest.json", *ARRAYS])),
    ]
    assert build(root) == first
    assert files(root / "blends") == before  # nothing rewritten: same inodes and mtimes
    assert open_blend(root / "blends/mix").version == first["version"]


ARRAYS = [f"{s}-{a}.npy" for s in ("train", "valid", "test") for a in blend_reader.BLEND_ARRAYS]


def test_the_version_names_every_input(root: Path) -> None:
    base = build(root)["version"]
    make_merged(root / "merged/docs/v2/docs_text_document", 120, 7)
    changed = [
        build(root, seed=6),
        build(root, weights={"docs": 0.6, "code": 0.4}),
        build(root, train_samples=52),
        build(root, sequence_length=S + 1),
        build(root, split_spec="80,15,5"),
        build(root, semantics="nanotron"),
        build(root, docs="v2"),
    ]
    versions = [m["version"] for m in changed]
    assert base not in versions and len(set(versions)) == len(versions)
    assert build(root)["version"] == base  # back to the first settings: the first version
    assert len(list((root / "blends/mix/versions").glob("*/manifest.json"))) == 1 + len(changed)


def test_a_process_keeps_reading_its_version_while_refreshes_land(root: Path) -> None:
    old = build(root)
    ds = open_blend(root / "blends/mix")
    assert ds.version == old["version"]
    before = everything(ds)
    make_merged(root / "merged/docs/v2/docs_text_document", 120, 7)  # new content: a refresh
    new = build(root, docs="v2")
    assert new["version"] != old["version"]
    current = open_blend(root / "blends/mix")
    assert current.version == new["version"] and not np.array_equal(everything(current), before)
    assert np.array_equal(everything(ds), before)  # the open object: the same bytes
    for version in (old["version"], old["version"][:16]):
        pinned = open_blend(root / "blends/mix/manifest.json", version=version, verify="full")
        assert pinned.version == old["version"]
        assert np.array_equal(everything(pinned), before)
    make_merged(root / "merged/docs/v3/docs_text_document", 120, 9)
    assert build(root, docs="v3")["version"] not in (old["version"], new["version"])
    pinned = open_blend(root / "blends/mix", version=old["version"])  # two refreshes later
    assert np.array_equal(everything(pinned), before)
    # The version's own manifest opens directly, and names its siblings the same way.
    own = root / f"blends/mix/versions/{old['version'][:16]}/manifest.json"
    assert np.array_equal(everything(open_blend(own)), before)
    assert open_blend(own, version=new["version"]).version == new["version"]


def test_an_absent_version_lists_the_available_ones(root: Path) -> None:
    v16 = build(root)["version"][:16]
    with pytest.raises(ConfigError, match=f"blend version {'a' * 16} is not there.*: {v16}"):
        open_blend(root / "blends/mix", version="a" * 16)
    with pytest.raises(ConfigError, match="expected the blend version"):
        open_blend(root / "blends/mix", version="../x")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG])
def test_a_failed_build_moves_nothing(
    root: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """np.save fails after the first array (a full disk, a file too large): the pointer and the
    previous version keep their bytes, and no file of the new version is left."""
    build(root)
    before = files(root / "blends")
    ds = open_blend(root / "blends/mix")
    real, saved = np.save, []

    def failing_save(fh: object, arr: object, **kw: object) -> None:
        if saved:
            raise OSError(code, "simulated")
        saved.append(fh)
        real(fh, arr, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(blend_manifest.np, "save", failing_save)
    with pytest.raises(OSError, match="simulated"):
        build(root, seed=6)
    monkeypatch.undo()
    assert len(saved) == 1
    assert files(root / "blends") == before
    assert np.array_equal(everything(open_blend(root / "blends/mix")), everything(ds))


def test_a_failed_build_after_the_version_keeps_the_pointer(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pointer write fails (after the new version is complete): the old pointer stays; the
    next build reuses the complete version and moves the pointer."""
    build(root)
    pointer = (root / "blends/mix/manifest.json").read_bytes()
    real = pointer_store.write_bytes  # the pointer moves through swap_pointer

    def failing_pointer(path: Path, data: bytes) -> None:
        if Path(path).parent.name == "mix":
            raise OSError(errno.ENOSPC, "simulated")
        real(path, data)

    monkeypatch.setattr(pointer_store, "write_bytes", failing_pointer)
    with pytest.raises(OSError, match="simulated"):
        build(root, seed=6)
    monkeypatch.undo()
    assert (root / "blends/mix/manifest.json").read_bytes() == pointer
    versions = sorted(p.name for p in (root / "blends/mix/versions").iterdir() if p.name != TMP_DIR)
    assert len(versions) == 2 and not list((root / "blends/mix/versions" / TMP_DIR).iterdir())
    new = build(root, seed=6)
    assert (
        new["version"][:16] in versions
        and open_blend(root / "blends/mix").version == (new["version"])
    )


def test_merged_datasets_are_recorded_by_their_parts_and_never_read(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blend copies the digests and content hash from each dataset's manifest: the
    ``.bin`` is never hashed nor read (same-size bytes changed behind the manifest's back go
    unnoticed by the build; only a full verification finds them)."""
    docs = root / "merged/docs/v1/docs_text_document"
    recorded = read_dataset_manifest(docs)
    path = Path(f"{docs}.bin")
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF  # the recorded parts no longer hash to these bytes
    path.write_bytes(bytes(data))
    hashed: list[str] = []
    for module in (
        blend_plan,
        blend_reader,
        dataset_manifest,
    ):
        real = module.file_sha256
        monkeypatch.setattr(
            module,
            "file_sha256",
            lambda p, *a, real=real: hashed.append(str(p)) or real(p, *a),
        )
    manifest = build(root)
    assert not [p for p in hashed if p.endswith(".bin")]
    entry = manifest["datasets"][0]["files"]["bin"]
    digests = {k: v for k, v in recorded["files"][path.name].items() if not k.startswith("block")}
    assert {k: v for k, v in entry.items() if k != "path"} == digests  # block hashes stay there
    assert set(entry) == {"path", "bytes", "parts", "sha256_of_parts"}
    assert manifest["datasets"][0]["content_hash"] == recorded["content_hash"]
    problems = verify_blend(root / "blends/mix", full=True)
    assert any("docs_text_document.bin: sha256 of part 0" in p for p in problems)


def test_a_bin_recorded_by_sha256_and_parts_is_checked_by_its_sha256(tmp_path: Path) -> None:
    """A ``.bin`` entry holding both ``sha256`` and ``parts`` is checked against its
    ``sha256``, the digest its content hash uses: a wrong one is a problem even when every
    part matches."""
    prefix = make_merged(tmp_path / "merged" / "docs_text_document", 40, seed=3)
    path = dataset_manifest.dataset_manifest_path(prefix)
    manifest = json.loads(path.read_bytes())
    name = prefix.name + ".bin"
    manifest["files"][name]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    assert dataset_manifest.check_dataset_files(prefix, full=True) == [
        f"{prefix}.bin: sha256 differs from the manifest"
    ]


def _rchar() -> int:
    """Bytes this process has read through read() calls so far (Linux /proc/self/io)."""
    text = Path("/proc/self/io").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("rchar")))


def test_a_large_bin_is_not_read_by_the_build(tmp_path: Path) -> None:
    """With a 48 MB ``.bin`` the build reads (read() calls) far less than the ``.bin``."""
    prefix = tmp_path / "merged/big/v1/big_text_document"
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        writer.add_documents(np.zeros(12_000_000, np.int32), np.full(1000, 12_000))
    write_dataset_manifest(
        prefix, kind="merged", inputs=[], config={}, counts={}, bin_parts=bin_parts(prefix)
    )
    reads = _rchar()
    fields = {"sequence_length": 64, "split_spec": "1,0,0", "train_samples": 1000}
    build_blend_at(tmp_path, "big", {"big": prefix}, weights={"big": 1.0}, **fields)
    assert _rchar() - reads < 4_000_000 < Path(f"{prefix}.bin").stat().st_size


def test_fast_open_hashes_nothing_and_a_damaged_index_fails_at_read_time(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = build(root)
    npy = root / f"blends/mix/versions/{manifest['version'][:16]}/train-dataset_sample_index.npy"
    arr = np.load(npy)
    arr[7] = 10**9  # same size, a value far out of range
    np.save(npy, arr, allow_pickle=False)
    hashed: list[str] = []
    real = blend_reader.file_sha256
    monkeypatch.setattr(
        blend_reader, "file_sha256", lambda p, *a: hashed.append(str(p)) or real(p, *a)
    )
    ds = open_blend(root / "blends/mix")  # schema, self-hash, sizes: O(1)
    assert hashed == []
    ok = [i for i in range(len(ds)) if i != 7]
    assert ds.get_batch(ok).shape == (len(ok), S + 1)
    with pytest.raises(FormatError, match=r"dataset_sample_index: .* for sample 1000"):
        ds.get_batch([3, 7])
    with pytest.raises(FormatError, match="asked for sample"):
        ds[7]
    with pytest.raises(CacheError, match=r"train-dataset_sample_index\.npy: sha256 differs"):
        open_blend(root / "blends/mix", verify="full")
    assert hashed
    assert main(["verify", str(root / "blends/mix/manifest.json")]) == 1


def test_a_damaged_shuffle_index_fails_at_read_time(root: Path) -> None:
    manifest = build(root)
    entry = manifest["splits"]["train"]["datasets"][0]["index"]["files"]["shuffle"]
    path = root / "blends/mix" / entry["path"]
    arr = np.load(path)
    arr[0] = np.iinfo(arr.dtype).max
    np.save(path, arr, allow_pickle=False)
    ds = open_blend(root / "blends/mix")
    docs = ds.datasets["docs"]
    with pytest.raises(FormatError, match="shuffle_index: values outside"):
        docs.get_batch([0, 1])
    with pytest.raises(FormatError, match="shuffle_index"):
        docs[0]
    assert docs.get_batch([1, 2]).shape == (2, S + 1)
    with pytest.raises(CacheError, match=r"shuffle_index\.npy: sha256 differs"):
        open_blend(root / "blends/mix", verify="full")


def test_pickles_carry_paths_not_index_arrays(root: Path) -> None:
    """A DataLoader worker receives O(1) bytes and memory-maps the same files."""
    build(root, train_samples=200_000)
    ds = open_blend(root / "blends/mix")
    index_bytes = ds.dataset_index.nbytes + ds.dataset_sample_index.nbytes
    assert index_bytes > 1_000_000
    pickled = pickle.dumps(ds)
    assert len(pickled) < 10_000
    copy = pickle.loads(pickled)
    assert isinstance(copy.dataset_index, np.memmap | np.ndarray) and copy.version == ds.version
    assert not copy.dataset_index.flags.owndata  # mapped, not unpickled
    picks = np.random.default_rng(0).integers(0, len(ds), 4096)
    assert np.array_equal(copy.get_batch(picks), ds.get_batch(picks))
    prefix = root / "merged/docs/v1/docs_text_document"
    built = build_or_load(
        prefix, root / "nanoset", "train", NanosetSettings(sequence_length=S), 300_000
    )
    nano = open_nanoset(prefix, built)
    assert nano.version and len(pickle.dumps(nano)) < 10_000
    assert np.array_equal(pickle.loads(pickle.dumps(nano)).get_batch(picks), nano.get_batch(picks))


def test_manifest_self_hash_is_canonical(root: Path) -> None:
    pointer = root / "blends/mix/manifest.json"
    manifest = build(root)
    raw = json.loads(pointer.read_text())
    assert blend_reader.manifest_digest(raw) == raw["manifest_sha256"]
    pointer.write_text(json.dumps(raw, indent=None))  # other formatting, same content
    assert read_blend_manifest(pointer) == manifest
    assert file_sha256(pointer) != raw["manifest_sha256"]  # over the content, not the bytes


def test_blend_version_is_known_before_building(root: Path) -> None:
    """``prepare_blend`` (same arguments as build_blend) builds nothing and names the version
    build_blend then writes: a caller can stage ``versions/<v16>/`` first."""
    datasets = mix_datasets(root)
    out, cache = root / "blends/mix", root / "nanoset"
    version = prepare_blend("mix", datasets, out, cache, blend_values(**SETTINGS)).version
    assert not out.exists() and not cache.exists()
    assert build(root)["version"] == version
    again = prepare_blend("mix", datasets, out, cache, blend_values(**SETTINGS))
    assert again.version == version


def test_open_nanoset_fast_hashes_no_array_full_does(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = root / "merged/docs/v1/docs_text_document"
    built = build_or_load(
        prefix, root / "nanoset", "train", NanosetSettings(sequence_length=S), 500
    )
    nano = open_nanoset(prefix, built)
    shuffle = Path(nano.index_paths[2])  # type: ignore[index]
    assert nano.version == shuffle.name.split("-", 1)[0]
    before = nano.get_batch([0, 1])
    arr = np.load(shuffle)
    arr[[0, 1]] = arr[[1, 0]]  # same size, other bytes
    np.save(shuffle, arr, allow_pickle=False)
    description = shuffle.with_name(shuffle.name.replace("shuffle_index.npy", "description.json"))
    hashed: list[str] = []
    real = blend_reader.file_sha256
    monkeypatch.setattr(
        blend_reader, "file_sha256", lambda p, *a: hashed.append(str(p)) or real(p, *a)
    )
    fast = open_nanoset(prefix, index=description)
    assert hashed == [] and np.array_equal(fast.get_batch([0, 1]), before[::-1])
    with pytest.raises(CacheError, match=r"shuffle_index\.npy: sha256 differs"):
        open_nanoset(prefix, index=description, verify="full")


def test_full_verification_scans_index_values_behind_matching_hashes(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A consistent but wrong manifest (hashes of an out-of-range array, resealed): the fast
    open cannot see it and reads fail cleanly; ``tokenmill verify`` names it."""
    build(root)
    pointer = root / "blends/mix/manifest.json"
    manifest = json.loads(pointer.read_text())
    entry = manifest["splits"]["train"]["files"]["dataset_index"]
    path = root / "blends/mix" / entry["path"]
    arr = np.load(path)
    arr[5] = 7  # only datasets 0 and 1 exist
    np.save(path, arr, allow_pickle=False)
    entry.update(bytes=path.stat().st_size, sha256=file_sha256(path))
    pointer.write_text(json.dumps(blend_reader.seal(manifest)))
    ds = open_blend(pointer)
    with pytest.raises(FormatError, match=r"dataset_index: values outside \[0, 2\)"):
        ds.get_batch([4, 5, 6])
    assert main(["verify", str(pointer)]) == 1
    assert "FAIL split 'train': " in capsys.readouterr().out
    assert main(["verify", "--fast", str(pointer)]) == 0
