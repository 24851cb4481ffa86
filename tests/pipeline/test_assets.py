"""Each asset invoked directly with ``build_asset_context``: files written, metadata reported."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from dagster import (
    AssetKey,
    AssetRecordsFilter,
    AssetsDefinition,
    DagsterInstance,
    MaterializeResult,
    build_asset_context,
)

from assets.factory import build_assets
from assets.support.partitions import check_partition_key, partitions_name
from assets.support.resources import StorageResource
from pipelines.build import build_definitions, resources_for
from pipelines.jobs import SHARD_STAGES
from pipelines.sensors import RANGE_END, RANGE_START
from tokenmill.errors import ConfigError, InputError
from tokenmill.formats.dataset_manifest import open_dataset, write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.loader import open_blend
from tokenmill.recipe import Recipe
from tokenmill.storage import layout
from tokenmill.storage.versions import write_pointer

Assets = dict[AssetKey, AssetsDefinition]


@pytest.fixture
def defs(recipe: Recipe) -> dict[AssetKey, AssetsDefinition]:
    """The recipe's assets, unbound (resources come from the invocation context)."""
    return {a.key: a for a in build_assets(recipe)[0]}


Run = Callable[..., MaterializeResult]


@pytest.fixture
def run(defs: Assets, resources: dict[str, object], instance: DagsterInstance) -> Run:
    """``run(key, partition=None)``: ``run_asset`` of the tiny recipe's asset ``key``."""
    return lambda key, partition=None: run_asset(defs, key, resources, instance, partition)


def run_asset(
    defs: Assets,
    key: list[str],
    resources: dict[str, object],
    instance: DagsterInstance,
    partition: str | None = None,
) -> MaterializeResult:
    """Invoke one asset's function the way a run would, outside any run."""
    asset = defs[AssetKey(key)]
    with build_asset_context(
        resources=resources, instance=instance, partition_key=partition
    ) as context:
        result = asset(context)
    assert isinstance(result, MaterializeResult)
    return result


def value(result: MaterializeResult, name: str) -> object:
    entry = (result.metadata or {})[name]
    return getattr(entry, "value", entry)


def test_every_stage_of_one_recipe(
    recipe: Recipe, storage: StorageResource, instance: DagsterInstance, run: Run
) -> None:
    keys = {"docs": ["extra-00000", "part-00000", "part-00001", "part-00002"]}
    keys["code"] = ["part-00000", "part-00001"]
    for ds, shards in keys.items():
        instance.add_dynamic_partitions(partitions_name(ds), shards)
        for shard in shards:
            for stage in SHARD_STAGES:
                result = run([ds, stage], shard)
            assert value(result, "documents") == value(result, "sequences")
            assert value(result, "kept") is False and float(value(result, "tokens_per_second")) > 0
    raw = run(["docs", "raw_jsonl"], "extra-00000")
    assert (value(raw, "lines"), value(raw, "documents"), value(raw, "quarantined")) == (13, 10, 3)
    raw_histogram = str(value(raw, "length_histogram"))
    assert "| characters from | count | |" in raw_histogram and len(raw_histogram) < 1000
    quarantine = storage.quarantine_path("docs", "extra-00000").read_text().splitlines()
    assert [json.loads(q)["line"] for q in quarantine] == [2, 3, 4]
    hf = run(["docs", "hf_dataset"], "extra-00000")
    assert value(hf, "documents") == 10 == pq.read_metadata(value(hf, "path")).num_rows
    pair = storage.tokens_prefix("docs", "extra-00000", "text").with_suffix(".bin").stat()
    tokens = run(["docs", "tokens"], "extra-00000")
    assert value(tokens, "dtype") == "uint16" and len(str(value(tokens, "content_hash"))) == 64
    # its Parquet as before: the pair is kept as it is, no rate to report
    assert value(tokens, "kept") is True and "tokens_per_second" not in (tokens.metadata or {})
    again = storage.tokens_prefix("docs", "extra-00000", "text").with_suffix(".bin").stat()
    assert (again.st_ino, again.st_mtime_ns) == (pair.st_ino, pair.st_mtime_ns)
    assert value(tokens, "tokenizer_fingerprint")
    histogram = str(value(tokens, "length_histogram"))
    assert "| tokens from | count | |" in histogram and "\u2588" in histogram
    assert len(histogram) < 1000  # the Dagster UI draws it inline

    merged = run(["docs", "merged"])
    assert value(merged, "documents") == 40 and value(merged, "shards") == 4
    version = str(value(merged, "version"))
    assert value(merged, "reused_version") is False
    prefix = storage.merged_prefix("docs", "text")
    assert prefix.parent.name == version[:16]
    with open_dataset(prefix) as data:
        assert data.num_documents == 40
    again = run(["docs", "merged"])
    assert value(again, "version") == version and value(again, "reused_version") is True
    info = run(["docs", "dataset_info"])
    assert value(info, "shards") == 4 and value(info, "rows") == 40
    run(["code", "merged"])
    for ds in ("docs", "code"):
        index = run([ds, "nanoset"])
        assert int(value(index, "train_samples")) >= 120  # whole epochs (megatron)
        assert int(value(index, "valid_samples")) > 0
    blend = run(["blend", "mix"])
    assert value(blend, "train_samples") == 120
    assert "| train | docs | 0.7000 |" in str(value(blend, "proportions"))
    manifest = Path(str(value(blend, "path")))
    assert manifest == storage.blend_dir("mix") / "manifest.json"
    assert open_blend(manifest, split="train").get_batch(np.arange(4)).shape == (4, 33)


def test_vanished_shard_is_reported_and_pruned(
    recipe: Recipe, storage: StorageResource, instance: DagsterInstance, run: Run
) -> None:
    shards = ["part-00000", "part-00001"]
    instance.add_dynamic_partitions(partitions_name("code"), shards)
    for shard in shards:
        for stage in SHARD_STAGES:
            run(["code", stage], shard)
    first = run(["code", "merged"])
    old_prefix = storage.merged_prefix("code", "text")
    instance.delete_dynamic_partition(partitions_name("code"), "part-00001")
    merged = run(["code", "merged"])
    assert value(merged, "shards") == 1 and value(merged, "previous_version") == value(
        first, "version"
    )
    assert storage.parquet_path("code", "part-00001").exists()  # the merge prunes nothing
    dochash = storage.path(layout.dochash("code", "part-00001"))
    assert dochash.is_file()
    assert open_dataset(old_prefix).num_documents > 0  # the old version stays for pinned jobs
    assert storage.merged_prefix("code", "text") != old_prefix
    pruned = run(["code", "pruned"])
    assert value(pruned, "shards_removed") == ["part-00001"] and value(pruned, "files_removed") > 0
    assert not storage.parquet_path("code", "part-00001").exists()
    assert not storage.export_record_path("code", "part-00001").exists()
    assert not storage.raw_stats_path("code", "part-00001").exists()
    assert not dochash.exists()
    # the old (virtual) version still reads part-00001's tokens in place: they stay until it goes
    gone = storage.tokens_prefix("code", "part-00001", "text").with_suffix(".bin")
    assert value(pruned, "tokens_kept_for_versions") == ["part-00001"] and gone.exists()
    assert storage.tokens_prefix("code", "part-00000", "text").with_suffix(".bin").exists()
    shutil.rmtree(old_prefix.parent)  # as `tokenmill gc` removes an old version
    again = run(["code", "pruned"])
    assert value(again, "tokens_kept_for_versions") == [] and not gone.exists()
    run(["code", "dataset_info"])
    info = json.loads((storage.hf_dir("code") / "dataset_info.json").read_text())
    assert "part-00001" not in json.dumps(info) and "part-00000" in json.dumps(info)


def test_pruned_keeps_a_shard_registered_while_it_listed(
    storage: StorageResource, instance: DagsterInstance, monkeypatch: pytest.MonkeyPatch, run: Run
) -> None:
    """A shard registered and tokenized while ``pruned`` lists the files is not removed: the
    step reads the partitions after the listing. Reading them first, a refresh's ``pruned``
    deleted the token pair ``tokenmill materialize`` had just made for a new shard, and the
    merge check then failed ("its token pair is gone"; found by test_pointer_history)."""
    instance.add_dynamic_partitions(partitions_name("code"), ["part-00000"])
    for stage in SHARD_STAGES:
        run(["code", stage], "part-00000")
    run(["code", "merged"])
    listing, arrived = StorageResource.list_keys, []

    def arrives(self: StorageResource, folders: list[str]) -> list[str]:
        if not arrived:  # the shard is registered and its files written meanwhile
            arrived.append(True)
            instance.add_dynamic_partitions(partitions_name("code"), ["part-00001"])
            for stage in SHARD_STAGES:
                run(["code", stage], "part-00001")
        return listing(self, folders)

    monkeypatch.setattr(StorageResource, "list_keys", arrives)
    pruned = run(["code", "pruned"])
    assert arrived and value(pruned, "shards_removed") == []
    assert storage.tokens_prefix("code", "part-00001", "text").with_suffix(".bin").exists()


def test_shard_missing_from_source_fails_clearly(instance: DagsterInstance, run: Run) -> None:
    instance.add_dynamic_partitions(partitions_name("docs"), ["nope"])
    with pytest.raises(InputError, match=r"shard 'nope' is not in .* any more"):
        run(["docs", "raw_jsonl"], "nope")


UNSAFE_KEYS = ["..", "a/../b", "/etc/passwd", "a\\b", "bad\x07key", "", ".hidden"]


@pytest.mark.parametrize("key", UNSAFE_KEYS)
def test_unsafe_partition_keys_are_rejected(key: str, storage: StorageResource) -> None:
    with pytest.raises(ConfigError, match=r"partition key .* rejected"):
        check_partition_key(key)
    with pytest.raises(ConfigError, match="rejected"):
        storage.tokens_prefix("docs", key, "text")


def test_blend_passes_the_megatron_flags_and_reports_empty_splits(
    make_recipe: Callable[..., Recipe], instance: DagsterInstance
) -> None:
    """The recipe's nanoset flags reach the blend; a dataset with no test sequences (80 of
    them with "949,50,1") is left out of the test split (``allow_empty_splits``; without it the
    blend fails: tests/pipeline/test_bad_input.py), reported in the metadata."""
    flags = {"add_extra_token": False, "drop_last_partial_validation": False}
    mix = {"weights": {"docs": 0.7, "code": 0.3}, "allow_empty_splits": True}
    recipe = make_recipe(nanoset={"split": "949,50,1", **flags}, blends={"mix": mix})
    resources = resources_for(recipe)
    storage = resources["storage"]
    assert isinstance(storage, StorageResource)
    for ds, n_docs, digit in (("docs", 1200, "1"), ("code", 80, "2")):
        version = digit * 64
        prefix = storage.path(layout.merged_prefix(ds, "text", version))
        rng = np.random.default_rng(n_docs)
        lengths = rng.integers(1, 60, n_docs)
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            writer.add_documents(rng.integers(0, 50000, int(lengths.sum())), lengths)
        write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={})
        write_pointer(storage.merged_pointer_path(ds), version, f"{digit * 16}/{prefix.name}")
    defs = {a.key: a for a in build_assets(recipe)[0]}
    blend = run_asset(defs, ["blend", "mix"], resources, instance)
    skipped = value(blend, "skipped")
    assert isinstance(skipped, list) and len(skipped) == 1
    assert "dataset 'code' is left out of split 'test'" in skipped[0]
    manifest = json.loads(Path(str(value(blend, "path"))).read_text())
    assert manifest["add_extra_token"] is False
    assert manifest["drop_last_partial_validation"] is False
    assert [d["name"] for d in manifest["splits"]["test"]["datasets"]] == ["docs"]
    train = open_blend(Path(str(value(blend, "path"))), split="train")
    assert train.get_batch(np.arange(4)).shape == (4, 32)


def test_a_range_run_gives_each_shard_page_its_own_metadata(
    recipe: Recipe, instance: DagsterInstance
) -> None:
    """Issue 21 §6: a shard processed inside a range shows its own counts, path, dtype,
    tokenizer fingerprint and histogram on its partition page, not the range's totals."""
    keys = ["extra-00000", "part-00000", "part-00001", "part-00002"]
    instance.add_dynamic_partitions(partitions_name("docs"), keys)
    job = build_definitions(recipe).resolve_job_def("docs_shard_job")
    tags = {RANGE_START: keys[0], RANGE_END: keys[-1]}
    assert job.execute_in_process(instance=instance, tags=tags).success
    pages = {}
    for stage in SHARD_STAGES:
        for key in keys:
            query = AssetRecordsFilter(asset_key=AssetKey(["docs", stage]), asset_partitions=[key])
            [record] = instance.fetch_materializations(query, limit=1).records
            meta = record.asset_materialization.metadata  # type: ignore[union-attr]
            pages[stage, key] = {name: getattr(v, "value", v) for name, v in meta.items()}
            assert key in str(pages[stage, key]["path"]), (stage, key)
    storage = resources_for(recipe)["storage"]
    assert isinstance(storage, StorageResource)
    fingerprint = resources_for(recipe)["tokenizer"].info().fingerprint  # type: ignore[attr-defined]
    for key in keys:
        tokens = pages["tokens", key]
        with open_dataset(storage.tokens_prefix("docs", key, "text")) as data:
            assert (tokens["documents"], tokens["tokens"]) == (data.num_documents, data.num_tokens)
        assert (tokens["dtype"], tokens["tokenizer_fingerprint"]) == ("uint16", fingerprint)
        assert "| tokens from | count | |" in str(tokens["length_histogram"])
        assert "| characters from | count | |" in str(pages["raw_jsonl", key]["length_histogram"])
    raw = {key: pages["raw_jsonl", key] for key in keys}
    assert [(r["lines"], r["documents"], r["quarantined"]) for r in raw.values()] == [
        (13, 10, 3),
        (10, 10, 0),
        (10, 10, 0),
        (10, 10, 0),
    ]
    assert len({pages["tokens", key]["content_hash"] for key in keys}) == 4
