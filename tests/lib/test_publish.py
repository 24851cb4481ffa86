"""``tokenmill.storage.publish``: the one commit order of the pipeline's uploads and of ``pull``."""

from __future__ import annotations

import threading
import time

import pytest

from tokenmill.storage.publish import (
    commit_rank,
    delete_first,
    is_pointer,
    publish,
    publish_batches,
)

TREE = [
    "blends/mix/manifest.json",
    "blends/mix/versions/0123456789abcdef/manifest.json",
    "blends/mix/versions/0123456789abcdef/train-dataset_index.npy",
    "hf/docs/dataset_info.json",
    "hf/docs/data/s0.parquet",
    "merged/docs/current.json",
    "merged/docs/0123456789abcdef/docs_text_document.bin",
    "merged/docs/0123456789abcdef/docs_text_document.idx",
    "merged/docs/0123456789abcdef/docs_text_document.manifest.json",
    "nanoset/abc-Nanoset-train-description.json",
    "nanoset/abc-Nanoset-train-document_index.npy",
    "raw/docs/s0.quarantine.jsonl",
    "raw/docs/s0.stats.json",
]


def test_ranks_put_data_first_and_the_blend_pointer_last() -> None:
    assert publish_batches(TREE) == [
        [
            "blends/mix/versions/0123456789abcdef/train-dataset_index.npy",
            "hf/docs/data/s0.parquet",
            "merged/docs/0123456789abcdef/docs_text_document.bin",
            "merged/docs/0123456789abcdef/docs_text_document.idx",
            "nanoset/abc-Nanoset-train-document_index.npy",
            "raw/docs/s0.quarantine.jsonl",
        ],
        [
            "merged/docs/0123456789abcdef/docs_text_document.manifest.json",
            "nanoset/abc-Nanoset-train-description.json",
            "raw/docs/s0.stats.json",
        ],
        ["blends/mix/versions/0123456789abcdef/manifest.json", "hf/docs/dataset_info.json"],
        ["merged/docs/current.json"],
        ["blends/mix/manifest.json"],
    ]
    assert commit_rank("merged/docs_text_document.manifest.json") == 1  # the flat layout too
    assert commit_rank("tokens/docs/manifests/a_text_document.manifest.json") == 1  # sidecar
    assert [rel for rel in TREE if is_pointer(rel)] == [
        "blends/mix/manifest.json",
        "merged/docs/current.json",
    ]
    assert not delete_first("merged/docs/current.json")
    assert not delete_first("nanoset/abc-Nanoset-train-document_index.npy")
    assert not delete_first("nanoset/abc-Nanoset-train-description.json")  # content-addressed
    assert delete_first("merged/docs/0123456789abcdef/docs_text_document.manifest.json")
    assert delete_first("raw/docs/s0.stats.json") and delete_first("hf/docs/dataset_info.json")


@pytest.mark.parametrize("jobs", [1, 4])
def test_a_rank_starts_only_when_the_one_before_is_done(jobs: int) -> None:
    lock = threading.Lock()
    events: list[tuple[str, str]] = []

    def transfer(rel: str) -> str:
        with lock:
            events.append(("start", rel))
        time.sleep(0.01 if commit_rank(rel) == 0 else 0)
        with lock:
            events.append(("end", rel))
        return rel

    done = publish(TREE, transfer, jobs=jobs)
    assert done == [rel for batch in publish_batches(TREE) for rel in batch]
    for i, (what, rel) in enumerate(events):
        if what == "start":
            earlier = [r for r in TREE if commit_rank(r) < commit_rank(rel)]
            assert all(("end", r) in events[:i] for r in earlier), rel


def test_the_first_error_stops_later_ranks() -> None:
    seen: list[str] = []

    def transfer(rel: str) -> None:
        seen.append(rel)
        if rel.endswith(".bin"):
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        publish(TREE, transfer, jobs=2)
    assert all(commit_rank(rel) == 0 for rel in seen)
