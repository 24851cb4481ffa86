"""``tokenmill materialize`` in process: whole graph, then only what changed, once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dagster import (
    AssetKey,
    AssetMaterialization,
    DagsterInstance,
    build_sensor_context,
)
from pipeline_project import materialize_downstream, materialize_shards, runs_by_job

import assets.merged as merged_module
import assets.support.complete as complete_module
from assets.factory import build_assets
from assets.support.complete import LEFT_OUT
from assets.support.partitions import partitions_name, shard_keys
from assets.support.sources import list_shards
from assets.support.staleness import (
    CONTENT_HASH,
    current_shards,
    expected_versions,
    latest_records,
    recorded_version,
    tokens_settings,
)
from pipelines import materialize as materialize_module
from pipelines.build import build_definitions, resources_for
from pipelines.instance import DEFAULT_HOME, REPO_ROOT
from pipelines.materialize import (
    materialize_recipe,
    process_shards,
    run_downstream,
    stale_downstream,
)
from pipelines.sensors import RANGE_END, RANGE_START
from pipelines.summary import dev_hint, open_hint
from tokenmill.commands.materialize import find_code_location
from tokenmill.errors import ConfigError
from tokenmill.loader import open_blend
from tokenmill.recipe import Recipe


def test_whole_graph_then_incremental(
    recipe: Recipe, instance: DagsterInstance, capsys: pytest.CaptureFixture[str]
) -> None:
    assert materialize_recipe(recipe, instance) == 0
    out = capsys.readouterr().out
    assert "docs: 4 shards (4 processed, 0 up to date, 0 failed, 0 removed)" in out
    assert "40 documents" in out and "3 quarantined lines" in out
    assert "blend mix: train 120 ·" in out and 'open_blend("' in out
    # one run per range of up to 16 new shards, as the sensors do
    assert runs_by_job(instance) == {"docs_shard_job": 1, "code_shard_job": 1, "refresh_job": 1}
    assert "docs/extra-00000..part-00002 (4 shards): ok" in out
    storage = Path(recipe.storage.root)
    blend = open_blend(storage / "blends" / "mix" / "manifest.json", split="train")
    assert len(blend) == 120 and blend.get_batch(np.arange(8)).shape == (8, 33)

    assert materialize_recipe(recipe, instance) == 0  # nothing changed: no runs at all
    assert "downstream rebuilt: nothing" in capsys.readouterr().out
    assert sum(runs_by_job(instance).values()) == 3

    shutil.rmtree(storage / "blends")  # outputs removed, the instance's records kept
    assert materialize_recipe(recipe, instance) == 0
    assert "downstream rebuilt: blend/mix" in capsys.readouterr().out
    assert (storage / "blends" / "mix" / "manifest.json").is_file()
    assert sum(runs_by_job(instance).values()) == 4

    docs = Path(recipe.dataset("docs").source)
    shutil.copy(docs / "part-00000.jsonl", docs / "part-00003.jsonl")
    assert materialize_recipe(recipe, instance) == 0
    out = capsys.readouterr().out
    assert "docs: 5 shards (1 processed, 4 up to date" in out
    assert (
        "downstream rebuilt: docs/dataset_info, docs/merged, docs/pruned, docs/nanoset, blend/mix"
        in out
    )
    assert runs_by_job(instance) == {"docs_shard_job": 2, "code_shard_job": 1, "refresh_job": 3}

    (docs / "part-00003.jsonl").unlink()
    assert materialize_recipe(recipe, instance) == 0
    out = capsys.readouterr().out
    assert "removed (gone from the source): ['part-00003']" in out
    event = instance.get_latest_materialization_event(AssetKey(["docs", "pruned"]))
    assert event is not None and event.asset_materialization is not None
    assert event.asset_materialization.metadata["shards_removed"].value == ["part-00003"]
    event = instance.get_latest_materialization_event(AssetKey(["docs", "merged"]))
    assert event is not None and event.asset_materialization is not None
    assert event.asset_materialization.metadata["reused_version"].value is True  # 4 shards again

    # The shard sensors see the same state: every shard is current, nothing to run.
    defs = build_definitions(recipe)
    sensor = defs.resolve_sensor_def("docs_shard_sensor")
    with build_sensor_context(instance=instance, definitions=defs) as context:
        assert sensor(context).run_requests == []


def test_materialize_ranges_have_their_own_size(
    make_recipe: object,
    instance: DagsterInstance,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In-process runs hold up to ``MATERIALIZE_SHARDS_PER_RUN`` shards (the sensors' runs,
    which execute side by side, keep 16): 4 new shards in ranges of 3 make two runs."""
    monkeypatch.setattr(materialize_module, "MATERIALIZE_SHARDS_PER_RUN", 3)
    recipe = make_recipe(blends={})  # type: ignore[operator]
    outcome = process_shards(build_definitions(recipe), instance, recipe.dataset("docs"))
    assert runs_by_job(instance) == {"docs_shard_job": 2}
    assert "docs/extra-00000..part-00001 (3 shards): ok" in capsys.readouterr().out
    assert outcome.processed == outcome.shards and len(outcome.shards) == 4


def test_bad_record_in_fail_mode_fails_only_that_dataset(
    make_recipe: object,
    instance: DagsterInstance,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    recipe = make_recipe(  # type: ignore[operator]
        datasets={"docs": {"source": "sources/docs", "on_bad_record": "fail"}},
        blends={},
    )
    assert materialize_recipe(recipe, instance, home=tmp_path) == 1
    out = capsys.readouterr().out
    # the bad shard fails alone in its range: it is named (from the failure's metadata), with
    # its cause in one line; the good shards are recorded and the next run finishes them
    line = "docs/extra-00000..part-00002 (4 shards): FAILED at extra-00000; the other 3 shards"
    assert line in out
    source = Path(recipe.dataset("docs").source) / "extra-00000.jsonl"
    cause = f"FAILED extra-00000: docs/raw_jsonl: BadRecordError: {source}:2: invalid JSON"
    assert cause in out and "Traceback" not in out and "redoes" not in out
    assert "docs/dataset_info, docs/merged, docs/pruned, docs/nanoset: NOT rebuilt" in out
    [log] = (tmp_path / "logs").glob("*.log")
    assert f"Full errors with tracebacks: {log} (or run with -v)" in out
    assert "raise BadRecordError(" in log.read_text()  # the stack, kept out of the summary
    assert "failed: ['extra-00000']" in out
    assert "downstream rebuilt: code/dataset_info, code/merged, code/pruned, code/nanoset" in out


def _two_shards_each(recipe: Recipe, instance: DagsterInstance) -> tuple[Any, dict[str, Any]]:
    """``(graph, resources)`` after materializing two shards of each dataset through
    ``dagster.materialize``, every run and check green."""
    graph = build_assets(recipe)
    resources = resources_for(recipe)
    keys = {"docs": ["extra-00000", "part-00000"], "code": ["part-00000", "part-00001"]}
    (Path(recipe.dataset("docs").source) / "part-00001.jsonl").unlink()
    (Path(recipe.dataset("docs").source) / "part-00002.jsonl").unlink()
    for ds, shards in keys.items():
        results = materialize_shards(graph, instance, resources, ds, shards)
        assert [r.success for r in results] == [True] * len(shards)
        assert all(e.passed for r in results for e in r.get_asset_check_evaluations())
    return graph, resources


def test_dagster_materialize_end_to_end(recipe: Recipe, instance: DagsterInstance) -> None:
    """The same graph through ``dagster.materialize``: each shard partition, then downstream."""
    graph, resources = _two_shards_each(recipe, instance)
    result = materialize_downstream(graph, instance, resources)
    assert result.success
    evaluations = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert evaluations == {
        "sum_of_shards": True,
        "quarantine_share": True,
        "shards_left_out": True,
        "index_bounds": True,
        "proportions": True,
    }
    manifest = json.loads((Path(recipe.storage.root) / "blends/mix/manifest.json").read_text())
    assert [d["name"] for d in manifest["datasets"]] == ["docs", "code"]


def test_a_held_shard_stays_while_a_later_run_of_it_is_unconfirmed(
    recipe: Recipe, instance: DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later tokens record of a shard whose run is not known to have succeeded (a second run
    of it still in progress) does not drop the shard from the next merged version while its
    content is what the current version holds: the pointer never moves back. The merge reads
    that shard's token manifest once (the held check and the version's inputs share it)."""
    reads: list[str] = []
    for module in (complete_module, merged_module):
        real = module.read_dataset_manifest

        def counted(prefix: Any, real: Any = real) -> dict[str, Any]:
            reads.append(Path(prefix).as_posix())
            return real(prefix)  # type: ignore[no-any-return]

        monkeypatch.setattr(module, "read_dataset_manifest", counted)
    graph, resources = _two_shards_each(recipe, instance)
    assert materialize_downstream(graph, instance, resources).success
    before = instance.get_latest_materialization_event(AssetKey(["code", "merged"]))
    held = before.asset_materialization.metadata
    [record] = latest_records(instance, AssetKey(["code", "tokens"]), ["part-00000"]).values()
    same = record.asset_materialization.metadata[CONTENT_HASH].value
    instance.report_runless_asset_event(  # the unconfirmed run's record, same content
        AssetMaterialization(
            AssetKey(["code", "tokens"]), partition="part-00000", metadata={CONTENT_HASH: same}
        )
    )
    reads.clear()
    assert materialize_downstream(graph, instance, resources).success
    assert sum(r.endswith("tokens/code/part-00000_text_document") for r in reads) == 1
    after = instance.get_latest_materialization_event(AssetKey(["code", "merged"]))
    meta = after.asset_materialization.metadata
    assert meta["shards"].value == held["shards"].value == 2
    assert meta["version"].value == held["version"].value
    assert meta[LEFT_OUT].value == {}


def test_cli_finds_the_code_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(__file__).resolve().parents[2]
    monkeypatch.delenv("TOKENMILL_CODE_LOCATION", raising=False)
    monkeypatch.chdir(root / "tests" / "pipeline")
    assert find_code_location() == root  # a parent of the current directory
    with pytest.raises(ConfigError, match=r"--code-location .*: not a tokenmill code location"):
        find_code_location(str(tmp_path))
    monkeypatch.setenv("TOKENMILL_CODE_LOCATION", str(tmp_path))
    with pytest.raises(ConfigError, match=r"\$TOKENMILL_CODE_LOCATION .*: not a tokenmill"):
        find_code_location()
    monkeypatch.setenv("TOKENMILL_CODE_LOCATION", str(root))
    monkeypatch.chdir(tmp_path)
    assert find_code_location() == root


def test_backfilled_shards_are_not_run_again(
    recipe: Recipe, instance: DagsterInstance, capsys: pytest.CaptureFixture[str]
) -> None:
    """A backfill range run (no tokenmill tags at all) leaves records ``materialize`` reads."""
    defs = build_definitions(recipe)
    for ds in recipe.datasets:
        keys = sorted(p.name.split(".")[0] for p in Path(ds.source).iterdir())
        instance.add_dynamic_partitions(partitions_name(ds.name), keys)
        backfill = defs.resolve_job_def(f"{ds.name}_shard_job").execute_in_process(
            instance=instance, tags={RANGE_START: keys[0], RANGE_END: keys[-1]}
        )
        assert backfill.success
    assert materialize_recipe(recipe, instance) == 0
    out = capsys.readouterr().out
    assert "docs: 4 shards (0 processed, 4 up to date" in out
    assert "code: 2 shards (0 processed, 2 up to date" in out
    assert runs_by_job(instance) == {"docs_shard_job": 1, "code_shard_job": 1, "refresh_job": 1}


def test_shards_made_with_other_settings_are_stale(
    recipe: Recipe, instance: DagsterInstance
) -> None:
    assert materialize_recipe(recipe, instance) == 0
    ds = recipe.dataset("code")
    fingerprints = {k: s.fingerprint for k, s in list_shards(ds).shards.items()}
    tokenizer = resources_for(recipe)["tokenizer"]
    settings = tokens_settings(tokenizer.info().fingerprint, tokenizer.append_eod, ds)  # type: ignore[attr-defined]
    assert current_shards(instance, ds, fingerprints, settings) == set(fingerprints)
    other = tokens_settings(tokenizer.info().fingerprint, not tokenizer.append_eod, ds)  # type: ignore[attr-defined]
    assert current_shards(instance, ds, fingerprints, other) == set()
    # the recorded data versions are the ones the shard records give
    keys = {d.name: shard_keys(instance, d) for d in recipe.datasets}
    for key, version in expected_versions(instance, recipe, keys).items():
        assert recorded_version(instance, key) == version, key


def test_pull_hint_names_the_s3_endpoint() -> None:
    hint = "\n".join(open_hint("s3://b/root/blends/mix/manifest.json", "mix", "http://s3:9000"))
    assert "tokenmill pull s3://b/root/blends/mix/manifest.json blend-mix --endpoint-url " in hint
    assert hint.count("http://s3:9000") == 1
    assert "--endpoint-url" not in "\n".join(open_hint("s3://b/blends/mix/manifest.json", "mix"))
    local = "\n".join(open_hint("data/blends/mix/manifest.json", "mix", "http://s3:9000"))
    assert "pull" not in local and 'open_blend("data/blends/mix/manifest.json"' in local


def test_dev_hint_names_a_custom_recipe_and_instance(tmp_path: Path) -> None:
    demo = REPO_ROOT / "recipes" / "demo.yaml"
    assert dev_hint(demo, DEFAULT_HOME).startswith(
        "Browse assets, runs, checks and metadata: make dev"
    )
    custom = dev_hint(tmp_path / "my recipe.yaml", tmp_path / "home")
    assert (
        f"TOKENMILL_RECIPE='{tmp_path}/my recipe.yaml' DAGSTER_HOME={tmp_path}/home make dev"
        in custom
    )
    assert f"DAGSTER_HOME={tmp_path}/home make dev" in dev_hint(demo, tmp_path / "home")


def test_the_uis_staleness_agrees_with_materialize(
    recipe: Recipe, instance: DagsterInstance
) -> None:
    """Dagster's own stale status (what the UI shows) over the recorded data versions agrees
    with ``materialize``: fresh after a run; after one new shard's tokens, ``merged`` is stale
    (Dagster flags the first asset whose inputs' versions changed; one whose data version the
    asset computes is stale only once its inputs' new versions are recorded), and after the
    merge alone, the indices are."""
    from dagster._core.definitions.data_version import CachingStaleStatusResolver
    from dagster._core.loader import LoadingContextForTest

    defs = build_definitions(recipe)
    downstream = [
        AssetKey(["docs", "merged"]),
        AssetKey(["docs", "nanoset"]),
        AssetKey(["blend", "mix"]),
    ]

    def statuses() -> dict[AssetKey, str]:
        resolver = CachingStaleStatusResolver(
            instance, defs.resolve_asset_graph(), LoadingContextForTest(instance)
        )
        return {key: resolver.get_status(key).value for key in downstream}

    assert materialize_recipe(recipe, instance) == 0
    assert statuses() == dict.fromkeys(downstream, "FRESH")
    assert stale_downstream(instance, recipe, set()) == []

    docs = Path(recipe.dataset("docs").source)
    shutil.copy(docs / "part-00000.jsonl", docs / "part-00003.jsonl")
    outcome = process_shards(defs, instance, recipe.dataset("docs"))  # shards only
    assert outcome.processed == ["part-00003"]
    merged, nanoset, blend = downstream
    assert statuses() == {merged: "STALE", nanoset: "FRESH", blend: "FRESH"}
    assert set(downstream) <= set(stale_downstream(instance, recipe, set()))

    assert run_downstream(defs, instance, [merged])
    assert statuses() == {merged: "FRESH", nanoset: "STALE", blend: "FRESH"}
    assert stale_downstream(instance, recipe, set()) == [nanoset, blend]

    assert materialize_recipe(recipe, instance) == 0
    assert statuses() == dict.fromkeys(downstream, "FRESH")
