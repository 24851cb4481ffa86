"""Batching and bounding shard work: every shard asset carries a pool and the multi-run backfill
policy; a backfill of K shards on the production instance (Postgres, infra/dagster.yaml) makes
ceil(K/N) queued runs over consecutive ranges; a range run writes what single-shard runs write
and checks every shard; the pool limits of every deployment pass Dagster's validation."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from dagster import AssetCheckResult, AssetKey, BackfillPolicy, DagsterInstance
from dagster._core.instance.config import dagster_instance_config
from dagster._core.test_utils import create_test_daemon_workspace_context
from dagster._core.workspace.load_target import ModuleTarget
from dagster._daemon.backfill import execute_backfill_iteration
from dagster._daemon.daemon import get_default_daemon_logger
from pipeline_project import add_shard_backfill, materialize_shards
from prod_servers import S3, Postgres

import assets.shards
from assets.factory import build_assets
from assets.shards import PARTITIONS_PER_BACKFILL_RUN, POOLS, each_shard
from assets.support.partitions import partitions_name
from assets.support.sources import list_shards
from assets.support.staleness import FAILED
from pipelines.build import build_definitions, resources_for
from pipelines.jobs import SHARD_STAGES
from tokenmill.formats.merge import natural_key
from tokenmill.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def test_shard_assets_carry_pools_and_the_backfill_policy(
    make_recipe: Callable[..., Recipe],
) -> None:
    defs = build_definitions(make_recipe())
    policy = BackfillPolicy.multi_run(max_partitions_per_run=PARTITIONS_PER_BACKFILL_RUN)
    seen = {}
    for assets_def in defs.assets:  # type: ignore[union-attr]
        stage = assets_def.key.path[-1]
        if assets_def.partitions_def is None:  # one writer at a time: a single-slot pool
            assert assets_def.backfill_policy is None
            assert assets_def.op.pool not in (None, *POOLS.values())
            continue
        assert assets_def.backfill_policy == policy
        seen[assets_def.key.to_user_string()] = assets_def.op.pool
        assert assets_def.op.pool == POOLS[stage]
    assert sorted(seen) == sorted(f"{ds}/{s}" for ds in ("docs", "code") for s in SHARD_STAGES)
    assert set(seen.values()) == {"tokenmill_ingest", "tokenmill_tokenize"}


def helm_instance_config() -> dict[str, Any]:
    """The ``concurrency`` section the Helm chart renders from infra/helm/values.yaml (its
    ``_concurrency.tpl`` maps these camelCase keys one to one)."""
    values = yaml.safe_load((INFRA / "helm" / "values.yaml").read_text())["concurrency"]
    pools, runs = values["pools"], values["runs"]
    return {
        "pools": {"default_limit": pools["defaultLimit"], "granularity": pools["granularity"]},
        "runs": {
            "max_concurrent_runs": runs["maxConcurrentRuns"],
            "tag_concurrency_limits": runs["tagConcurrencyLimits"],
        },
    }


def test_pool_limits_of_every_deployment_validate(tmp_path: Path) -> None:
    """Each deployment bounds the pools: one host with op granularity; the cluster configs
    (ECS, Helm) alike, with run granularity; Dagster accepts each ``concurrency`` section beside
    a QueuedRunCoordinator (it refuses pools beside run limits in the coordinator's config)."""
    host = yaml.safe_load((INFRA / "dagster.yaml").read_text())["concurrency"]
    ecs = yaml.safe_load((INFRA / "ecs" / "dagster.yaml").read_text())["concurrency"]
    helm = helm_instance_config()
    assert host["pools"] == {"default_limit": 8}
    assert ecs == helm and helm["pools"] == {"default_limit": 32, "granularity": "run"}
    assert helm["runs"]["max_concurrent_runs"] > helm["pools"]["default_limit"]
    for name, concurrency in {"host": host, "ecs": ecs, "helm": helm}.items():
        home = tmp_path / name
        home.mkdir()
        config = {
            "run_coordinator": {
                "module": "dagster._core.run_coordinator",
                "class": "QueuedRunCoordinator",
            },
            "concurrency": concurrency,
        }
        (home / "dagster.yaml").write_text(yaml.safe_dump(config))
        loaded, _ = dagster_instance_config(str(home))
        assert loaded["concurrency"] == concurrency


def token_files(folder: Path) -> dict[str, Any]:
    """``.bin``/``.idx`` bytes and each manifest's content hash and counts (a manifest also
    records its input Parquet's mtime, which a rewrite changes)."""
    found: dict[str, Any] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()  # manifests sit in manifests/
        if path.name.endswith(".manifest.json"):
            manifest = json.loads(path.read_text())
            found[name] = [manifest["content_hash"], manifest["counts"]]
        else:
            found[name] = path.read_bytes()
    return found


def test_range_run_matches_single_shard_runs_and_checks_every_shard(
    make_recipe: Callable[..., Recipe], tmp_path: Path
) -> None:
    recipe = make_recipe()
    graph = build_assets(recipe)
    resources = resources_for(recipe)
    keys = sorted(p.name.split(".")[0] for p in Path(recipe.dataset("docs").source).iterdir())
    keys.sort(key=natural_key)
    selection = [AssetKey(["docs", stage]) for stage in SHARD_STAGES]
    tokens = Path(recipe.storage.root) / "tokens" / "docs"
    with DagsterInstance.ephemeral() as instance:
        [result] = materialize_shards(graph, instance, resources, "docs", keys, ranged=True)
        assert result.success
        events = result.get_asset_materialization_events()
        by_asset: dict[str, list[str]] = {}
        for event in events:
            by_asset.setdefault(event.asset_key.to_user_string(), []).append(event.partition)
        assert {k: sorted(v) for k, v in by_asset.items()} == {
            f"docs/{stage}": sorted(keys) for stage in SHARD_STAGES
        }
        raws = {
            e.partition: e.materialization.metadata for e in events if e.asset_key == selection[0]
        }
        # each shard's materialization carries its own counts, path and histogram, and no
        # range totals (those go to the run's log)
        assert {k: m["documents"].value for k, m in raws.items()} == dict.fromkeys(keys, 10)
        assert {k: m["quarantined"].value for k, m in raws.items() if m["quarantined"].value} == {
            "extra-00000": 3
        }
        assert all(m["path"].value.endswith(f"{k}.stats.json") for k, m in raws.items())
        assert all("shards_in_run" not in m and "length_histogram" in m for m in raws.values())
        toks = {
            e.partition: e.materialization.metadata for e in events if e.asset_key == selection[2]
        }
        for key, meta in toks.items():
            assert meta["path"].value.endswith(f"{key}_text_document")
            assert meta["dtype"].value == "uint16" and "tokenizer_fingerprint" in meta
        assert len({m["content_hash"].value for m in toks.values()}) == len(keys)
        # each check: one evaluation of the range, and one recorded on each shard's partition
        evaluations = result.get_asset_check_evaluations()
        ranges = [e for e in evaluations if e.partition is None]
        per_shard = [e for e in evaluations if e.partition is not None]
        assert len(ranges) == 5 and all(e.passed for e in evaluations)
        assert all(e.metadata["shards_in_run"].value == len(keys) for e in ranges)
        assert sorted(e.partition for e in per_shard) == sorted(keys * 5)
        ranged = token_files(tokens)

        shutil.rmtree(tokens)
        again = [keys[0], keys[2]]  # the shard with bad lines and a clean one
        runs = materialize_shards(graph, instance, resources, "docs", again)
        assert [run.success for run in runs] == [True] * len(again)
    singles = token_files(tokens)
    assert len(ranged) == 3 * len(keys) and len(singles) == 3 * len(again)
    assert singles == {name: ranged[name] for name in singles}


def test_range_check_passes_only_when_every_shard_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def check(key: str) -> AssetCheckResult:
        bad = key.endswith("1")
        return AssetCheckResult(passed=not bad, metadata={"problems": "a\nb" if bad else "none"})

    logged: list[tuple[str, bool]] = []  # each shard's own result, recorded on its partition
    monkeypatch.setattr(
        assets.shards, "log_partition_check", lambda _, key, r: logged.append((key, r.passed))
    )

    one = each_shard(SimpleNamespace(partition_keys=["s1"]), check)  # type: ignore[arg-type]
    assert not one.passed and one.metadata["problems"].value == "a\nb"
    ranged = each_shard(SimpleNamespace(partition_keys=["s0", "s1", "s2"]), check)  # type: ignore[arg-type]
    assert not ranged.passed and ranged.metadata["problems"].value == "s1: a\ns1: b"
    assert ranged.metadata["shards_in_run"].value == 3
    fine = each_shard(SimpleNamespace(partition_keys=["s0", "s2"]), check)  # type: ignore[arg-type]
    assert fine.passed and fine.metadata["problems"].value == "none"
    assert logged == [("s0", True), ("s1", False), ("s2", True), ("s0", True), ("s2", True)]


def test_failing_shard_fails_alone_in_its_range(
    make_recipe: Callable[..., Recipe],
) -> None:
    """``on_bad_record: fail``: the bad shard fails the range step, its neighbour is recorded
    with its own metadata and data version, the bad one is recorded as failed at the source
    fingerprint it read, and the failure names it in structured metadata."""
    recipe = make_recipe(datasets={"docs": {"source": "sources/docs", "on_bad_record": "fail"}})
    graph = build_assets(recipe)
    keys = ["extra-00000", "part-00000"]
    with DagsterInstance.ephemeral() as instance:
        [result] = materialize_shards(
            graph, instance, resources_for(recipe), "docs", keys, ranged=True, raise_on_error=False
        )
        assert not result.success
        raw = AssetKey(["docs", "raw_jsonl"])
        [good] = instance.fetch_materializations(raw, limit=5).records
        assert good.partition_key == "part-00000"
        assert good.asset_materialization.metadata["documents"].value == 10
        assert good.asset_materialization.metadata["path"].value.endswith("part-00000.stats.json")
        failure = next(e for e in result.all_events if e.is_step_failure)
        data = failure.event_specific_data
        assert "extra-00000.jsonl:2" in data.error.to_string()
        meta = data.user_failure_data.metadata
        assert meta["failed_shards"].value == ["extra-00000"]
        assert meta["shard"].value == "extra-00000"
        assert meta["recorded_shards"].value == ["part-00000"]
        assert "extra-00000.jsonl:2" in meta["errors"].value["extra-00000"]
        [observed] = instance.fetch_observations(raw, limit=5).records
        source = list_shards(recipe.dataset("docs")).shards["extra-00000"]
        assert observed.partition_key == "extra-00000"
        assert observed.asset_observation.metadata[FAILED].value == source.fingerprint


@pytest.fixture
def prod_instance(
    pg_database: Postgres, s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> DagsterInstance:
    """infra/dagster.yaml on this test's Postgres database (step logs to the moto bucket)."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(INFRA / "dagster.yaml", home / "dagster.yaml")
    for name, value in {**pg_database.env(), "TOKENMILL_LOG_BUCKET": s3.bucket}.items():
        monkeypatch.setenv(name, value)
    with DagsterInstance.from_config(str(home)) as instance:
        yield instance


def test_backfill_of_k_shards_queues_ceil_k_over_n_runs(
    make_recipe: Callable[..., Recipe],
    prod_instance: DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backfill daemon's own iteration on the deployed code location (``pipelines.definitions``
    served by a code server process): K shards of docs → ceil(K/N) runs, queued behind the run
    coordinator, over consecutive ranges that cover every shard once."""
    recipe = make_recipe()
    monkeypatch.setenv("TOKENMILL_RECIPE", str(recipe.path))
    count = 37
    keys = [f"shard-{i:05d}" for i in range(count)]
    instance = prod_instance
    instance.add_dynamic_partitions(partitions_name("docs"), keys)
    target = ModuleTarget(
        module_name="pipelines.definitions",
        attribute=None,
        working_directory=str(ROOT),
        location_name="tokenmill",
    )
    with create_test_daemon_workspace_context(target, instance) as context:
        backfill_id = add_shard_backfill(
            instance, context.create_request_context().asset_graph, keys
        )
        logger = get_default_daemon_logger("BackfillDaemon")
        for _ in range(3):  # the first iteration requests every range; later ones add nothing
            list(execute_backfill_iteration(context, logger))
    runs = sorted(instance.get_runs(), key=lambda r: keys.index(r.tags[RANGE_START]))
    assert len(runs) == math.ceil(count / PARTITIONS_PER_BACKFILL_RUN) == 3
    covered = []
    for run in runs:
        assert run.status.value == "QUEUED" and run.tags["dagster/backfill"] == backfill_id
        start, end = keys.index(run.tags[RANGE_START]), keys.index(run.tags[RANGE_END])
        covered += keys[start : end + 1]
        assert end - start + 1 <= PARTITIONS_PER_BACKFILL_RUN
        assert run.asset_selection == {AssetKey(["docs", s]) for s in SHARD_STAGES}
        assert {c.name for c in run.asset_check_selection or ()} == {
            "documents_accounted",
            "not_empty",
            "rows_match_raw",
            "idx_bin_consistent",
            "documents_match_export",
        }
        assert run.run_op_concurrency is not None
        assert set(run.run_op_concurrency.all_pools or ()) == set(POOLS.values())
    assert covered == keys
    assert [r.tags[RANGE_START] for r in runs] == [keys[0], keys[16], keys[32]]
