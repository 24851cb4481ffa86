"""Hostile on-disk input (issue 6 §2): corrupt ``.bin``/``.idx`` pairs through every reader, and
tampered dataset and blend manifests. Each case fails with an error naming the file, the field and
the value, and nothing is written outside the storage root (its parent is compared byte for byte).

Catalogue of the on-disk classes (cases already tested elsewhere are listed, not repeated):

- corrupt pair, ``IndexedDataset`` alone: tests/lib/test_indexed.py::
  test_header_corruption_is_named, ::test_truncated_idx, ::test_bin_size_mismatch,
  ::test_inconsistent_pointers_and_docs,
  ::test_missing_partner; random bytes: tests/faults/test_fuzz.py::test_idx_reader_*.
- corrupt pair through ``tokenmill inspect/verify/merge``, ``open_nanoset``, ``open_blend``:
  test_corrupt_pair_is_refused_by_every_reader (here).
- tampered dataset manifest: test_tampered_dataset_manifest_is_refused,
  test_edited_hash_or_size_is_caught (here); changed ``.bin`` under a merge manifest:
  tests/lib/test_merge.py::test_merge_manifest_records_parts_and_detects_corruption.
- tampered blend manifest: test_tampered_blend_manifest_is_refused (here); changed dataset or index
  files: tests/lib/test_blend_manifest.py::test_changed_dataset_is_refused_with_what_to_rebuild,
  ::test_same_size_token_change_is_caught_by_full_verification,
  ::test_missing_index_cache_is_refused, ::test_partial_blend_without_manifest_is_refused,
  ::test_malformed_manifest_is_a_format_error;
  pull: tests/prod/test_pull.py::test_paths_escaping_the_layout_are_refused,
  ::test_dataset_manifest_disagreeing_with_the_blend_is_refused.
- ``.npy`` object arrays: tests/lib/test_index_cache.py::test_object_arrays_are_refused,
  ::test_partial_or_damaged_entries_are_rebuilt[object], tests/lib/test_loader.py::
  test_object_array_cache_is_refused_even_with_matching_hash, tests/lib/test_blend_manifest.py::
  test_tampered_object_array_is_refused_even_with_matching_hash, and with a payload that would run
  code: tests/faults/test_security.py.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from servers import build_storage_root

from tokenmill.atomic import file_sha256
from tokenmill.cli import main
from tokenmill.errors import CacheError, FormatError, TokenmillError
from tokenmill.formats import blend_manifest as blend_reader
from tokenmill.formats import dataset_manifest
from tokenmill.formats.blend_manifest import seal
from tokenmill.indices.nanoset import build_or_load
from tokenmill.indices.settings import NanosetSettings
from tokenmill.loader import open_blend, open_nanoset
from tokenmill.storage.pull import pull

CODE = Path("merged/code_text_document")
DOCS = Path("merged/docs_text_document")
BLEND = Path("blends/mix/manifest.json")
HEADER = 34


@dataclass(frozen=True)
class World:
    """A copy of the pristine storage root at ``outer/root``; ``outer`` is what must not change."""

    outer: Path
    root: Path
    description: Path  # an index of the code dataset, for open_nanoset

    @property
    def code(self) -> Path:
        return self.root / CODE


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A pipeline-shaped storage root (blend ``mix`` of docs + code) and a code index."""
    root = tmp_path_factory.mktemp("pristine") / "root"
    build_storage_root(root)
    index = build_or_load(
        root / CODE,
        root / "nanoset",
        "train",
        NanosetSettings(split_spec="90,10,0", sequence_length=16),
    )
    assert index is not None
    return root, index.paths["description"].relative_to(root)


@pytest.fixture
def world(pristine: tuple[Path, Path], tmp_path: Path) -> World:
    source, description = pristine
    root = tmp_path / "outer" / "root"
    shutil.copytree(source, root)
    return World(tmp_path / "outer", root, root / description)


def snapshot(top: Path, skip: Path | None = None) -> dict[str, bytes | None]:
    """Every directory (None) and file (its bytes) under ``top``, except under ``skip``."""
    found: dict[str, bytes | None] = {}
    for p in sorted(top.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        found[p.relative_to(top).as_posix()] = p.read_bytes() if p.is_file() else None
    return found


# -- corrupt .bin/.idx pairs ----------------------------------------------------------------------
def _patch(data: bytearray, offset: int, value: bytes) -> bytearray:
    data[offset : offset + len(value)] = value
    return data


def _n(idx: bytearray) -> int:
    return struct.unpack_from("<Q", idx, 18)[0]


def _shift_pointer(idx: bytearray) -> bytearray:
    at = HEADER + 4 * _n(idx) + 8 * 3
    (pointer,) = struct.unpack_from("<q", idx, at)
    return _patch(idx, at, struct.pack("<q", pointer + 2))


def _negative_length(idx: bytearray) -> bytearray:
    (length,) = struct.unpack_from("<i", idx, HEADER)
    return _patch(idx, HEADER, struct.pack("<i", -length))


# name: (edit of the .idx bytes, edit of the .bin bytes, damaged file suffix, field named)
Edit = Callable[[bytearray], bytearray]
KEEP: Edit = bytearray
CORRUPTIONS: dict[str, tuple[Edit, Edit, str, str]] = {
    "idx truncated": (lambda b: b[:-3], KEEP, ".idx", "sequence_count/document_count"),
    "idx shorter than its header": (lambda b: b[:20], KEEP, ".idx", "header"),
    "wrong magic": (lambda b: _patch(b, 0, b"NOTMMIDX\0"), KEEP, ".idx", "magic"),
    "wrong version": (lambda b: _patch(b, 9, struct.pack("<Q", 2)), KEEP, ".idx", "version"),
    "dtype code 0": (lambda b: _patch(b, 17, b"\x00"), KEEP, ".idx", "dtype code"),
    "dtype code 9": (lambda b: _patch(b, 17, b"\x09"), KEEP, ".idx", "dtype code"),
    "pointer inconsistent with lengths": (_shift_pointer, KEEP, ".idx", "sequence_pointers"),
    "counts larger than the file": (
        lambda b: _patch(b, 18, struct.pack("<Q", _n(b) + 1000)),
        KEEP,
        ".idx",
        "sequence_count/document_count",
    ),
    "document_indices past the end": (
        lambda b: _patch(b, len(b) - 8, struct.pack("<q", _n(b) + 1)),
        KEEP,
        ".idx",
        "document_indices",
    ),
    "negative length": (_negative_length, KEEP, ".idx", "sequence_lengths"),
    "bin truncated": (KEEP, lambda b: b[:-2], ".bin", "size"),
}


def _corrupt(world: World, name: str) -> Path:
    """Apply a corruption to the code dataset; the damaged file's path."""
    edit_idx, edit_bin, suffix, _ = CORRUPTIONS[name]
    for ext, edit in ((".idx", edit_idx), (".bin", edit_bin)):
        path = Path(f"{world.code}{ext}")
        path.write_bytes(bytes(edit(bytearray(path.read_bytes()))))
    return Path(f"{world.code}{suffix}")


def _rehash_blend(world: World) -> None:
    """Make the blend manifest record the damaged files (a tampered or buggy manifest, sealed
    with its own hash again so that the readers look past it)."""
    mpath = world.root / BLEND
    manifest = json.loads(mpath.read_text())
    entry = next(ds for ds in manifest["datasets"] if ds["name"] == "code")
    for kind in ("bin", "idx"):
        path = Path(f"{world.code}.{kind}")
        entry["files"][kind] = {
            "path": entry["files"][kind]["path"],
            "bytes": path.stat().st_size,
            "sha256": file_sha256(path),
        }
    mpath.write_text(json.dumps(seal(manifest)))


def _inspect(world: World, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["inspect", str(world.code)]) == 1
    return capsys.readouterr().err


def _verify(world: World, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["verify", str(world.code)]) == 1
    return capsys.readouterr().out


def _merge(world: World, capsys: pytest.CaptureFixture[str]) -> str:
    out = world.root / "remerged" / "all"
    argv = ["merge", "--input", str(world.root / DOCS), str(world.code), "--output-prefix"]
    assert main([*argv, str(out)]) == 1
    assert not out.parent.exists() or not [p for p in out.parent.rglob("*") if p.is_file()]
    return capsys.readouterr().err


def _open_nanoset(world: World, capsys: pytest.CaptureFixture[str]) -> str:
    dataset_manifest.dataset_manifest_path(
        world.code
    ).unlink()  # a hand-made Megatron pair: no manifest
    try:  # fast: the pair's header, counts and sizes (O(1) in the index sizes)
        open_nanoset(world.code, index=world.description)
    except FormatError as exc:
        return str(exc)
    with pytest.raises(FormatError) as err:  # every pointer: only the full check reads them all
        open_nanoset(world.code, index=world.description, verify="full")
    assert "sequence_pointers" in str(err.value)
    return str(err.value)


def _open_blend(world: World, capsys: pytest.CaptureFixture[str]) -> str:
    _rehash_blend(world)
    try:  # fast: the pair's header, counts and sizes (O(1) in the index sizes)
        open_blend(world.root / BLEND, "train")
    except FormatError as exc:
        return str(exc)
    with pytest.raises(FormatError) as err:  # every array: only the full check reads them all
        open_blend(world.root / BLEND, "train", verify="full")
    return str(err.value)


READERS = {
    "inspect": _inspect,
    "verify": _verify,
    "merge": _merge,
    "open_nanoset": _open_nanoset,
    "open_blend": _open_blend,
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corrupt_pair_is_refused_by_every_reader(
    world: World, corruption: str, reader: str, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = _corrupt(world, corruption)
    before = snapshot(world.outer, skip=world.root / "remerged")
    message = READERS[reader](world, capsys)
    field = CORRUPTIONS[corruption][3]
    assert f"{damaged}: {field}: " in message
    after = snapshot(world.outer, skip=world.root / "remerged")
    if reader in ("open_nanoset", "open_blend"):  # the reader's own preparation, done above
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert changed <= {
            f"root/{CODE.parent}/manifests/{CODE.name}.manifest.json",
            f"root/{BLEND}",
        }
    else:
        assert after == before


# -- tampered dataset manifests -------------------------------------------------------------------
BIN, IDX = CODE.name + ".bin", CODE.name + ".idx"
Mutation = Callable[[dict[str, Any], Path], None]


def _rename_entry(new_name: Callable[[Path], str]) -> Mutation:
    def mutate(m: dict[str, Any], outer: Path) -> None:
        m["files"][new_name(outer)] = m["files"].pop(BIN)

    return mutate


DATASET_TAMPERING: dict[str, tuple[Mutation, str]] = {
    "files not a mapping": (lambda m, _: m.update(files=[BIN, IDX]), "files"),
    "an entry missing": (lambda m, _: m["files"].pop(BIN), "files"),
    "bytes missing": (lambda m, _: m["files"][BIN].pop("bytes"), f"files.{BIN}"),
    "bytes a string": (lambda m, _: m["files"][BIN].update(bytes="12"), f"files.{BIN}"),
    "sha256 a number": (lambda m, _: m["files"][IDX].update(sha256=7), f"files.{IDX}"),
    "entry a string": (lambda m, _: m["files"].update({BIN: "ok"}), f"files.{BIN}"),
    "counts a list": (lambda m, _: m.update(counts=[1, 2]), "counts"),
    "content_hash missing": (lambda m, _: m.pop("content_hash"), "content_hash"),
    "content_hash a number": (lambda m, _: m.update(content_hash=5), "content_hash"),
    "format_version changed": (lambda m, _: m.update(format_version=2), "format_version"),
    "name with ..": (_rename_entry(lambda outer: "../../outside.bin"), "files"),
    "absolute name": (_rename_entry(lambda outer: str(outer / "outside.bin")), "files"),
    "name with a control character": (_rename_entry(lambda outer: "code\x1b.bin"), "files"),
}


def _dataset_entry_points(world: World, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The message of every reader of a dataset manifest (each must fail)."""
    messages = []
    assert main(["verify", str(world.code)]) == 1
    messages.append(capsys.readouterr().out)
    out = world.root / "remerged" / "all"
    assert main(["merge", "--input", str(world.code), "--output-prefix", str(out)]) == 1
    messages.append(capsys.readouterr().err)
    for verify in ("fast", "full"):
        with pytest.raises(FormatError) as err:
            open_nanoset(world.code, index=world.description, verify=verify)
        messages.append(str(err.value))
    with pytest.raises(FormatError) as err:
        build_or_load(
            world.code, world.root / "nanoset", "train", NanosetSettings(sequence_length=8)
        )
    messages.append(str(err.value))
    return messages


@pytest.mark.parametrize("tampering", DATASET_TAMPERING)
def test_tampered_dataset_manifest_is_refused(
    world: World, tampering: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    (world.outer / "outside.bin").write_bytes(b"\0" * 64)
    mpath = dataset_manifest.dataset_manifest_path(world.code)
    manifest = json.loads(mpath.read_text())
    mutate, field = DATASET_TAMPERING[tampering]
    mutate(manifest, world.outer)
    mpath.write_text(json.dumps(manifest))
    hashed: list[Path] = []
    real = dataset_manifest.file_sha256
    monkeypatch.setattr(
        dataset_manifest, "file_sha256", lambda p, *a: hashed.append(Path(p)) or real(p, *a)
    )
    before = snapshot(world.outer, skip=world.root / "remerged")
    for message in _dataset_entry_points(world, capsys):
        assert f"{mpath}: {field}: " in message, message
    assert snapshot(world.outer, skip=world.root / "remerged") == before
    assert all(world.root in p.parents for p in hashed)
    assert not (world.root / "remerged").exists()  # refused before any output is made


def test_not_json_dataset_manifest(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    mpath = dataset_manifest.dataset_manifest_path(world.code)
    mpath.write_bytes(b'{"format_version": 1, "files": ')
    for message in _dataset_entry_points(world, capsys):
        assert f"{mpath}: manifest: not valid JSON" in message


def test_edited_hash_or_size_is_caught(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """Well-formed but false records: verify names them; open_nanoset(full) refuses; a merge
    (which trusts recorded hashes for speed) carries the false hash into a manifest that its own
    verification then fails, so the lie is never silently accepted."""
    mpath = dataset_manifest.dataset_manifest_path(world.code)
    manifest = json.loads(mpath.read_text())
    manifest["files"][BIN]["sha256"] = "0" * 64
    manifest["files"][IDX]["bytes"] += 8
    mpath.write_text(json.dumps(manifest))
    assert main(["verify", str(world.code)]) == 1
    size = manifest["files"][IDX]["bytes"] - 8
    assert f"FAIL {world.code}.idx: {size} bytes, manifest says" in capsys.readouterr().out
    manifest["files"][IDX]["bytes"] -= 8
    mpath.write_text(json.dumps(manifest))
    assert main(["verify", str(world.code)]) == 1
    assert f"FAIL {world.code}.bin: sha256 differs from the manifest" in capsys.readouterr().out
    with pytest.raises(CacheError, match=r"code_text_document\.bin: sha256 differs"):
        open_nanoset(world.code, index=world.description, verify="full")
    merged = world.root / "remerged" / "all"
    assert main(["merge", "--input", str(world.code), "--output-prefix", str(merged)]) == 0
    capsys.readouterr()
    assert main(["verify", str(merged)]) == 1
    assert f"FAIL {merged}.bin: sha256 of part 0 (bytes 0..) differs" in capsys.readouterr().out


# -- tampered blend manifests ---------------------------------------------------------------------
def _ds(m: dict[str, Any], name: str) -> dict[str, Any]:
    return next(ds for ds in m["datasets"] if ds["name"] == name)


def _array(m: dict[str, Any]) -> dict[str, Any]:
    return m["splits"]["train"]["files"]["dataset_index"]


BlendMutation = Callable[[dict[str, Any], World], None]


def _top(**values: Any) -> BlendMutation:
    return lambda m, w: m.update(values)


def _entry(**values: Any) -> BlendMutation:
    return lambda m, w: _array(m).update(values)


F, C = FormatError, CacheError
ARRAY = "train-dataset_index.npy"
BLEND_TAMPERING: dict[str, tuple[BlendMutation, type[Exception], str]] = {
    "prefix names another dataset": (
        lambda m, w: _ds(m, "code").update(prefix=_ds(m, "docs")["prefix"]),
        F,
        "datasets.code.files.bin: ",
    ),
    "dataset file entry removed": (
        lambda m, w: _ds(m, "code")["files"].pop("bin"),
        F,
        "manifest: malformed (KeyError('bin'))",
    ),
    "absolute path": (
        lambda m, w: _array(m).update(path=str(w.root / "blends/mix" / ARRAY)),
        F,
        "path: '/",
    ),
    "extra .. above /": (_entry(path="../" * 40 + "etc/passwd"), F, "climbs above the filesystem"),
    "'..' after a folder": (_entry(path=f"../../x/../mix/{ARRAY}"), F, "'..' after a folder name"),
    "control character": (_entry(path=f"{ARRAY}\n"), F, "contains a control character"),
    "path not a string": (_entry(path=7), F, "path: 7 is not a relative path"),
    "sequence_length edited": (_top(sequence_length=32), C, "says sequence_length 32, its index"),
    "sequence_length a string": (_top(sequence_length="16"), C, "says sequence_length '16', its"),
    "add_extra_token edited": (_top(add_extra_token=False), C, "says add_extra_token False, its"),
    "drop_last_partial_validation a string": (
        _top(drop_last_partial_validation="no"),
        F,
        "drop_last_partial_validation: expected true or false: 'no'",
    ),
    "skipped names a blended dataset": (
        lambda m, w: m["splits"]["train"].update(skipped=[{"name": "docs", "reason": "x"}]),
        C,
        "split 'train' skipped: 'docs' is not a dataset of the blend left out of this split",
    ),
    "skipped not a list": (
        lambda m, w: m["splits"]["train"].update(skipped="docs"),
        C,
        "split 'train' skipped: expected a list",
    ),
    "sha256 edited": (_entry(sha256="f" * 64), C, f"{ARRAY}: sha256 differs from the recorded"),
    "cache record edited": (
        lambda m, w: m["splits"]["train"]["datasets"][0]["index"]["files"]["sample"].update(
            sha256="0" * 64
        ),
        C,
        "index cache (sample): the manifest records",
    ),
    "size a string": (
        lambda m, w: _array(m).update(bytes=str(_array(m)["bytes"])),
        C,
        "bytes, recorded '",
    ),
    "splits a list": (_top(splits=[]), F, "splits: expected a dict"),
    "datasets a mapping": (_top(datasets={}), F, "datasets: expected a list"),
    "split names an unknown dataset": (
        lambda m, w: m["splits"]["train"]["datasets"][0].update(name="ghost"),
        F,
        "datasets: no entry for ['ghost']",
    ),
    "key missing": (lambda m, w: m.pop("datasets"), F, "datasets: missing"),
    "another kind": (_top(kind="dataset"), F, "kind: expected 'blend'"),
}


FULL_ONLY = {"sha256 edited"}


def test_unsealed_edit_of_a_blend_manifest_is_refused_without_hashing_files(
    world: World, monkeypatch: Any
) -> None:
    """An edit that does not recompute ``manifest_sha256`` (a damaged or hand-edited file) is
    refused by the O(1) fast open: nothing is hashed but the manifest itself."""
    mpath = world.root / BLEND
    manifest = json.loads(mpath.read_text())
    _array(manifest).update(sha256="f" * 64)
    mpath.write_text(json.dumps(manifest))
    hashed: list[Path] = []
    monkeypatch.setattr(blend_reader, "file_sha256", lambda p, *a: hashed.append(Path(p)))
    with pytest.raises(FormatError, match=r"manifest_sha256: .* edited or damaged"):
        open_blend(mpath, "train")
    assert hashed == []


@pytest.mark.parametrize("tampering", BLEND_TAMPERING)
def test_tampered_blend_manifest_is_refused(
    world: World, tampering: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    mpath = world.root / BLEND
    manifest = json.loads(mpath.read_text())
    mutate, error, text = BLEND_TAMPERING[tampering]
    mutate(manifest, world)
    mpath.write_text(json.dumps(seal(manifest)))  # sealed again: a buggy or deliberate writer
    hashed: list[Path] = []
    real = blend_reader.file_sha256
    monkeypatch.setattr(
        blend_reader, "file_sha256", lambda p, *a: hashed.append(Path(p)) or real(p, *a)
    )
    before = snapshot(world.outer, skip=world.outer / "dest")
    if tampering in FULL_ONLY:  # a consistent manifest with a false hash: the fast open's
        open_blend(mpath, "train")  # O(1) checks cannot see it, the full one must
        assert hashed == []
    with pytest.raises(error) as err:
        open_blend(mpath, "train", verify="full" if tampering in FULL_ONLY else "fast")
    assert text in str(err.value) and str(mpath) in str(err.value)
    assert main(["verify", str(mpath)]) == 1
    captured = capsys.readouterr()
    assert text in captured.out + captured.err
    _pull_refuses(world, mpath)
    assert snapshot(world.outer, skip=world.outer / "dest") == before
    assert all(world.root in p.parents or world.outer / "dest" in p.parents for p in hashed)


def _pull_refuses(world: World, mpath: Path) -> None:
    """A pull of the tampered blend fails, or its copy fails to open: never a usable blend."""
    dest = world.outer / "dest"
    try:
        report = pull(str(mpath), dest, jobs=2, progress=False)
    except TokenmillError:
        assert not (dest / BLEND).exists()
        return
    with pytest.raises((FormatError, CacheError)):
        open_blend(report.manifest, "train")


HOSTILE_JSON = {
    "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "a 5,000-digit integer": b'{"format_version": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("payload", HOSTILE_JSON)
def test_hostile_json_in_a_manifest_or_pointer_is_a_format_error(
    world: World, payload: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """JSON that Python's parser itself refuses (RecursionError, the 4,300-digit int limit) is a
    FormatError naming the file in every reader: a one-line CLI error (exit 1), never a
    traceback, and an error training code catching TokenmillError sees."""
    from tokenmill.storage.versions import read_pointer

    raw = HOSTILE_JSON[payload]
    mpath = dataset_manifest.dataset_manifest_path(world.code)
    mpath.write_bytes(raw)
    for message in _dataset_entry_points(world, capsys):
        assert f"{mpath}: manifest: not readable JSON" in message, message
    argv = ["blend", "--dataset", f"code={world.code}", "--weight", "code=1", "--output"]
    argv += [str(world.root / "blends/new"), "--sequence-length", "8", "--train-samples", "4"]
    assert main(argv) == 1
    assert f"{mpath}: manifest: not readable JSON" in capsys.readouterr().err
    blend = world.root / BLEND
    blend.write_bytes(raw)
    with pytest.raises(FormatError, match=f"{blend}: manifest: not readable JSON"):
        open_blend(blend, "train")
    for argv in (["verify", str(blend)], ["inspect", str(blend)]):
        assert main(argv) == 1
        out = capsys.readouterr()
        assert f"{blend}: manifest: not readable JSON" in out.out + out.err, argv
    assert main(["gc", str(world.root), "--keep", "0"]) == 1
    assert "blends/mix/manifest.json: pointer:" in capsys.readouterr().err
    pointer = world.root / "merged/docs/current.json"
    pointer.parent.mkdir(parents=True)
    pointer.write_bytes(raw)
    with pytest.raises(FormatError, match=f"{pointer}: pointer: not readable JSON"):
        read_pointer(pointer)
