"""The S3 phase of ``bench_pipeline.py``: single-shard runs and the refresh run on an S3 root
(moto_server, in process), counting requests by kind from moto's request log and the bytes the
pipeline's S3 client moves."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill_dev.moto import moto_server as moto_server  # bench_scale imports it from here


def request_kinds(lines: list[str]) -> Counter[str]:
    """S3 requests in moto's log lines by kind (LIST, GET, HEAD, PUT, multipart, DELETE)."""
    kinds: Counter[str] = Counter()
    for line in lines:
        found = re.search(r'"(GET|PUT|POST|DELETE|HEAD) (\S+) HTTP', line)
        if not found or found.group(2).startswith("/moto-api"):
            continue
        method, path = found.groups()
        if method == "GET" and ("list-type" in path or "delimiter" in path or "prefix=" in path):
            kinds["LIST"] += 1
        elif method in ("PUT", "POST") and "uploadId" in path:
            kinds["UPLOAD_PART" if method == "PUT" else "COMPLETE_MULTIPART"] += 1
        elif method == "POST" and "uploads" in path:
            kinds["CREATE_MULTIPART"] += 1
        else:
            kinds[method] += 1
    return kinds


def count_transfers(client: Any) -> dict[str, int]:
    """Live counts of the bytes a boto3 S3 client sends (``up``: request bodies) and receives
    (``down``: GetObject bodies), updated by botocore event hooks as requests go."""
    moved = {"up": 0, "down": 0}

    def sent(request: Any, **_: Any) -> None:
        moved["up"] += int(request.headers.get("Content-Length") or 0)

    def received(http_response: Any, model: Any, **_: Any) -> None:
        if model.name == "GetObject":
            moved["down"] += int(http_response.headers.get("content-length") or 0)

    client.meta.events.register("before-send.s3", sent)
    client.meta.events.register("after-call.s3", received)
    return moved


def s3_traffic(
    work: Path,
    shards: list[Path],
    tokenizer: Path,
    write_recipe: Callable[..., Path],
    run_config: dict[str, Any],
) -> dict[str, Any]:
    """Single-shard runs and the refresh run on an S3 root (moto_server), in process: requests
    by kind (moto's log) and bytes moved by the pipeline's client, per run."""
    import boto3
    from dagster import DagsterInstance

    from pipelines.build import build_definitions
    from pipelines.jobs import REFRESH_JOB
    from tokenmill.recipe import load_recipe
    from tokenmill.storage.s3 import shared_client

    work.mkdir(parents=True, exist_ok=True)
    log = work / "moto.log"
    with moto_server(log) as url:
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
        )
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket="bench")
        for shard in shards:
            client.upload_file(str(shard), "bench", f"sources/docs/{shard.name}")
        path = write_recipe(
            work / "s3.yaml", "s3://bench/root", "s3://bench/sources/docs/", tokenizer, url
        )
        recipe = load_recipe(path)
        moved = count_transfers(shared_client(url))
        defs = build_definitions(recipe)
        keys = sorted(p.name.split(".")[0] for p in shards)
        per_run = []
        with DagsterInstance.ephemeral() as instance:
            instance.add_dynamic_partitions("docs_shards", keys)
            jobs = [("docs_shard_job", k) for k in keys] + [(REFRESH_JOB, None)]
            for job, key in jobs:
                seen, before = len(log.read_text().splitlines()), dict(moved)
                result = defs.resolve_job_def(job).execute_in_process(
                    run_config=run_config, instance=instance, partition_key=key
                )
                lines = log.read_text().splitlines()[seen:]
                per_run.append(
                    {
                        "job": job,
                        "ok": result.success,
                        "requests": dict(request_kinds(lines)),
                        "bytes_up": moved["up"] - before.get("up", 0),
                        "bytes_down": moved["down"] - before.get("down", 0),
                    }
                )
        stored = Counter()
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket="bench", Prefix="root/"
        ):
            for obj in page.get("Contents", []):
                stored[obj["Key"].split("/")[1]] += obj["Size"]
    source_bytes = sum(p.stat().st_size for p in shards)
    return {
        "shards": len(shards),
        "source_bytes": source_bytes,
        "runs": per_run,
        "stored": dict(stored),
    }
