"""The code location: definitions load and validate, asset keys are stable, and the library
never imports Dagster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from dagster import AssetKey

from assets.factory import build_assets
from pipelines.build import build_definitions
from tokenmill.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
# Training configs and dashboards name these: a rename must be deliberate (update this list).
DEMO_ASSET_KEYS = [
    "blend/demo",
    "code/dataset_info",
    "code/hf_dataset",
    "code/merged",
    "code/nanoset",
    "code/pruned",
    "code/raw_jsonl",
    "code/tokens",
    "docs/dataset_info",
    "docs/hf_dataset",
    "docs/merged",
    "docs/nanoset",
    "docs/pruned",
    "docs/raw_jsonl",
    "docs/tokens",
]
DEMO_CHECKS = [
    "blend/demo:proportions",
    "code/hf_dataset:rows_match_raw",
    "code/merged:quarantine_share",
    "code/merged:shards_left_out",
    "code/merged:sum_of_shards",
    "code/nanoset:index_bounds",
    "code/raw_jsonl:documents_accounted",
    "code/raw_jsonl:not_empty",
    "code/tokens:documents_match_export",
    "code/tokens:idx_bin_consistent",
    "docs/hf_dataset:rows_match_raw",
    "docs/merged:quarantine_share",
    "docs/merged:shards_left_out",
    "docs/merged:sum_of_shards",
    "docs/nanoset:index_bounds",
    "docs/raw_jsonl:documents_accounted",
    "docs/raw_jsonl:not_empty",
    "docs/tokens:documents_match_export",
    "docs/tokens:idx_bin_consistent",
]


def test_demo_definitions_snapshot() -> None:
    defs = build_definitions(load_recipe(ROOT / "recipes" / "demo.yaml"))
    keys = sorted(k.to_user_string() for k in defs.resolve_all_asset_keys())
    assert keys == DEMO_ASSET_KEYS
    graph = defs.resolve_asset_graph()
    checks = sorted(f"{k.asset_key.to_user_string()}:{k.name}" for k in graph.asset_check_keys)
    assert checks == DEMO_CHECKS
    blocking = {
        f"{k.asset_key.to_user_string()}:{k.name}"
        for k in graph.asset_check_keys
        if graph.get_check_spec(k).blocking
    }
    warnings = {c for c in DEMO_CHECKS if c.endswith((":not_empty", ":shards_left_out"))}
    assert blocking == set(DEMO_CHECKS) - {"blend/demo:proportions"} - warnings
    jobs = {j.name for j in defs.resolve_all_job_defs()} - {"__ASSET_JOB"}
    assert jobs == {
        "docs_shard_job",
        "docs_merge_job",
        "code_shard_job",
        "code_merge_job",
        "refresh_job",
    }
    assert {s.name for s in defs.sensors or []} == {
        "docs_shard_sensor",
        "code_shard_sensor",
        "tokenmill_automation",
        "recipe_sensor",
    }
    assert {s.name for s in defs.schedules or []} == {
        "docs_reprocess",
        "code_reprocess",
        "nightly_refresh",
    }
    merged = defs.resolve_assets_def(AssetKey(["docs", "merged"]))
    label = str(merged.automation_conditions_by_key[merged.key].get_label())
    assert "at most once per 5 min" in label and "shard partitions not waited for" in label
    tokens = defs.resolve_assets_def(AssetKey(["docs", "tokens"]))
    assert tokens.partitions_def is not None and tokens.partitions_def.name == "docs_shards"


def test_example_recipe_builds() -> None:
    defs = build_definitions(load_recipe(ROOT / "recipes" / "example-temperature.yaml"))
    keys = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    assert {
        "web/tokens",
        "books/merged",
        "code/nanoset",
        "blend/balanced",
        "blend/mostly_web",
    } <= keys
    assert {s.name for s in defs.schedules or []} == {"nightly_refresh"}


def test_dagster_definitions_validate() -> None:
    env = {**os.environ, "TOKENMILL_RECIPE": str(ROOT / "recipes" / "demo.yaml")}
    dagster = Path(sys.executable).with_name("dagster")
    result = subprocess.run(
        [str(dagster), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "All code locations passed validation" in result.stderr + result.stdout


def test_library_never_imports_dagster() -> None:
    pattern = re.compile(r"^\s*(import dagster|from dagster)", re.MULTILINE)
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "tokenmill").rglob("*.py"))
        if pattern.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []
    code = (
        "import importlib, pkgutil, sys, tokenmill\n"
        "for m in pkgutil.walk_packages(tokenmill.__path__, 'tokenmill.'):\n"
        "    if m.name != 'tokenmill.loader.torch':\n"
        "        importlib.import_module(m.name)\n"
        "from tokenmill.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] == 'dagster'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_asset_kinds_name_the_file_formats() -> None:
    """``.bin``/``.idx`` pairs are Megatron data, ``.npy`` indices NumPy (not the reverse)."""
    assets, _ = build_assets(load_recipe(ROOT / "recipes" / "demo.yaml"))
    kinds = {spec.key.to_user_string(): spec.kinds for a in assets for spec in a.specs}
    assert kinds["docs/tokens"] == kinds["docs/merged"] == {"megatron"}
    assert kinds["docs/nanoset"] == {"numpy"} and kinds["blend/demo"] == {"numpy", "json"}
    assert kinds["docs/raw_jsonl"] == {"jsonl"} and kinds["docs/hf_dataset"] == {"parquet"}
