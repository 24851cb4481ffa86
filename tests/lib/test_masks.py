"""Masks over virtual merges (takedowns): a masked merge indexes as the physical merge of its
unmasked documents (megatron, nanotron), growing drops them by identity, the manifest refuses a
malformed mask, and masks enter the merged version and break extension."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_pairs import index_of, random_dataset, split_fields

from tokenmill.errors import FormatError
from tokenmill.formats.dataset_manifest import dataset_manifest_path, read_dataset_manifest
from tokenmill.formats.indexed import IndexedDataset, IndexedDatasetWriter
from tokenmill.formats.merge import merge_datasets, virtual_merge
from tokenmill.formats.virtual_merge import check_manifest, masked_sequences
from tokenmill.indices import growing
from tokenmill.loader import open_nanoset
from tokenmill.tokenize.merged_versions import extends, merged_version, shard_identities

SIZES = [9, 3, 25, 14, 6]
MASKS = {"part-00000": [2], "part-00002": [0, 5, 24], "part-00004": [5]}


def _shards(folder: Path) -> list[tuple[str, Path]]:
    out = []
    for i, n in enumerate(SIZES):
        prefix = folder / f"part-{i:05d}_text_document"
        random_dataset(prefix, n, 40 + i, kind="tokens", counted=True, lengths=(1, 40))
        out.append((f"part-{i:05d}", prefix))
    return out


def _without_masked(shards: list[tuple[str, Path]], folder: Path) -> list[Path]:
    """Each shard rewritten without its masked documents (what re-tokenizing would give)."""
    out = []
    for key, prefix in shards:
        kept = folder / prefix.name
        with IndexedDataset(prefix) as data, IndexedDatasetWriter(kept, data.dtype) as writer:
            for n in range(len(data)):
                if n not in MASKS.get(key, []):
                    writer.add_documents(np.asarray(data[n]), [len(data[n])])
        out.append(kept)
    return out


@pytest.mark.parametrize("semantics", ["megatron", "nanotron"])
def test_a_masked_merge_indexes_as_the_physical_merge_of_the_rest(
    tmp_path: Path, semantics: str
) -> None:
    shards = _shards(tmp_path / "tokens")
    masked = virtual_merge(shards, tmp_path / "v" / "docs_text_document", masks=MASKS).prefix
    rest = merge_datasets(
        _without_masked(shards, tmp_path / "rest"), tmp_path / "p" / "docs_text_document"
    ).prefix
    ids = masked_sequences(read_dataset_manifest(masked))
    assert ids.tolist() == [2, 12, 17, 36, 56]  # shard offsets 0, 9, 12, 37, 51
    for split in ("train", "valid", "test"):
        settings = split_fields(split, semantics, train_samples=60)
        a = open_nanoset(masked, index_of(masked, tmp_path / "a", **settings), verify="full")
        b = open_nanoset(rest, index_of(rest, tmp_path / "b", **settings))
        assert len(a) == len(b) > 0
        assert not np.isin(a.document_index, ids).any()
        everything = np.arange(len(a))
        assert np.array_equal(a.get_batch(everything), b.get_batch(everything))


def test_growing_drops_masked_documents_and_keeps_every_other_split(tmp_path: Path) -> None:
    shards = _shards(tmp_path / "tokens")
    plain = virtual_merge(shards, tmp_path / "v0" / "docs_text_document").prefix
    masked = virtual_merge(shards, tmp_path / "v1" / "docs_text_document", masks=MASKS).prefix
    ids = masked_sequences(read_dataset_manifest(masked))
    settings = {"split_spec": "80,10,10", "sequence_length": 8, "seed": 3, "era_samples": 1}
    for split in ("train", "valid", "test"):
        before = index_of(plain, tmp_path / "c", split=split, semantics="growing", **settings)
        after = index_of(masked, tmp_path / "c", split=split, semantics="growing", **settings)
        assert before is not None and after is not None
        kept = before.document_index[~np.isin(before.document_index, ids)]
        assert np.array_equal(after.document_index, kept)  # nobody changes split
        # samples packed before the first removed document keep their rows
        gone = np.flatnonzero(np.isin(before.document_index, ids))
        if gone.size:
            first = int(gone[0])
            same = int(np.searchsorted(before.sample_index[:, 0], first, side="left"))
            rows = max(0, min(same, len(after.sample_index)) - 1)
            assert np.array_equal(after.sample_index[:rows], before.sample_index[:rows])
    table = growing.shard_lineage(masked)
    assert table != growing.shard_lineage(plain)  # a growing blend over it extends nothing


def test_a_malformed_mask_is_a_format_error(tmp_path: Path) -> None:
    shards = _shards(tmp_path / "tokens")
    out = virtual_merge(shards, tmp_path / "v" / "docs_text_document", masks=MASKS).prefix
    path = dataset_manifest_path(out)
    manifest = json.loads(path.read_text())
    assert manifest["shards"][2]["masked"] == [0, 5, 24]
    for bad, why in (([5, 0], "ascending"), ([25], "below"), ([1, 1], "ascending")):
        broken = json.loads(json.dumps(manifest))
        broken["shards"][2]["masked"] = bad
        with pytest.raises(FormatError, match=why):
            check_manifest(path, broken)
    unmasked = json.loads(json.dumps(manifest))
    del unmasked["shards"][2]["masked"]  # the content hash covers the masks
    with pytest.raises(FormatError, match="content_hash"):
        check_manifest(path, unmasked)


def test_masks_enter_the_merged_version_and_break_extension(tmp_path: Path) -> None:
    shards = _shards(tmp_path / "tokens")
    first = virtual_merge(shards[:3], tmp_path / "a" / "docs_text_document").manifest
    ids = shard_identities(first)
    assert merged_version("text", ids, "virtual", {}) == merged_version("text", ids, "virtual")
    masked_version = merged_version("text", ids, "virtual", {"part-00000": [2]})
    assert masked_version != merged_version("text", ids, "virtual")
    with pytest.raises(ValueError, match="virtual"):
        merged_version("text", ids, "physical", {"part-00000": [2]})
    grown = [(k, str(read_dataset_manifest(p)["content_hash"])) for k, p in shards[:4]]
    assert extends("v1", first, grown) == "v1"
    assert extends("v1", first, grown, {"part-00000": [2]}) is None  # a removal
    masked = virtual_merge(
        shards[:3], tmp_path / "b" / "docs_text_document", masks={"part-00000": [2]}
    ).manifest
    assert extends("v2", masked, grown, {"part-00000": [2]}) == "v2"  # same masks, a new shard
    assert extends("v2", masked, grown, {"part-00000": [2], "part-00003": [0]}) is None
