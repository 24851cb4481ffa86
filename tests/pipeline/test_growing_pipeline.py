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
from tokenmill.formats.dataset_manifest import read_dataset_manifest
from tokenmill.indices.blend_build import read_blend_manifest
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
    assert materialize_recipe(recipe, instance) == 0
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
