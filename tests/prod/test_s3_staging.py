"""What S3 steps transfer (moto_server, every request counted at the pipeline's client): a run
downloads each object at most once (the run cache), a step staging ``P.idx`` and
``P.manifest.json`` downloads no ``.bin``, and a refresh with unchanged inputs finds its Nanoset
indices on S3 by key: nothing rebuilt, no index array downloaded or uploaded."""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dagster import DagsterInstance, materialize
from pipeline_project import materialize_shards
from prod_servers import S3
from test_s3_pipeline import s3_recipe

import tokenmill.indices.nanoset
from assets.factory import build_assets
from assets.support.resources import StorageResource
from assets.support.sources import list_shards
from pipelines.build import resources_for
from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.indices.nanoset import build_or_load, cache_paths
from tokenmill.indices.settings import NanosetSettings
from tokenmill.storage import layout
from tokenmill.storage import s3 as storage_s3
from tokenmill.storage import staging as s3_stage
from tokenmill.storage.run_cache import RunCache
from tokenmill.storage.s3 import S3Object, shared_client


class Requests:
    """S3 requests made through the pipeline's clients: ``(operation, key)`` counts, and bytes
    of PutObject/UploadPart bodies and GetObject answers."""

    def __init__(self) -> None:
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.get_bytes = 0

    def clear(self) -> None:
        self.calls.clear()
        self.get_bytes = 0

    def count(self, operation: str, contains: str = "") -> int:
        return sum(n for (op, key), n in self.calls.items() if op == operation and contains in key)

    def keys(self, operation: str) -> list[str]:
        return sorted(key for op, key in self.calls if op == operation)


@pytest.fixture
def requests(s3: S3, monkeypatch: pytest.MonkeyPatch) -> Iterator[Requests]:
    """Every request of the clients the library's factory (``shared_client``) builds during
    the test is counted: staging, listing, pull."""
    seen = Requests()

    def before(model: Any, params: Any, **_: Any) -> None:
        key = params.get("url_path", "") if isinstance(params, dict) else ""
        seen.calls[(model.name, key.split("?", 1)[0])] += 1

    def after(parsed: Any, model: Any, **_: Any) -> None:
        if model.name == "GetObject":
            seen.get_bytes += int(parsed.get("ContentLength") or 0)

    original = storage_s3.make_client

    def counted(endpoint: str | None, **config: Any) -> Any:
        made = original(endpoint, **config)
        made.meta.events.register("before-call.s3", before)
        made.meta.events.register("after-call.s3", after)
        return made

    monkeypatch.setattr(storage_s3, "_CLIENTS", {})  # clients of earlier tests are not counted
    monkeypatch.setattr(storage_s3, "make_client", counted)
    yield seen


def run_shards(recipe: Any, instance: DagsterInstance, work: Path) -> None:
    """Every shard partition of every dataset through its stages (one run each)."""
    graph = build_assets(recipe)
    resources = resources_for(recipe)
    resources["storage"] = storage_for(recipe, work)
    for ds in recipe.datasets:
        keys = sorted(list_shards(ds).shards)
        results = materialize_shards(graph, instance, resources, ds.name, keys)
        assert [result.success for result in results] == [True] * len(keys)


def storage_for(recipe: Any, work: Path) -> StorageResource:
    return StorageResource(
        root=recipe.storage.root, s3_endpoint_url=recipe.storage.s3_endpoint_url, work_dir=str(work)
    )


def downstream_run(
    recipe: Any, instance: DagsterInstance, work: Path, names: list[str], *, checks: bool = True
) -> Any:
    """One run of the named unpartitioned assets (and their checks)."""
    assets, asset_checks = build_assets(recipe)
    resources = resources_for(recipe)
    resources["storage"] = storage_for(recipe, work)
    selection = [a.key for a in assets if a.key.to_user_string() in names]
    result = materialize(
        [*assets, *(asset_checks if checks else [])],
        instance=instance,
        resources=resources,
        selection=selection,
    )
    assert result.success and all(e.passed for e in result.get_asset_check_evaluations())
    return result


def test_one_run_downloads_each_object_once_and_refreshes_find_indices_by_key(
    s3: S3, requests: Requests, gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, s3.bucket)
    work = tmp_path / "work"
    staged: collections.Counter[str] = collections.Counter()
    get = s3_stage.S3Stage.get

    def counting_get(self: s3_stage.S3Stage, obj: S3Object, rel: str) -> None:
        staged[rel] += 1
        get(self, obj, rel)

    monkeypatch.setattr(s3_stage.S3Stage, "get", counting_get)
    with DagsterInstance.ephemeral() as instance:
        run_shards(recipe, instance, work)
        downstream_run(recipe, instance, work, ["docs/merged", "docs/nanoset"])
        # The nanoset step and its check again, all inputs on S3: every object staged by the
        # run's step and check is downloaded at most once.
        requests.clear()
        staged.clear()
        downstream_run(recipe, instance, work, ["docs/nanoset"])
        gets = collections.Counter(
            key for op, key in requests.calls.elements() if op == "GetObject"
        )
        assert gets and max(gets.values()) == 1, gets
        # an index description: staged by the nanoset step (to compare with its key) and by
        # the index_bounds check, downloaded once
        descriptions = [rel for rel in staged if rel.endswith("-Nanoset-train-description.json")]
        assert [staged[rel] for rel in descriptions] == [2]
        assert requests.count("GetObject", "-Nanoset-train-description.json") == 1
        # the shard .idx files the virtual merge names: staged by the nanoset step and its
        # check, each downloaded once
        idx = [rel for rel in staged if rel.endswith("_text_document.idx")]
        assert idx and all(rel.startswith("tokens/docs/") for rel in idx)
        assert all(staged[rel] == 2 and requests.count("GetObject", rel) == 1 for rel in idx)
        assert requests.count("GetObject", ".bin") == 0  # nothing here reads tokens
        assert list(work.iterdir()) == []  # the run's cache went with the run

        # A refresh with nothing changed: the index entries are found on S3 by key.
        built = []
        monkeypatch.setattr(tokenmill.indices.nanoset, "_build_entry", lambda *a: built.append(a))
        requests.clear()
        result = downstream_run(recipe, instance, work, ["docs/nanoset"], checks=False)
    assert built == []
    assert requests.count("PutObject") == requests.count("CreateMultipartUpload") == 0
    assert requests.count("GetObject", ".bin") == requests.count("GetObject", ".npy") == 0
    assert requests.count("GetObject", "-description.json") == 3  # one small GET per split
    materialization = result.asset_materializations_for_node("docs__nanoset")[0]
    table = materialization.metadata["splits"].value
    assert table.count("| stored |") == 3, table


def test_a_workspace_stages_exact_files(s3: S3, requests: Requests, tmp_path: Path) -> None:
    prefix = tmp_path / "src" / "merged" / "d_text_document"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(rng.integers(0, 500, 4000), np.full(40, 100))
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={})
    s3.upload_tree(tmp_path / "src", "root")
    storage = StorageResource(root=f"s3://{s3.bucket}/root", work_dir=str(tmp_path / "work"))
    rel = "merged/d_text_document"
    manifest = layout.dataset_manifest(rel)  # merged/manifests/d_text_document.manifest.json
    with storage.workspace([f"{rel}.idx", layout.dataset_manifest(rel)], upload=False) as ws:
        assert ws.stage is not None
        assert sorted(ws.stage.fetched) == sorted([f"{rel}.idx", manifest])
        assert not (ws.storage.local_root() / f"{rel}.bin").exists()
    got = [key.split("/root/", 1)[1] for key in requests.keys("GetObject")]
    assert sorted(got) == sorted([f"{rel}.idx", manifest])
    requests.clear()
    with storage.workspace(layout.dataset_files(rel), upload=False) as ws:  # the whole dataset
        assert ws.stage is not None
        assert sorted(ws.stage.fetched) == sorted([f"{rel}.bin", f"{rel}.idx", manifest])
    assert requests.count("GetObject", ".bin") == 1


def test_fetch_hook_brings_a_stored_index_entry(
    s3: S3, requests: Requests, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the blend step does: ``build_or_load(..., fetch=ws.fetch_index_entry)`` loads an
    entry stored on S3 (arrays before description) instead of building and uploading it."""
    src = tmp_path / "src"
    prefix = src / "merged" / "d_text_document"
    rng = np.random.default_rng(1)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        lengths = rng.integers(20, 180, 40)
        writer.add_documents(rng.integers(0, 500, int(lengths.sum())), lengths)
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={})
    settings = NanosetSettings(split_spec="90,10,0", sequence_length=16)
    first = build_or_load(prefix, src / "nanoset", "train", settings)
    assert first is not None
    s3.upload_tree(src, "root")
    storage = StorageResource(root=f"s3://{s3.bucket}/root", work_dir=str(tmp_path / "work"))
    monkeypatch.setattr(
        tokenmill.indices.nanoset, "_build_entry", lambda *a: pytest.fail("rebuilt")
    )
    with storage.workspace(["merged/d_text_document"]) as ws:
        local = ws.storage.path("merged/d_text_document")
        index = build_or_load(
            local, ws.storage.nanoset_dir(), "train", settings, fetch=ws.fetch_index_entry
        )
        assert index is not None and index.cache_hash == first.cache_hash
        np.testing.assert_array_equal(index.shuffle_index, first.shuffle_index)
        order = [k for op, k in requests.calls if op == "GetObject" and "nanoset" in k]
        assert order[-1].endswith("-description.json") and len(order) == 4
    assert requests.count("PutObject") == 0  # fetched, unchanged: nothing to upload

    paths = cache_paths(tmp_path / "elsewhere", first.cache_hash, "valid")  # not on S3
    with storage.workspace(upload=False) as ws:
        moved = {name: ws.storage.nanoset_dir() / p.name for name, p in paths.items()}
        assert ws.fetch_index_entry(moved) is False


def test_run_cache_entries_are_keyed_by_etag_and_size_and_survive_edits(
    s3: S3, requests: Requests, tmp_path: Path
) -> None:
    client = shared_client(s3.endpoint)
    s3.client.put_object(Bucket=s3.bucket, Key="root/a.txt", Body=b"first")
    cache = RunCache.open(tmp_path / "work", "run-1", max_age_hours=1)

    def stage(name: str) -> s3_stage.S3Stage:
        made = s3_stage.S3Stage(client, s3.bucket, "root", tmp_path / name, cache)
        made.fetch(["a.txt"])
        return made

    one = stage("one")
    stage("two")
    assert requests.count("GetObject") == 1  # the second stage got a link
    assert (tmp_path / "two/a.txt").read_bytes() == b"first"
    assert one.push() == []  # linked, unchanged: nothing to upload

    path = tmp_path / "one/a.txt"  # a step that rewrites its copy in place
    path.chmod(0o644)
    with open(path, "r+b") as fh:
        fh.write(b"FIRST")
    stage("three")
    assert requests.count("GetObject") == 2  # the edited entry no longer counts
    assert (tmp_path / "three/a.txt").read_bytes() == b"first"
    assert one.push() == ["a.txt"]  # uploaded, and kept by the cache under its new ETag
    stage("four")
    assert requests.count("GetObject") == 2
    assert (tmp_path / "four/a.txt").read_bytes() == b"FIRST"

    s3.client.put_object(Bucket=s3.bucket, Key="root/a.txt", Body=b"second!")
    stage("five")
    assert (tmp_path / "five/a.txt").read_bytes() == b"second!"
    assert requests.count("GetObject") == 3  # another ETag and size: another entry


def test_abandoned_run_caches_are_removed_by_age(tmp_path: Path) -> None:
    base = tmp_path / "work"
    old = RunCache.open(base, "old-run", max_age_hours=1)
    (old.root / "objects").mkdir()
    (old.root / "objects" / "x").write_bytes(b"x")
    recent = RunCache.open(base, "recent-run", max_age_hours=1)
    hours_ago = time.time() - 2 * 3600
    os.utime(old.root, (hours_ago, hours_ago))
    current = RunCache.open(base, "new-run", max_age_hours=1)
    assert sorted(p.name for p in base.iterdir()) == [current.root.name, recent.root.name]
    current.remove()
    assert not current.root.exists()


def test_unchanged_blend_refresh_uploads_no_array(
    s3: S3, requests: Requests, gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blend step on an S3 root: a second run with nothing changed stages its existing
    version and the index entries it reads, builds nothing and uploads no ``.npy`` (only the
    pointer, rewritten with the same bytes), and never downloads a merged ``.bin``."""
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, s3.bucket)
    work = tmp_path / "work"
    everything = [f"{ds}/{stage}" for ds in ("docs", "code") for stage in ("merged", "nanoset")] + [
        "blend/mix"
    ]
    with DagsterInstance.ephemeral() as instance:
        run_shards(recipe, instance, work)
        downstream_run(recipe, instance, work, everything)
        assert requests.count("PutObject", "versions/") > 0  # the first run wrote a version
        built = []
        monkeypatch.setattr(tokenmill.indices.nanoset, "_build_entry", lambda *a: built.append(a))
        requests.clear()
        result = downstream_run(recipe, instance, work, ["blend/mix"], checks=False)
    assert result.success and built == []
    assert requests.count("PutObject", ".npy") == 0
    assert requests.count("PutObject", "versions/") == 0
    assert requests.count("GetObject", ".bin") == 0


def test_a_second_push_of_one_pair_never_takes_its_manifest_away(
    s3: S3, requests: Requests, tmp_path: Path
) -> None:
    """Two runs of one shard (on two hosts sharing the bucket) push the same pair: the second
    neither deletes the stored manifest nor uploads it again. A manifest vouching for the same
    files with another setting (the engine) is overwritten, not deleted first; one for other
    content is still deleted before its data is replaced."""
    rel = "tokens/d/s_text_document"
    manifest = layout.dataset_manifest(rel)

    def push(name: str, seed: int, engine: str) -> list[str]:
        local = tmp_path / name
        with IndexedDatasetWriter(local / rel, np.uint16) as writer:
            writer.add_documents(np.random.default_rng(seed).integers(0, 500, 400), np.full(4, 100))
        config = {"engine": engine}
        write_dataset_manifest(local / rel, kind="tokens", inputs=[], config=config, counts={})
        requests.clear()
        return s3_stage.S3Stage.open(f"s3://{s3.bucket}/root", None, local).push()

    def stored() -> bytes:
        return bytes(s3.client.get_object(Bucket=s3.bucket, Key=f"root/{manifest}")["Body"].read())

    pair = [f"{rel}.bin", f"{rel}.idx"]
    assert push("first", 0, "gigatoken") == [*pair, manifest]
    first = stored()
    assert push("again", 0, "gigatoken") == pair
    assert requests.count("DeleteObject") == requests.count("PutObject", ".manifest.json") == 0
    assert stored() == first
    assert push("engine", 0, "tiktoken") == [*pair, manifest]
    assert requests.count("DeleteObject") == 0 and requests.count("PutObject", manifest) == 1
    assert json.loads(stored())["config"] == {"engine": "tiktoken"}
    assert push("other", 1, "tiktoken") == [*pair, manifest]
    assert requests.count("DeleteObject", manifest) == 1
