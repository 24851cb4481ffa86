"""``nanoset.semantics: growing`` through ``tokenmill materialize``: add a shard and refresh;
the previous blend version still opens, no held-out document of it reaches train (nor the
reverse), and the new version extends it: every split starts with its samples."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from dagster import DagsterInstance
from pipeline_project import write_shard

from pipelines.materialize import materialize_recipe
from tokenmill.formats.blend_manifest import read_blend_manifest
from tokenmill.formats.dataset_manifest import read_dataset_manifest
from tokenmill.loader import open_blend
from tokenmill.recipe import Recipe

SPLITS = ("train", "valid", "test")


def _documents(mpath: Path, version: str, name: str) -> dict[str, set[int]]:
    """Global document ids of dataset ``name`` in each split of a blend version."""
    out = {}
    for split in SPLITS:
        ds = open_blend(mpath, split, version=version, verify="full")
        out[split] = set(np.asarray(ds.datasets[name].document_index).tolist())
    return out


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: relative path -> (size, mtime_ns)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def _changed(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> dict[str, int]:
    """Files new or rewritten between two snapshots, with their sizes."""
    return {rel: size for rel, (size, mtime) in after.items() if before.get(rel) != (size, mtime)}


def test_growing_refresh(
    make_recipe: Callable[..., Recipe],
    instance: DagsterInstance,
    documents: dict[str, list[dict[str, str]]],
) -> None:
    recipe = make_recipe(nanoset={"semantics": "growing", "era_samples": 8, "train_samples": None})
    assert materialize_recipe(recipe, instance) == 0
    mpath = Path(recipe.storage.root) / "blends" / "mix" / "manifest.json"
    v1 = read_blend_manifest(mpath)
    assert v1["semantics"] == "growing" and v1["extends"] is None
    assert all(v1["splits"][s]["size"] > 0 for s in SPLITS)
    before = {name: _documents(mpath, v1["version"], name) for name in ("docs", "code")}
    late = [{"text": d["text"][::-1]} for d in documents["docs"][:20]]
    write_shard(Path(recipe.dataset("docs").source) / "zz-late-00000.jsonl", late)
    root = Path(recipe.storage.root)
    files_before = _files(root)
    assert materialize_recipe(recipe, instance) == 0
    # O(new data): beyond the new shard's own files, the refresh wrote at most its token bytes
    # + 2 MB (a virtual merge copies no token; indices and blend arrays are small)
    written = _changed(files_before, _files(root))
    own = {rel: size for rel, size in written.items() if "zz-late-00000" in rel}
    token_bytes = sum(size for rel, size in own.items() if rel.endswith("_text_document.bin"))
    assert token_bytes > 0
    assert sum(written.values()) - sum(own.values()) <= token_bytes + 2_000_000
    assert not [rel for rel in written if rel.startswith("merged/") and rel.endswith(".bin")]
    v2 = read_blend_manifest(mpath)
    assert v2["version"] != v1["version"]
    after = {name: _documents(mpath, v2["version"], name) for name in ("docs", "code")}
    for name in ("docs", "code"):
        old, new = before[name], after[name]
        assert not (old["valid"] | old["test"]) & new["train"]
        assert not old["train"] & (new["valid"] | new["test"])
    assert len(after["docs"]["train"]) > len(before["docs"]["train"])
    # the default virtual merge lists its shards in append order: the refresh extends v1
    assert "shards" in read_dataset_manifest(mpath.parent / v2["datasets"][0]["prefix"])
    assert v2["extends"] == v1["version"]
    for split in SPLITS:
        old = open_blend(mpath, split, version=v1["version"])
        new = open_blend(mpath, split)
        assert new.extends == v1["version"] and len(new) >= len(old)
        ids = np.arange(len(old))
        np.testing.assert_array_equal(new.get_batch(ids), old.get_batch(ids))
