"""open_blend is O(1) in dataset size: pairs open from the counts the blend records, not from
their own manifests (megabytes of per-block hashes) nor from scans of the index."""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_pairs import random_dataset

from tokenmill.errors import FormatError
from tokenmill.formats import dataset_manifest
from tokenmill.formats.indexed import HEADER_SIZE, IndexedDataset
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.loader import open_blend

S = 8


@pytest.fixture
def blend(tmp_path: Path) -> Path:
    prefixes = {
        "docs": random_dataset(tmp_path / "merged/docs_text_document", 120, 1),
        "code": random_dataset(tmp_path / "merged/code_text_document", 80, 2, np.int32),
    }
    build_blend(
        "mix",
        {name: tmp_path / f"merged/{name}_text_document" for name in prefixes},
        tmp_path / "blends/mix",
        tmp_path / "nanoset",
        BlendSettings(
            NanosetSettings(sequence_length=S, split_spec="80,10,10", seed=5, train_samples=51),
            weights={"docs": 0.7, "code": 0.3},
        ),
    )
    return tmp_path / "blends/mix/manifest.json"


def test_open_and_worker_reopen_read_no_dataset_manifest_and_scan_nothing(
    blend: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = open_blend(blend).get_batch(np.arange(52))
    reads, scans = [], []
    real_read = dataset_manifest.read_dataset_manifest
    monkeypatch.setattr(
        dataset_manifest,
        "read_dataset_manifest",
        lambda prefix: reads.append(prefix) or real_read(prefix),
    )
    real_scan = IndexedDataset._scan_index
    monkeypatch.setattr(
        IndexedDataset, "_scan_index", lambda self: scans.append(self) or real_scan(self)
    )
    ds = open_blend(blend)
    copy = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker does
    assert reads == [] and scans == []
    assert np.array_equal(ds.get_batch(np.arange(52)), expected)
    assert np.array_equal(copy.get_batch(np.arange(52)), expected)
    open_blend(blend, verify="full")  # the full check still scans every index
    assert len(scans) == 2


def _rewrite_idx(path: Path, edit: dict[int, bytes]) -> None:
    """Overwrite bytes of an ``.idx`` in place (its size stays what the blend recorded)."""
    data = bytearray(path.read_bytes())
    for offset, value in edit.items():
        start = offset if offset >= 0 else len(data) + offset
        data[start : start + len(value)] = value
    path.write_bytes(bytes(data))


def test_a_header_that_disagrees_with_the_blend_is_refused(blend: Path) -> None:
    """Two more sequences and three fewer boundaries keep the .idx size: only the recorded
    sequence count can tell (first pointer and boundaries are made to look valid)."""
    idx = blend.parent.parent.parent / "merged/docs_text_document.idx"
    n_seq, n_doc = struct.unpack("<QQ", idx.read_bytes()[18:34])
    docs_at = HEADER_SIZE + 12 * (n_seq + 2)
    _rewrite_idx(
        idx,
        {
            18: struct.pack("<QQ", n_seq + 2, n_doc - 3),
            HEADER_SIZE + 4 * (n_seq + 2): struct.pack("<q", 0),
            docs_at: struct.pack("<q", 0),
            -8: struct.pack("<q", n_seq + 2),
        },
    )
    with pytest.raises(FormatError, match=r"header.*122 uint16 sequences.*records 120 uint16"):
        open_blend(blend)


def test_a_dtype_that_disagrees_with_the_blend_is_refused(blend: Path) -> None:
    idx = blend.parent.parent.parent / "merged/docs_text_document.idx"
    _rewrite_idx(idx, {17: bytes([3])})  # int16: the same item size as uint16
    with pytest.raises(FormatError, match=r"int16 sequences, the manifest records 120 uint16"):
        open_blend(blend)


def test_the_loader_does_not_import_the_writer_machinery() -> None:
    """Every training process imports the loader: the writers' I/O (writeback thread, in-kernel
    copies, the block-hash thread pool) stays out of it."""
    code = (
        "import sys, tokenmill.loader; print(sorted(m for m in sys.modules if m in "
        "('tokenmill.formats._writer_io', 'concurrent.futures', 'mmap', 'queue')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_blend_of_a_virtual_merge_reads_its_manifest_once_and_keeps_no_block_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.formats import blend_manifest
    from tokenmill.formats.merge import virtual_merge

    shards = [
        random_dataset(
            tmp_path / f"tokens/part-{i}_text_document", 50, i, kind="tokens", counted=True
        )
        for i in range(3)
    ]
    keys = [(p.name.removesuffix("_text_document"), p) for p in shards]
    merged = virtual_merge(keys, tmp_path / "merged/v1/docs_text_document").prefix
    build_blend(
        "one",
        {"docs": merged},
        tmp_path / "blends/one",
        tmp_path / "nanoset",
        BlendSettings(
            NanosetSettings(sequence_length=S, split_spec="80,10,10", train_samples=20),
            weights={"docs": 1},
        ),
    )
    reads = []
    real_read = dataset_manifest.read_dataset_manifest

    def counting(prefix: object) -> dict:
        reads.append(prefix)
        return real_read(prefix)

    monkeypatch.setattr(dataset_manifest, "read_dataset_manifest", counting)
    monkeypatch.setattr(blend_manifest, "read_dataset_manifest", counting)
    ds = open_blend(tmp_path / "blends/one")
    assert len(reads) == 1
    kept = ds.datasets["docs"].data.manifest
    assert all("block_sha256" not in f for s in kept["shards"] for f in s["files"].values())
    assert ds.get_batch(np.arange(len(ds))).shape == (len(ds), S + 1)
