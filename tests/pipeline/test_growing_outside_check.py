"""Issue 20's outside check of growing datasets, as written, through ``tokenmill materialize``:
split "80,10,10", ``train_samples: null``, sequence length 128, GPT-2; 10 shards, then 2 more
and materialize again. Version 1 still opens pinned; every split of version 2 starts with
version 1's samples; no version-1 valid/test document is in version-2 train, nor the reverse;
the refresh wrote at most the new shards' token bytes + 2 MB beyond their own files. Once for a
single-dataset blend, once for a blend of three datasets."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import yaml
from dagster import DagsterInstance
from pipeline_project import write_shard

from pipelines.materialize import materialize_recipe
from tokenmill.indices.blend_build import read_blend_manifest
from tokenmill.loader import open_blend
from tokenmill.recipe import load_recipe
from tokenmill_dev.corpus import stdlib_documents

SPLITS = ("train", "valid", "test")
DOCS = 8  # documents per shard


def _shard(source: Path, name: str, docs: list[dict[str, str]]) -> None:
    write_shard(source / f"{name}.jsonl", [{"text": d["text"][:2000]} for d in docs])


def _documents(mpath: Path, version: str, name: str) -> dict[str, set[int]]:
    """Global document ids of dataset ``name`` in each split of a blend version."""
    return {
        split: set(
            np.asarray(
                open_blend(mpath, split, version=version).datasets[name].document_index
            ).tolist()
        )
        for split in SPLITS
    }


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.mark.parametrize("names", [("docs",), ("docs", "code", "web")])
def test_outside_check(tmp_path: Path, gpt2_dir: Path, names: tuple[str, ...]) -> None:
    corpus = itertools.cycle(
        [d for d in stdlib_documents(kind="docs") if len(d["text"]) > 600][:200]
    )
    for name in names:
        for i in range(10):
            _shard(
                tmp_path / "sources" / name, f"part-{i:05d}", list(itertools.islice(corpus, DOCS))
            )
    recipe = {
        "storage": {"root": "data"},
        "tokenizer": {"path": str(gpt2_dir), "append_eod": True},
        "datasets": {name: {"source": f"sources/{name}"} for name in names},
        "nanoset": {
            "semantics": "growing",
            "sequence_length": 128,
            "split": "80,10,10",
            "train_samples": None,
        },
        "blends": {"mix": {"weights": {name: 1.0 for name in names}}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    loaded = load_recipe(path)
    root = Path(loaded.storage.root)
    mpath = root / "blends" / "mix" / "manifest.json"
    with DagsterInstance.ephemeral() as instance:
        assert materialize_recipe(loaded, instance) == 0
        v1 = read_blend_manifest(mpath)
        before = {name: _documents(mpath, v1["version"], name) for name in names}
        assert all(v1["splits"][s]["size"] > 0 for s in SPLITS)
        for name in names:
            for i in (10, 11):
                _shard(
                    tmp_path / "sources" / name,
                    f"part-{i:05d}",
                    list(itertools.islice(corpus, DOCS)),
                )
        files_before = _files(root)
        assert materialize_recipe(loaded, instance) == 0
    written = {
        rel: size
        for rel, (size, mtime) in _files(root).items()
        if files_before.get(rel) != (size, mtime)
    }
    new = ("part-00010", "part-00011")
    own = {rel: size for rel, size in written.items() if any(n in rel for n in new)}
    token_bytes = sum(size for rel, size in own.items() if rel.endswith("_text_document.bin"))
    assert token_bytes > 0
    assert sum(written.values()) - sum(own.values()) <= token_bytes + 2_000_000
    # the growing index entries of the refresh extend the previous ones: new rows only
    extended = [r for r in written if r.startswith("nanoset/") and r.endswith("description.json")]
    assert extended
    v2 = read_blend_manifest(mpath)
    assert v2["extends"] == v1["version"] != v2["version"]
    after = {name: _documents(mpath, v2["version"], name) for name in names}
    for name in names:
        old, grown = before[name], after[name]
        assert not (old["valid"] | old["test"]) & grown["train"]
        assert not old["train"] & (grown["valid"] | grown["test"])
        assert grown["train"] > old["train"]
    for split in SPLITS:
        pinned = open_blend(mpath, split, version=v1["version"], verify="full")
        current = open_blend(mpath, split, verify="full")
        assert pinned.version == v1["version"] and len(current) >= len(pinned) > 0
        ids = np.arange(len(pinned))
        np.testing.assert_array_equal(current.get_batch(ids), pinned.get_batch(ids))
        segments = [ds["index"]["files"] for ds in v2["splits"][split]["datasets"]]
        assert all("document.0" in files for files in segments), split
