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
from tokenmill.storage.pull import LEDGER_NAME, PARTIAL_SUFFIX, pull


def is_pull_state(rel: str) -> bool:
    """The ledger of a pull destination, or a partial download in a ``.tmp/`` folder."""
    return rel == LEDGER_NAME or (f"{TMP_DIR}/" in rel and rel.endswith(PARTIAL_SUFFIX))


MANIFEST = Path("blends/mix/manifest.json")


def files_under(root: Path) -> dict[str, bytes]:
    """``{relative path: content}`` of every file under ``root`` but a pull's own state (its
    ledger, partial downloads)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not is_pull_state(p.relative_to(root).as_posix())
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
        ("merged/docs_text_document.bin", "sha256 of block 0 "),  # the per-block list first
        ("merged/code_text_document.bin", "sha256 of block 0 (bytes 0.."),
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


# --- resuming by block hashes -----------------------------------------------------------------
BLOCK = 256  # bytes per block of the .bin files built below (8 MiB in production)
DOCS = "merged/docs_text_document.bin"


class Killed(BaseException):
    """Stands for a SIGKILL: nothing in the pull catches it."""


@pytest.fixture
def small_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``build_storage_root`` with per-block sha256 lists of BLOCK bytes (many blocks per .bin),
    each new block recorded in the ledger at once (production: every 64 MiB)."""
    from servers import build_storage_root

    from tokenmill.formats import dataset_manifest
    from tokenmill.storage import pull_blocks

    monkeypatch.setattr(dataset_manifest, "BLOCK_BYTES", BLOCK)
    monkeypatch.setattr(pull_blocks, "SYNC_BYTES", BLOCK)
    build_storage_root(tmp_path / "src")
    return tmp_path / "src"


class GetLog:
    """Every GetObject the pull's client sends to moto, as (key, Range header); ``kill_at``
    raises Killed before the n-th range GET of DOCS is sent."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tokenmill.storage import s3

        self.gets: list[tuple[str, str]] = []
        self.kill_at: int | None = None
        real = s3.make_client

        def make_client(*args: object, **kwargs: object) -> object:
            client = real(*args, **kwargs)
            client.meta.events.register("before-send.s3.GetObject", self._sent)
            return client

        monkeypatch.setattr(s3, "_CLIENTS", {})  # every client of the test built (and hooked) anew
        monkeypatch.setattr(s3, "make_client", make_client)

    def _sent(self, request: object, **_: object) -> None:
        url, headers = request.url, request.headers  # type: ignore[attr-defined]
        key = url.split("/", 4)[4].split("?")[0]
        rng = headers.get("Range", b"")
        rng = rng.decode() if isinstance(rng, bytes) else str(rng)
        if key.endswith(DOCS) and rng and self.kill_at is not None:
            self.kill_at -= 1
            if self.kill_at == 0:
                raise Killed
        self.gets.append((key, rng))

    def ranges(self, suffix: str) -> list[tuple[int, int]]:
        """The byte ranges [lo, hi) fetched of the object ending in ``suffix``."""
        found = []
        for key, rng in self.gets:
            if key.endswith(suffix) and rng:
                lo, hi = rng.removeprefix("bytes=").split("-")
                found.append((int(lo), int(hi) + 1))
        return found


def blocks_of(ranges: list[tuple[int, int]]) -> list[int]:
    return sorted(lo // BLOCK for lo, _ in ranges)


def test_s3_resumed_pull_fetches_only_the_missing_and_bad_blocks(
    s3: S3, small_blocks: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed while fetching block 5 of the merged .bin: a resume fetches blocks 5.. by range
    GET, plus block 1, corrupted in the partial file meanwhile, and nothing complete again."""
    s3.upload_tree(small_blocks, "v1")
    uri = f"s3://{s3.bucket}/v1/{MANIFEST}"
    log = GetLog(monkeypatch)
    log.kill_at = 6  # the 6th range GET of the .bin: blocks 0-4 are written and recorded
    dest = tmp_path / "dest"
    with pytest.raises(Killed):
        pull(uri, dest, jobs=1)
    size = (small_blocks / DOCS).stat().st_size
    n_blocks = -(-size // BLOCK)
    assert n_blocks > 10 and blocks_of(log.ranges(DOCS)) == [0, 1, 2, 3, 4]
    partial = dest / "merged" / TMP_DIR / f"docs_text_document.bin{PARTIAL_SUFFIX}"
    assert partial.stat().st_size == size and not (dest / DOCS).exists()
    done_before = {k for k in files_under(dest) if not k.endswith("manifest.json")}
    with open(partial, "r+b") as fh:  # damage a block the ledger recorded as verified
        fh.seek(BLOCK + 3)
        fh.write(b"\xff\x00")

    log.gets.clear()
    report = pull(uri, dest, jobs=1)

    assert blocks_of(log.ranges(DOCS)) == [1, *range(5, n_blocks)]
    fetched_keys = {key.removeprefix("v1/") for key, _ in log.gets}
    assert not fetched_keys & done_before  # complete files: trusted, not fetched again
    assert set(report.skipped) == done_before
    assert DOCS in report.fetched
    resumed = size - 4 * BLOCK  # blocks 1 and 5.. of the .bin
    others = sum((small_blocks / rel).stat().st_size for rel in report.fetched if rel != DOCS)
    assert report.bytes_fetched == resumed + others
    assert files_under(dest) == expected_files(small_blocks)
    assert_same_blend(small_blocks / MANIFEST, dest / MANIFEST)


def test_s3_a_damaged_block_of_a_pulled_file_is_fetched_again_alone(
    s3: S3, small_blocks: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second pull trusts the recorded files without reading them; a file changed since is
    checked block by block, and only its bad block is fetched (into a new file renamed over
    it: a reader of the old file keeps its bytes)."""
    s3.upload_tree(small_blocks, "v1")
    uri = f"s3://{s3.bucket}/v1/{MANIFEST}"
    log = GetLog(monkeypatch)
    dest = tmp_path / "dest"
    first = pull(uri, dest)
    log.gets.clear()
    again = pull(uri, dest)
    assert log.ranges("") == [] and again.fetched == [] and again.bytes_fetched == 0
    assert sorted(again.skipped) == sorted(first.fetched)

    target = dest / DOCS
    inode = target.stat().st_ino
    with open(target, "r+b") as fh:
        fh.seek(7 * BLOCK + 10)
        fh.write(b"\x00\x01\x02")
    log.gets.clear()
    report = pull(uri, dest)

    assert log.ranges(DOCS) == [(7 * BLOCK, 8 * BLOCK)] and len(log.ranges("")) == 1
    assert report.fetched == [DOCS] and report.bytes_fetched == BLOCK
    assert target.stat().st_ino != inode
    assert files_under(dest) == expected_files(small_blocks)
