"""An HF dataset already on disk (Parquet and Arrow shards, ``format: hf``) enters the pipeline
at ``<ds>/hf_dataset``: no raw stage, null texts quarantined with their row, stats in the raw
stats form, tokens identical to tokenizing the non-null texts directly, blends built on it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    SensorResult,
    build_asset_context,
    build_sensor_context,
)
from transformers import AutoTokenizer

from assets.factory import build_assets
from assets.support.partitions import partitions_name
from assets.support.resources import StorageResource
from assets.support.sources import list_shards
from pipelines.build import build_definitions, resources_for
from pipelines.materialize import materialize_recipe
from tokenmill.atomic import file_sha256
from tokenmill.cli import main
from tokenmill.errors import BadRecordError, ConfigError, InputError
from tokenmill.formats.indexed import IndexedDataset
from tokenmill.loader import open_blend
from tokenmill.provenance import explain, resolve_queries
from tokenmill.recipe import Recipe

PARQUET, ARROW = "train-00000-of-00002", "train-00001-of-00002"
NULL_ROW = 3  # 1-based row of the Parquet shard whose text is null


def texts_of(documents: dict[str, list[dict[str, str]]]) -> dict[str, list[str | None]]:
    """The texts of both shards; the Parquet one has a null text at ``NULL_ROW``."""
    first: list[str | None] = [d["text"] for d in documents["docs"][:12]]
    first.insert(NULL_ROW - 1, None)
    return {PARQUET: first, ARROW: [d["text"] for d in documents["code"][:10]] + [""]}


def write_hf_source(folder: Path, texts: dict[str, list[str | None]]) -> None:
    """An HF dataset's ``data/`` folder: a Parquet shard and an Arrow (IPC stream) shard with
    an extra int column and a struct column, plus a file that is not a shard."""
    folder.mkdir(parents=True)
    for name, column in texts.items():
        n = len(column)
        table = pa.table(
            {
                "id": pa.array(range(n), pa.int64()),
                "text": pa.array(column, pa.string()),
                "meta": [{"source": name, "row": i} for i in range(n)],
            }
        )
        if name == PARQUET:
            pq.write_table(table, folder / f"{name}.parquet")
        else:
            path = str(folder / f"{name}.arrow")
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=4)
    (folder / "README.md").write_text("not a shard\n")


@pytest.fixture
def hf_recipe(
    make_recipe: Callable[..., Recipe], documents: dict[str, list[dict[str, str]]]
) -> Recipe:
    """The tiny project plus ``wiki``, an HF dataset on disk, blended with docs."""
    base = make_recipe()  # writes the JSONL sources first
    write_hf_source(base.base_dir / "sources" / "wiki" / "data", texts_of(documents))
    return make_recipe(
        datasets={
            "wiki": {
                "source": "sources/wiki/data",
                "format": "hf",
                "max_quarantine_fraction": 0.1,  # one null text of 24 rows
            }
        },
        blends={"mix": {"weights": {"docs": 0.5, "wiki": 0.5}}},
    )


def test_recipe_format_and_shard_listing(
    hf_recipe: Recipe, make_recipe: Callable[..., Recipe]
) -> None:
    wiki = hf_recipe.dataset("wiki")
    assert (wiki.format, wiki.glob, hf_recipe.dataset("docs").format) == ("hf", "*", "jsonl")
    listing = list_shards(wiki)
    assert sorted(listing.shards) == [PARQUET, ARROW]
    assert listing.shards[ARROW].path == Path(wiki.source) / f"{ARROW}.arrow"
    with pytest.raises(ConfigError, match=r"datasets\.wiki.*format.*'csv'.*one of jsonl, hf"):
        make_recipe(datasets={"wiki": {"source": "sources/wiki/data", "format": "csv"}})


def test_graph_has_no_raw_stage_for_an_hf_dataset(
    hf_recipe: Recipe, instance: DagsterInstance
) -> None:
    assets, checks = build_assets(hf_recipe)
    keys = {key for a in assets for key in a.keys}
    assert AssetKey(["wiki", "raw_jsonl"]) not in keys
    assert AssetKey(["docs", "raw_jsonl"]) in keys
    export = next(a for a in assets if AssetKey(["wiki", "hf_dataset"]) in a.keys)
    assert not export.asset_deps[AssetKey(["wiki", "hf_dataset"])]
    checked = {spec.asset_key for c in checks for spec in c.check_specs}
    assert AssetKey(["wiki", "raw_jsonl"]) not in checked
    defs = build_definitions(hf_recipe)
    job = defs.resolve_job_def("wiki_shard_job")
    selected = {key for key in job.asset_layer.executable_asset_keys}
    assert selected == {AssetKey(["wiki", "hf_dataset"]), AssetKey(["wiki", "tokens"])}
    sensor = defs.resolve_sensor_def("wiki_shard_sensor")
    with build_sensor_context(instance=instance, definitions=defs) as context:
        result = sensor(context)
    assert isinstance(result, SensorResult)
    [request] = result.run_requests or []  # both new shards in one range run
    assert request.job_name == "wiki_shard_job"
    assert (
        request.tags["dagster/asset_partition_range_start"],
        request.tags["dagster/asset_partition_range_end"],
    ) == (PARQUET, ARROW)


def test_materialize_hf_dataset_end_to_end(
    hf_recipe: Recipe,
    instance: DagsterInstance,
    documents: dict[str, list[dict[str, str]]],
    gpt2_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert materialize_recipe(hf_recipe, instance) == 0
    out = capsys.readouterr().out
    assert "wiki: 2 shards (2 processed, 0 up to date, 0 failed, 0 removed)" in out
    storage = resources_for(hf_recipe)["storage"]
    assert isinstance(storage, StorageResource)
    source = Path(hf_recipe.dataset("wiki").source)
    texts = texts_of(documents)

    stats = json.loads(storage.raw_stats_path("wiki", PARQUET).read_text())
    shard = source / f"{PARQUET}.parquet"
    assert stats["input"] == {
        "uri": str(shard),
        "bytes": shard.stat().st_size,
        "sha256": file_sha256(shard),
    }
    assert (stats["lines"], stats["documents"], stats["quarantined"]) == (13, 12, 1)
    quarantine = storage.quarantine_path("wiki", PARQUET)
    assert stats["quarantine"]["sha256"] == file_sha256(quarantine)
    [bad] = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert (bad["line"], bad["reason"], bad["source"]) == (NULL_ROW, "text is null", str(shard))
    assert not storage.quarantine_path("wiki", ARROW).exists()  # no bad rows: no file

    tokenizer = AutoTokenizer.from_pretrained(str(gpt2_dir))
    for name, column in texts.items():
        exported = pq.read_table(storage.parquet_path("wiki", name))
        good = [t for t in column if t is not None]
        assert exported.column_names == ["id", "text", "meta"]
        assert exported.column("text").to_pylist() == good
        tokens = IndexedDataset(storage.tokens_prefix("wiki", name, "text"))
        expected = [[*tokenizer(t).input_ids, tokenizer.eos_token_id] for t in good if t]
        assert [tokens[i].tolist() for i in range(len(tokens))] == expected
    info = json.loads((storage.hf_dir("wiki") / "dataset_info.json").read_text())
    assert [i["shard"] for i in info["tokenmill"]["inputs"]] == [PARQUET, ARROW]
    assert info["tokenmill"]["counts"]["quarantined"] == 1

    mpath = storage.blend_dir("mix") / "manifest.json"
    blend = open_blend(mpath, split="train")
    assert blend.get_batch(np.arange(4)).shape == (4, 33)

    # explain names each wiki piece's file and row (the null row skipped), find goes back
    rows = blend.get_batch(np.arange(len(blend)))
    wiki = 0
    for prov in explain(mpath, "train", range(len(blend))):
        for p in prov.pieces:
            if p.dataset != "wiki":
                continue
            wiki += 1
            name = Path(str(p.source)).name.split(".")[0]
            assert p.source == str(source / Path(str(p.source)).name) and p.line is not None
            text = texts[name][p.line - 1]
            assert text is not None and p.doc_id == str(p.line - 1)  # the id column: the row
            whole = [*tokenizer(text).input_ids, tokenizer.eos_token_id]
            (a, b), (c, d) = p.sample_range, p.document_range
            assert rows[prov.sample][a:b].tolist() == whole[c:d]
    assert wiki > 5
    after_null = f"line:{shard}:{NULL_ROW + 1}"
    [ref] = resolve_queries(storage.local_root(), [after_null, f"line:{shard}:{NULL_ROW}"])
    assert (ref.shard, ref.document, ref.line, ref.doc_id) == (PARQUET, NULL_ROW - 1, 4, "3")
    capsys.readouterr()
    assert main(["explain", str(mpath), "--sample", *map(str, range(len(blend)))]) == 0
    assert f"{shard} row " in capsys.readouterr().out
    assert materialize_recipe(hf_recipe, instance) == 0  # nothing changed: nothing runs
    assert "wiki: 2 shards (0 processed, 2 up to date" in capsys.readouterr().out


def test_fail_mode_names_the_source_and_row(
    make_recipe: Callable[..., Recipe],
    documents: dict[str, list[dict[str, str]]],
    instance: DagsterInstance,
) -> None:
    base = make_recipe()
    write_hf_source(base.base_dir / "sources" / "wiki" / "data", texts_of(documents))
    recipe = make_recipe(
        datasets={"wiki": {"source": "sources/wiki/data", "format": "hf", "on_bad_record": "fail"}}
    )
    resources: dict[str, Any] = resources_for(recipe)
    instance.add_dynamic_partitions(partitions_name("wiki"), [PARQUET])
    export = next(a for a in build_assets(recipe)[0] if a.key == AssetKey(["wiki", "hf_dataset"]))
    shard = Path(recipe.dataset("wiki").source) / f"{PARQUET}.parquet"
    context = build_asset_context(resources=resources, instance=instance, partition_key=PARQUET)
    with context as ctx, pytest.raises(BadRecordError, match=rf"{shard}:{NULL_ROW}: text is null"):
        export(ctx)
    storage = resources["storage"]
    assert not storage.parquet_path("wiki", PARQUET).exists()
    assert not storage.raw_stats_path("wiki", PARQUET).exists()


def test_a_failed_reexport_leaves_no_stats_vouching(
    hf_recipe: Recipe, instance: DagsterInstance
) -> None:
    """The old stats go before the new export: a shard that became unreadable fails with its
    path, and no stats file is left describing the previous content."""
    resources: dict[str, Any] = resources_for(hf_recipe)
    storage = resources["storage"]
    instance.add_dynamic_partitions(partitions_name("wiki"), [ARROW])
    assets = build_assets(hf_recipe)[0]
    export = next(a for a in assets if a.key == AssetKey(["wiki", "hf_dataset"]))
    with build_asset_context(resources=resources, instance=instance, partition_key=ARROW) as ctx:
        export(ctx)
    assert json.loads(storage.raw_stats_path("wiki", ARROW).read_text())["documents"] == 11
    shard = Path(hf_recipe.dataset("wiki").source) / f"{ARROW}.arrow"
    shard.write_bytes(b"ARROW1 but nothing else")
    context = build_asset_context(resources=resources, instance=instance, partition_key=ARROW)
    with context as ctx, pytest.raises(InputError, match=rf"{shard}: cannot read table"):
        export(ctx)
    assert not storage.raw_stats_path("wiki", ARROW).exists()


def test_an_empty_hf_shard_is_a_warning(hf_recipe: Recipe, instance: DagsterInstance) -> None:
    """Like a JSONL shard, a Parquet shard with no rows passes with a WARN ``not_empty`` on its
    ``hf_dataset`` partition (an ``hf`` dataset has no raw stage to carry it)."""
    source = Path(hf_recipe.dataset("wiki").source)
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    pq.write_table(schema.empty_table(), source / "empty-00000.parquet")
    instance.add_dynamic_partitions(partitions_name("wiki"), ["empty-00000", PARQUET])
    job = build_definitions(hf_recipe).resolve_job_def("wiki_shard_job")
    result = job.execute_in_process(instance=instance, partition_key="empty-00000")
    assert result.success  # a warning, not a failure
    [check] = [e for e in result.get_asset_check_evaluations() if e.check_name == "not_empty"]
    assert check.asset_key == AssetKey(["wiki", "hf_dataset"]) and not check.passed
    assert check.severity.value == "WARN" and check.metadata["documents"].value == 0
    assert str(check.metadata["problems"].value) == "empty shard: 0 documents in 0 lines " + (
        "(0 blank, 0 quarantined)"
    )
    good = job.execute_in_process(instance=instance, partition_key=PARQUET)
    passed = [e.passed for e in good.get_asset_check_evaluations() if e.check_name == "not_empty"]
    assert passed == [True]
