"""End to end on real servers: the demo recipe's shape (tiny corpus) with its sources and storage
root on S3 (moto_server) and a Postgres-backed instance (infra/dagster.yaml), materialized by
``tokenmill materialize`` as users run it, pulled with ``tokenmill pull``, read by the loader;
and ``materialize`` on an S3 root doing only what changed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from dagster import DagsterInstance
from pipeline_project import SPLITS, blend_batches, runs_by_job, s3_project
from prod_servers import S3, Postgres

from pipelines.materialize import materialize_recipe
from tokenmill.recipe import Recipe

INFRA = Path(__file__).resolve().parents[2] / "infra"
TOKENMILL = str(Path(sys.executable).with_name("tokenmill"))  # the console script users run


def cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``tokenmill ARGS`` to completion; its output (stderr shown when it fails)."""
    done = subprocess.run(
        [TOKENMILL, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"tokenmill {args[0]} exited {done.returncode}:\n{done.stderr}"
    return done


@pytest.fixture
def prod_home(
    pg_database: Postgres, s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A DAGSTER_HOME holding infra/dagster.yaml as is, its variables pointing at this test's
    Postgres database and the moto bucket (step logs under ``dagster/compute-logs``)."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(INFRA / "dagster.yaml", home / "dagster.yaml")
    for name, value in {**pg_database.env(), "TOKENMILL_LOG_BUCKET": s3.bucket}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


def test_demo_shape_on_s3_and_postgres_through_the_cli(
    make_recipe: Callable[..., Recipe], s3: S3, prod_home: Path, tmp_path: Path
) -> None:
    local = make_recipe()
    with DagsterInstance.ephemeral() as instance:
        assert materialize_recipe(local, instance) == 0
    expected = blend_batches(Path(local.storage.root) / "blends" / "mix" / "manifest.json")

    recipe = s3_project(make_recipe, s3)
    env = dict(os.environ)
    done = cli("materialize", "--recipe", str(recipe.path), env=env, cwd=tmp_path)
    uri = f"s3://{s3.bucket}/root/blends/mix/manifest.json"
    assert "docs: 4 shards (4 processed, 0 up to date, 0 failed, 0 removed)" in done.stdout
    assert "40 documents" in done.stdout and "3 quarantined lines" in done.stdout
    assert (
        "downstream rebuilt: docs/dataset_info, docs/merged, docs/pruned, docs/nanoset, "
        "code/dataset_info, code/merged" in done.stdout
    )
    assert "blend mix: train 120 · valid" in done.stdout and f"-> {uri}" in done.stdout
    assert f"tokenmill pull {uri} blend-mix" in done.stdout

    with DagsterInstance.from_config(str(prod_home)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert runs_by_job(instance) == {  # one run per range of new shards
            "docs_shard_job": 1,
            "code_shard_job": 1,
            "refresh_job": 1,
        }
    keys = s3.keys("root/")
    assert "root/blends/mix/manifest.json" in keys
    assert not [k for k in keys if ".tmp-" in k or k.endswith(".lock")]
    assert s3.keys("dagster/compute-logs/")  # step logs went to the log bucket

    pulled = tmp_path / "pulled"
    done = cli("pull", uri, str(pulled), env=env, cwd=tmp_path)
    manifest = pulled / "blends" / "mix" / "manifest.json"
    assert manifest.is_file() and "open with: tokenmill.loader.open_blend" in done.stdout
    got = blend_batches(manifest)
    for split in SPLITS:
        assert got[split].shape == expected[split].shape and len(got[split]) > 0
        assert np.array_equal(got[split], expected[split]), split


def materialize_out(
    recipe: Recipe, instance: DagsterInstance, capsys: pytest.CaptureFixture[str]
) -> str:
    assert materialize_recipe(recipe, instance) == 0
    return capsys.readouterr().out


def test_materialize_on_an_s3_root_runs_only_what_changed(
    make_recipe: Callable[..., Recipe], s3: S3, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = s3_project(make_recipe, s3)
    put = s3.client.put_object
    with DagsterInstance.ephemeral() as instance:
        out = materialize_out(recipe, instance, capsys)
        assert "code: 2 shards (2 processed, 0 up to date" in out
        assert runs_by_job(instance) == {"docs_shard_job": 1, "code_shard_job": 1, "refresh_job": 1}

        out = materialize_out(recipe, instance, capsys)  # nothing changed: no runs at all
        assert "docs: 4 shards (0 processed, 4 up to date" in out
        assert "downstream rebuilt: nothing" in out and sum(runs_by_job(instance).values()) == 3

        body = s3.client.get_object(Bucket=s3.bucket, Key="sources/docs/part-00000.jsonl")["Body"]
        put(Bucket=s3.bucket, Key="sources/docs/part-00003.jsonl", Body=body.read())
        out = materialize_out(recipe, instance, capsys)
        assert "docs: 5 shards (1 processed, 4 up to date" in out
        assert "code: 2 shards (0 processed, 2 up to date" in out
        assert (
            "downstream rebuilt: docs/dataset_info, docs/merged, docs/pruned, docs/nanoset, "
            "blend/mix" in out
        )

        s3.client.delete_object(Bucket=s3.bucket, Key="sources/docs/part-00003.jsonl")
        out = materialize_out(recipe, instance, capsys)
        assert "removed (gone from the source): ['part-00003']" in out
    # docs/pruned removed them, but for the token pair that the previous (virtual) merged
    # version, still on the root for pinned jobs, reads in place
    left = [k for k in s3.keys("root/") if "part-00003" in k]
    assert left and all(k.startswith("root/tokens/docs/") for k in left), left
    assert f"-> s3://{s3.bucket}/root/blends/mix/manifest.json" in out
    manifest = f"s3://{s3.bucket}/root/blends/mix/manifest.json"
    assert f"tokenmill pull {manifest} blend-mix --endpoint-url {s3.endpoint}" in out
