"""Tiny pipeline projects for the tests: a real-text corpus in JSONL shards and a recipe."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tokenmill.loader import open_blend
from tokenmill.recipe import Recipe, load_recipe
from tokenmill_dev.corpus import stdlib_documents, write_jsonl_shards

ROOT = Path(__file__).resolve().parents[1]


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


SPLITS = ("train", "valid", "test")


def blend_batches(manifest: Path) -> dict[str, np.ndarray]:
    """Every sample of every split of a blend, verified in full first."""
    out = {}
    for split in SPLITS:
        blend = open_blend(manifest, split, verify="full")
        out[split] = blend.get_batch(np.arange(len(blend)))
    return out


def add_shard_backfill(instance: Any, asset_graph: Any, keys: list[str], ds: str = "docs") -> str:
    """An asset backfill of ``ds``'s shard stages over ``keys``, as the UI submits one (the
    backfill daemon splits it into ranges by the shard assets' BackfillPolicy); its id.
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
        run_config=None,
    )
    instance.add_backfill(backfill)
    return backfill.backfill_id
