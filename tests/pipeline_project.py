"""Tiny pipeline projects for the tests: a real-text corpus in JSONL shards and a recipe."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from prod_servers import S3

from tokenmill.loader import open_blend
from tokenmill.recipe import Recipe, load_recipe
from tokenmill_dev.corpus import stdlib_documents, write_jsonl_shards

ROOT = Path(__file__).resolve().parents[1]
# Where the tests build bundled tokenizers when the repo has none: outside the work tree, shared
# by later sessions (a build is atomic: a complete directory or none).
TOKENIZER_CACHE = Path(tempfile.gettempdir()) / f"tokenmill-tests-{os.getuid()}" / "tokenizers"


def tokenizer_dir(name: str) -> Path:
    """The folder of bundled tokenizer ``name`` for the tests: the repo's ``.tokenizers/<name>``
    when ``make tokenizers`` built it, else one in ``TOKENIZER_CACHE`` (the suite never writes
    into the repo)."""
    repo = ROOT / ".tokenizers" / name
    return repo if (repo / "tokenizer.json").is_file() else TOKENIZER_CACHE / name


# Annotations of the ``make_recipe`` and ``documents`` fixtures (tests/conftest.py).
MakeRecipe = Callable[..., Recipe]
Documents = dict[str, list[dict[str, str]]]

BAD_LINES = [b'{"text": "unterminated', b'{"title": "no text field"}', b'{"text": 7}']


def write_shard(path: Path, docs: list[dict[str, str]], bad: list[bytes] = ()) -> Path:
    """A JSONL shard: the documents, with ``bad`` lines after the first one."""
    lines = [json.dumps(d).encode() for d in docs]
    lines[1:1] = list(bad)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def tiny_documents() -> dict[str, list[dict[str, str]]]:
    """Short real documents: stdlib prose and code, cut to keep tokenization instant."""
    docs = [{"text": d["text"][:1500]} for d in itertools.islice(stdlib_documents(kind="docs"), 40)]
    code = [{"text": d["text"][:1500]} for d in itertools.islice(stdlib_documents(kind="code"), 24)]
    return {"docs": docs, "code": code}


def make_project(
    root: Path, tokenizer: Path, documents: dict[str, list[dict[str, str]]], **overrides: Any
) -> Recipe:
    """Write a corpus under ``root/sources`` (once) and ``root/recipe.yaml`` for it; keyword
    overrides merge into the recipe's top-level sections."""
    sources = root / "sources"
    if not sources.exists():
        docs = documents["docs"]
        write_jsonl_shards(iter(docs[:30]), sources / "docs", shards=3, max_bytes=1 << 30)
        write_shard(sources / "docs" / "extra-00000.jsonl", docs[30:], BAD_LINES)
        write_jsonl_shards(
            iter(documents["code"]), sources / "code", shards=2, max_bytes=1 << 30, gzip_last=True
        )
    data: dict[str, Any] = {
        "storage": {"root": "data"},
        "tokenizer": {"path": str(tokenizer), "append_eod": True},
        "datasets": {
            "docs": {
                "source": "sources/docs",
                "on_bad_record": "quarantine",
                "max_quarantine_fraction": 0.25,  # 3 bad lines of 13 in extra-00000
            },
            "code": {"source": "sources/code"},
        },
        "nanoset": {"sequence_length": 32, "split": "80,10,10", "seed": 7, "train_samples": 120},
        "blends": {"mix": {"weights": {"docs": 0.7, "code": 0.3}}},
        "schedules": {"reprocess": "0 2 * * 0", "refresh": "0 3 * * *"},
    }
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return load_recipe(path)


def s3_project(make_recipe: MakeRecipe, s3: S3) -> Recipe:
    """The tiny project with its sources uploaded to ``s3://<bucket>/sources/<ds>/`` and the
    storage root at ``s3://<bucket>/root`` (the recipe file is rewritten)."""
    local = make_recipe()  # writes the corpus under tmp_path/sources (once)
    s3.upload_tree(local.path.parent / "sources", "sources")
    return make_recipe(
        storage={"root": f"s3://{s3.bucket}/root", "s3_endpoint_url": s3.endpoint},
        datasets={
            "docs": {
                "source": f"s3://{s3.bucket}/sources/docs/",
                "on_bad_record": "quarantine",
                "max_quarantine_fraction": 0.25,
            },
            "code": {"source": f"s3://{s3.bucket}/sources/code/"},
        },
    )


SPLITS = ("train", "valid", "test")


def blend_batches(manifest: Path) -> dict[str, np.ndarray]:
    """Every sample of every split of a blend, verified in full first."""
    out = {}
    for split in SPLITS:
        blend = open_blend(manifest, split, verify="full")
        out[split] = blend.get_batch(np.arange(len(blend)))
    return out


def add_shard_backfill(
    instance: Any,
    asset_graph: Any,
    keys: list[str],
    ds: str = "docs",
    run_config: dict[str, Any] | None = None,
) -> str:
    """An asset backfill of ``ds``'s shard stages over ``keys`` with ``run_config``, as the UI
    submits one (the backfill daemon splits it into ranges by the shard assets'
    BackfillPolicy); its id.
    Dagster is imported here, not at module level: every test session imports this module."""
    from dagster import AssetKey
    from dagster._core.execution.backfill import PartitionBackfill
    from dagster._core.utils import make_new_backfill_id

    from pipelines.jobs import SHARD_STAGES

    backfill = PartitionBackfill.from_asset_partitions(
        backfill_id=make_new_backfill_id(),
        asset_graph=asset_graph,
        partition_names=keys,
        asset_selection=[AssetKey([ds, stage]) for stage in SHARD_STAGES],
        backfill_timestamp=time.time(),
        tags={},
        dynamic_partitions_store=instance,
        all_partitions=False,
        title=None,
        description=None,
        run_config=run_config,
    )
    instance.add_backfill(backfill)
    return backfill.backfill_id


def materialize_shards(
    graph: tuple[list[Any], list[Any]],
    instance: Any,
    resources: dict[str, Any],
    ds: str,
    keys: list[str],
    *,
    ranged: bool = False,
    stages: tuple[str, ...] | None = None,
    raise_on_error: bool = True,
) -> list[Any]:
    """Materialize ``stages`` (the shard stages by default) of dataset ``ds`` over ``keys``, with
    the asset checks of ``graph`` (assets, checks): one run per key, stopping at the first that
    fails, or (``ranged``) one run over the range ``keys[0]..keys[-1]`` as a backfill submits it.
    Registers keys the instance lacks; the runs' results."""
    from dagster import AssetKey, materialize

    from assets.support.partitions import partitions_name
    from pipelines.jobs import SHARD_STAGES
    from pipelines.sensors import RANGE_END, RANGE_START

    name = partitions_name(ds)
    known = set(instance.get_dynamic_partitions(name))
    if missing := [key for key in keys if key not in known]:
        instance.add_dynamic_partitions(name, missing)
    selection = [AssetKey([ds, stage]) for stage in stages or SHARD_STAGES]
    if ranged:
        runs: list[dict[str, Any]] = [{"tags": {RANGE_START: keys[0], RANGE_END: keys[-1]}}]
    else:
        runs = [{"partition_key": key} for key in keys]
    results = []
    for run in runs:
        result = materialize(
            [*graph[0], *graph[1]],
            instance=instance,
            resources=resources,
            selection=selection,
            raise_on_error=raise_on_error,
            **run,
        )
        results.append(result)
        if not result.success:
            break
    return results


def materialize_downstream(
    graph: tuple[list[Any], list[Any]],
    instance: Any,
    resources: dict[str, Any],
    *,
    raise_on_error: bool = True,
) -> Any:
    """Materialize every unpartitioned asset of ``graph`` (assets, checks) with its checks."""
    from dagster import materialize

    assets, checks = graph
    downstream = [a.key for a in assets if a.partitions_def is None]
    return materialize(
        [*assets, *checks],
        instance=instance,
        resources=resources,
        selection=downstream,
        raise_on_error=raise_on_error,
    )


def runs_by_job(instance: Any) -> dict[str, int]:
    """How many successful runs of each job ``instance`` holds."""
    from dagster import DagsterRunStatus, RunsFilter

    counts: dict[str, int] = {}
    for run in instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.SUCCESS])):
        counts[run.job_name] = counts.get(run.job_name, 0) + 1
    return counts
