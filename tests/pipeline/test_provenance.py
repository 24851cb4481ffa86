"""Raw stats, quarantine and ``dataset_info.json``: what they record (format version, inputs with
sha256, config, counts, the quarantine's size and sha256), byte-identical reruns, and exactly one
writer of each file (the hf step never touches the quarantine)."""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dagster import AssetKey, AssetsDefinition, DagsterInstance, build_asset_context

from assets.factory import build_assets
from assets.support.partitions import partitions_name
from assets.support.resources import StorageResource
from pipelines.build import resources_for
from tokenmill.atomic import file_sha256
from tokenmill.errors import InputError
from tokenmill.formats.dataset_manifest import FORMAT_VERSION
from tokenmill.recipe import Recipe
from tokenmill.storage import layout

SHARD = "extra-00000"  # docs: 10 documents and 3 bad lines (pipeline_project.BAD_LINES)


def run_asset(
    recipe: Recipe,
    resources: dict[str, object],
    instance: DagsterInstance,
    key: list[str],
    *part: str,
) -> Any:
    """Invoke one asset's function the way a run would (a shard asset: for ``part``, added to
    the dataset's partitions first if new)."""
    if part:
        name = partitions_name(key[0])
        if part[0] not in instance.get_dynamic_partitions(name):
            instance.add_dynamic_partitions(name, [part[0]])
    assets: dict[AssetKey, AssetsDefinition] = {a.key: a for a in build_assets(recipe)[0]}
    with build_asset_context(
        resources=resources, instance=instance, partition_key=part[0] if part else None
    ) as context:
        return assets[AssetKey(key)](context)


def files(storage: StorageResource, ds: str, shard: str) -> dict[str, bytes]:
    """The bytes of a shard's stats, quarantine, document hashes and export record."""
    paths = (
        storage.raw_stats_path(ds, shard),
        storage.quarantine_path(ds, shard),
        storage.path(layout.dochash(ds, shard)),
        storage.export_record_path(ds, shard),
    )
    return {p.name: p.read_bytes() for p in paths if p.is_file()}


def stamp(path: Path) -> tuple[int, int, bytes]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, path.read_bytes()


Run = Callable[..., Any]


@pytest.fixture
def run(recipe: Recipe, resources: dict[str, object], instance: DagsterInstance) -> Run:
    """``run(key, *part)``: ``run_asset`` on the tiny recipe, its resources and instance."""
    return functools.partial(run_asset, recipe, resources, instance)


def test_raw_stats_record_input_config_counts_and_quarantine(
    recipe: Recipe, storage: StorageResource, run: Run
) -> None:
    run(["docs", "raw_jsonl"], SHARD)
    source = Path(recipe.dataset("docs").source) / f"{SHARD}.jsonl"
    quarantine = storage.quarantine_path("docs", SHARD)
    stats = json.loads(storage.raw_stats_path("docs", SHARD).read_text())
    assert stats == {
        "format_version": FORMAT_VERSION,
        "shard": SHARD,
        "input": {
            "uri": str(source),
            "bytes": source.stat().st_size,
            "sha256": file_sha256(source),
        },
        "config": {"text_key": "text", "on_bad_record": "quarantine"},
        "lines": 13,
        "documents": 10,
        "empty_documents": 0,
        "blank": 0,
        "quarantined": 3,
        "bytes_read": source.stat().st_size,
        "bom": False,
        "crlf_lines": 0,
        "missing_final_newline": False,
        "quarantine": {
            "file": quarantine.name,
            "bytes": quarantine.stat().st_size,
            "sha256": file_sha256(quarantine),
        },
    }
    records = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert [(r["line"], r["source"]) for r in records] == [(n, str(source)) for n in (2, 3, 4)]


def test_fail_mode_stats_name_no_quarantine(make_recipe: Any, instance: DagsterInstance) -> None:
    recipe = make_recipe(datasets={"code": {"source": "sources/code", "on_bad_record": "fail"}})
    resources = resources_for(recipe)
    storage = resources["storage"]
    assert isinstance(storage, StorageResource)
    run_asset(recipe, resources, instance, ["code", "raw_jsonl"], "part-00001")
    stats = json.loads(storage.raw_stats_path("code", "part-00001").read_text())
    source = Path(recipe.dataset("code").source) / "part-00001.jsonl.gz"
    assert stats["input"] == {
        "uri": str(source),
        "bytes": source.stat().st_size,
        "sha256": file_sha256(source),
    }
    assert (stats["config"]["on_bad_record"], stats["quarantine"]) == ("fail", None)
    assert not storage.quarantine_path("code", "part-00001").exists()


def test_same_shard_twice_gives_identical_files_and_hf_never_writes_the_quarantine(
    recipe: Recipe, storage: StorageResource, run: Run
) -> None:
    source = Path(recipe.dataset("docs").source) / f"{SHARD}.jsonl"
    quarantine = storage.quarantine_path("docs", SHARD)
    runs = []
    for attempt in range(2):
        if attempt:  # same bytes, new mtime: a new source fingerprint, the same artifacts
            st = source.stat()
            os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        run(["docs", "raw_jsonl"], SHARD)
        written = stamp(quarantine)
        hf = run(["docs", "hf_dataset"], SHARD)
        assert stamp(quarantine) == written  # one writer: the raw stage
        assert (hf.metadata["documents"], hf.metadata["quarantined"]) == (10, 3)
        runs.append(files(storage, "docs", SHARD))
    assert sorted(runs[0]) == [
        f"{SHARD}.dochash.npy",
        f"{SHARD}.json",
        f"{SHARD}.quarantine.jsonl",
        f"{SHARD}.stats.json",
    ]
    assert runs[0] == runs[1]
    assert sorted(p.name for p in quarantine.parent.iterdir() if p.is_file()) == sorted(
        [quarantine.name, f"{SHARD}.stats.json", f"{SHARD}.dochash.npy"]
    )
    assert not (storage.hf_dir("docs") / "dataset_info.json").exists()  # a shard step's own
    run(["docs", "dataset_info"])
    info = json.loads((storage.hf_dir("docs") / "dataset_info.json").read_text())["tokenmill"]
    assert info == {
        "format_version": FORMAT_VERSION,
        "inputs": [
            {
                "shard": SHARD,
                "uri": str(source),
                "bytes": source.stat().st_size,
                "sha256": file_sha256(source),
                "counts": {"lines": 13, "documents": 10, "blank": 0, "quarantined": 3},
            }
        ],
        "config": {"text_key": "text", "on_bad_record": "quarantine"},
        "counts": {"shards": 1, "lines": 13, "documents": 10, "blank": 0, "quarantined": 3},
    }


def test_hf_exports_only_the_file_raw_validated(
    recipe: Recipe, storage: StorageResource, run: Run
) -> None:
    stats = storage.raw_stats_path("docs", SHARD)
    with pytest.raises(
        InputError, match=re.escape(f"{stats}: missing, ") + ".*materialize docs/raw_jsonl"
    ):
        run(["docs", "hf_dataset"], SHARD)
    run(["docs", "raw_jsonl"], SHARD)
    written = stamp(storage.quarantine_path("docs", SHARD))
    source = Path(recipe.dataset("docs").source) / f"{SHARD}.jsonl"
    source.write_bytes(source.read_bytes() + b'{"text": "appended later"}\n')
    with pytest.raises(InputError, match=r"the shard changed since; materialize docs/raw_jsonl"):
        run(["docs", "hf_dataset"], SHARD)
    assert not storage.parquet_path("docs", SHARD).exists()
    assert stamp(storage.quarantine_path("docs", SHARD)) == written


def test_dataset_info_lists_every_merged_shard_with_its_input(
    recipe: Recipe, storage: StorageResource, run: Run
) -> None:
    keys = ["part-00000", "part-00001"]
    for key in keys:
        for stage in ("raw_jsonl", "hf_dataset", "tokens"):
            run(["code", stage], key)
    run(["code", "dataset_info"])
    path = storage.hf_dir("code") / "dataset_info.json"
    info = json.loads(path.read_text())
    sources = [
        Path(recipe.dataset("code").source) / n for n in ("part-00000.jsonl", "part-00001.jsonl.gz")
    ]
    block = info["tokenmill"]
    assert [(i["shard"], i["uri"], i["sha256"]) for i in block["inputs"]] == [
        (k, str(s), file_sha256(s)) for k, s in zip(keys, sources, strict=True)
    ]
    assert [s["file"] for s in info["shards"]] == [f"data/{k}.parquet" for k in keys]
    counts = block["counts"]
    assert counts["documents"] == info["splits"]["train"]["num_examples"] == 24
    assert counts["lines"] - counts["blank"] == counts["documents"] + counts["quarantined"]
    assert info == write_dataset_info_by_reading_parquet(storage, path, block)

    # A record this tokenmill did not write stops the step, naming the file and the remedy.
    old = storage.export_record_path("code", "part-00001")
    record = json.loads(old.read_text())
    del record["format_version"]
    old.write_text(json.dumps(record))
    with pytest.raises(
        InputError,
        match=r"part-00001.json: written by another tokenmill; "
        r"materialize code/hf_dataset for shard part-00001",
    ):
        run(["code", "dataset_info"])


def write_dataset_info_by_reading_parquet(
    storage: StorageResource, path: Path, block: dict[str, object]
) -> dict[str, object]:
    """What reading every Parquet file gives (the old way): the records must say the same."""
    from tokenmill.ingest.dataset_info import write_dataset_info

    copy = path.parent / "reread"
    (copy / "data").mkdir(parents=True)
    for parquet in sorted((path.parent / "data").glob("*.parquet")):
        (copy / "data" / parquet.name).write_bytes(parquet.read_bytes())
    return json.loads(write_dataset_info(copy, extra={"tokenmill": block}).read_text())


_TRACE: list[tuple[str, str]] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _TRACE is not None and event == "open" and args:
        _TRACE.append((event, os.fsdecode(args[0]) if isinstance(args[0], str | bytes) else ""))


sys.addaudithook(_audit)  # hooks cannot be removed; it records only while _TRACE is a list


def test_shard_step_opens_only_its_own_files(
    instance: DagsterInstance, storage: StorageResource, run: Run
) -> None:
    """Each shard stage of one shard, with 3 sibling shards done: no path of a sibling is
    opened (Python's audit hook sees every open of this process); the siblings' Parquet files
    are removed first, so a read through pyarrow's own I/O, which the hook cannot see, would
    fail the step. (Writers still list their output folder's names to clear stale temps.)"""
    global _TRACE
    siblings = ["part-00000", "part-00001", "part-00002"]
    instance.add_dynamic_partitions(partitions_name("docs"), [*siblings, SHARD])
    for key in siblings:
        for stage in ("raw_jsonl", "hf_dataset", "tokens"):
            run(["docs", stage], key)
    for key in siblings:
        storage.parquet_path("docs", key).unlink()
    root = str(Path(storage.root).resolve())
    for stage in ("raw_jsonl", "hf_dataset", "tokens"):
        _TRACE = []
        try:
            run(["docs", stage], SHARD)
        finally:
            trace, _TRACE = _TRACE, None
        ours = [p for _, p in trace if p.startswith((root, storage.root))]
        assert any(SHARD in p for p in ours), stage
        assert not [p for p in ours if any(k in p for k in siblings)], stage
