"""Benchmark reading a pinned blend straight from S3 (moto_server on loopback) as a training
job would, against MosaicML streaming, litdata and the local copy after ``tokenmill pull``, all
in one run over the same samples.

The blend: a virtual merge of ``--shards`` random shards (``--tokens`` uint16 tokens in all,
documents of 100..4,000 tokens), sequence length 2,048 (+1), one epoch of samples; uploaded
once to a fresh bucket, and its samples, in blend order, converted once to MDS
(mosaicml-streaming ``MDSWriter``) and to litdata chunks (64 MB shards, uncompressed) and
uploaded beside it (not timed). Measured:

* a fresh process, ``--repeats`` times: its imports, then ``open_blend("s3://...",
  version=...)`` and the first batch, cold (an empty cache dir) then warm (the same cache: a
  restarted job), wall and CPU seconds (at the first batch, and by the process's exit: the
  blocks still being stored) and the GETs it sent; and moto alone serving the same
  GETs as a cold run, 8 at once (nothing stored or hashed): the server's bound for it
  (``--against DIR``: another checkout's processes too, alternating with this one's);
* the job, per tool: ``--ranks`` rank processes at once, each a torch DataLoader with
  ``--workers`` workers reading its slice of ``--steps`` global batches of ``--batch``
  samples (the same indices for every tool: each anchor reads sample i of its copy by random
  access, the order its conversion fixed). Cold (empty cache dir) then warm (the same cache,
  a restarted job): start-up (slowest rank, from before the tool's import to its first
  batch), tokens/s after the first batch (all ranks' tokens over the slowest rank's time),
  bytes in the cache dir after the cold job against the tokens' bytes, peak RSS (ranks and
  their largest worker, summed over ranks), and a digest of every batch (all tools agree);
* ``tokenmill pull`` (wall time), then the same job over the local copy;
* ``--jobs N``: N rounds of those jobs, the tools and the local read in turn, starting one
  later each round (a job of a few hundred batches lasts under a second, so one stall decides
  it); each cell then gives the range and the median;
* moto alone: range GETs of every block of every token file, 8 at once, nothing stored or
  hashed: the server's own bound.

    python bench/bench_stream.py [--tokens 40000000] [--shards 4] [--steps 40] [--batch 64]
        [--ranks 2] [--workers 2] [--block-mib 8] [--tools tokenmill,mosaic,litdata]
        [--repeats 3] [--jobs 1] [--first-only] [--against OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import table, write_results

import tokenmill.formats.dataset_manifest as dataset_manifest
from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.formats.merge import virtual_merge
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.loader import open_blend
from tokenmill.storage.pull import pull
from tokenmill_dev.moto import moto_server

SEQ = 2048
RANK = Path(__file__).resolve().parent / "_stream_rank.py"
ROOT = Path(__file__).resolve().parents[1]  # the tokenmill the first-batch processes import


def build(root: Path, tokens: int, shards: int) -> Path:
    """The blend ``stream`` (one epoch of samples) under ``root``; returns its manifest."""
    rng = np.random.default_rng(0)
    prefixes = []
    for k in range(shards):
        sizes = rng.integers(100, 4000, size=tokens // shards // 2050 + 1)
        prefix = root / "tokens" / f"part-{k:05d}_text_document"
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            writer.add_documents(rng.integers(0, 50000, size=int(sizes.sum())), sizes)
        counts = {"documents": len(sizes), "sequences": len(sizes), "tokens": int(sizes.sum())}
        write_dataset_manifest(prefix, kind="tokens", inputs=[], config={}, counts=counts)
        prefixes.append((f"part-{k:05d}", prefix))
    virtual_merge(prefixes, root / "merged" / "web_text_document")
    build_blend(
        "stream",
        {"web": root / "merged" / "web_text_document"},
        root / "blends" / "stream",
        root / "nanoset",
        BlendSettings(
            NanosetSettings(
                sequence_length=SEQ, split_spec="100,0,0", train_samples=tokens // (SEQ + 1) - 1
            ),
            weights={"web": 1.0},
        ),
    )
    return root / "blends" / "stream" / "manifest.json"


def convert(manifest: Path, out: Path, tools: list[str]) -> None:
    """The blend's samples, in blend order, as MDS and as litdata chunks (``tokens``: the
    uint16 bytes of the sample), 64 MB shards, uncompressed."""
    ds = open_blend(manifest, "train")
    step = 512
    chunks = [
        ds.get_batch(np.arange(lo, min(len(ds), lo + step))).astype(np.uint16)
        for lo in range(0, len(ds), step)
    ]
    if "mosaic" in tools:
        from _stream_rank import stand_in_torchvision

        stand_in_torchvision()
        from streaming import MDSWriter

        with MDSWriter(out=str(out / "mds"), columns={"tokens": "bytes"}, size_limit=1 << 26) as w:
            for chunk in chunks:
                for row in chunk:
                    w.write({"tokens": row.tobytes()})
    if "litdata" in tools:
        from litdata.streaming.writer import BinaryWriter

        writer = BinaryWriter(str(out / "litdata"), chunk_bytes=1 << 26)
        k = 0
        for chunk in chunks:
            for row in chunk:
                writer.add_item(k, {"tokens": row.tobytes()})
                k += 1
        writer.done()
        writer.merge()


def upload(client: object, bucket: str, root: Path, prefix: str = "") -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        key = prefix + path.relative_to(root).as_posix()
        client.upload_file(str(path), bucket, key)  # type: ignore[attr-defined]


def moto_alone(client: object, bucket: str, block: int, threads: int = 8) -> float:
    """MB/s of moto itself: every block of every ``.bin`` by range GET, ``threads`` at once
    (the cache's fetch threads), nothing stored or hashed."""
    from concurrent.futures import ThreadPoolExecutor

    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="tokens/")  # type: ignore[attr-defined]
    objects = [(o["Key"], o["Size"]) for p in pages for o in p["Contents"]]
    ranges = [
        (key, lo, min(size, lo + block) - 1)
        for key, size in objects
        if key.endswith(".bin")
        for lo in range(0, size, block)
    ]

    def get(r: tuple[str, int, int]) -> int:
        body = client.get_object(Bucket=bucket, Key=r[0], Range=f"bytes={r[1]}-{r[2]}")  # type: ignore[attr-defined]
        return len(body["Body"].read())

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(get, ranges))
    return total / (time.perf_counter() - start) / 1e6


FIRST = """
import json, resource, sys, time
start = time.perf_counter()
import numpy as np
import tokenmill.storage.s3 as s3_helpers
gets, make = [], s3_helpers.make_client
def hooked(*args, **kwargs):
    client = make(*args, **kwargs)
    client.meta.events.register(
        "provide-client-params.s3.GetObject",
        lambda params, **_: gets.append([params["Key"], params.get("Range")]),
    )
    return client
s3_helpers.make_client = hooked
from tokenmill.loader import BatchSampler, open_blend
import boto3
imported = time.perf_counter()
uri, version, cache, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ds = open_blend(uri, "train", version=version, cache_dir=cache)
opened, before = time.perf_counter(), len(gets)
ds.get_batch(next(iter(BatchSampler(len(ds), global_batch_size=batch))))
done = time.perf_counter()
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"imports_s": imported - start, "open_s": opened - imported,
                  "first_batch_s": done - imported, "startup_s": done - start,
                  "cpu_s": usage.ru_utime + usage.ru_stime, "open_requests": before,
                  "requests": len(gets), "gets": gets}))
"""


def first_batch(
    uri: str,
    version: str,
    work: Path,
    args: argparse.Namespace,
    client: Any,
    env: dict[str, str],
) -> dict[str, Any]:
    """A fresh process, from before its imports: open plus the first batch, cold (an empty
    cache dir) then warm (the same cache: a restarted job), ``args.repeats`` times; and moto
    alone serving the same GETs as a cold run, 8 at once (nothing stored or hashed): its bound.
    ``args.against``: another checkout's processes too, alternating with this one's."""
    roots = [ROOT, *([Path(args.against).resolve()] if args.against else [])]
    found: dict[str, list[Any]] = {"load": [os.getloadavg()[0]]}  # 1-minute load average
    for r in range(args.repeats):
        for root in roots:
            tag = "" if root == ROOT else f" ({root})"
            for kind in ("cold", "warm"):
                cache = work / f"first-{r}-{roots.index(root)}"
                cmd = [sys.executable, "-c", FIRST, uri, version, str(cache), str(args.batch)]
                run_env = dict(env, PYTHONPATH=str(root))
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                out = subprocess.run(cmd, env=run_env, check=True, capture_output=True, cwd=root)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                got = json.loads(out.stdout)
                got["cpu_exit_s"] = (after.ru_utime + after.ru_stime) - (
                    before.ru_utime + before.ru_stime
                )  # with what it still did after the first batch (blocks stored on exit)
                gets = got.pop("gets")
                found.setdefault(kind + tag, []).append(got)
                if kind == "cold":
                    moto = replay(client, "bench", gets)
                    found.setdefault("moto_alone_s" + tag, []).append(moto)
    found["load"].append(os.getloadavg()[0])
    return found


def replay(client: Any, bucket: str, gets: list[tuple[str, str | None]]) -> float:
    """Seconds moto takes to serve ``gets`` (key, range), 8 at once, bodies read whole."""
    from concurrent.futures import ThreadPoolExecutor

    def get(where: tuple[str, str | None]) -> int:
        extra = {"Range": where[1]} if where[1] else {}
        return len(client.get_object(Bucket=bucket, Key=where[0], **extra)["Body"].read())

    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        sum(pool.map(get, gets))
    return time.perf_counter() - start


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def job(
    tool: str, source: str, cache: Path, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """``args.ranks`` rank processes at once (``_stream_rank.py``); their results combined."""
    outs = [cache.parent / f"{cache.name}-{tool}-rank{r}.json" for r in range(args.ranks)]
    procs = []
    for r in range(args.ranks):
        rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.ranks))
        rank_env.update(LOCAL_WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1")
        rank_env["MASTER_PORT"] = env["BENCH_MASTER_PORT"]
        cmd = [sys.executable, str(RANK), tool, source, str(cache), str(r), str(args.ranks)]
        cmd += [str(args.steps), str(args.batch), str(args.workers), str(outs[r])]
        procs.append(subprocess.Popen(cmd, env=rank_env))
    for proc in procs:
        if proc.wait(timeout=1800) != 0:
            raise RuntimeError(f"{tool} rank exited with {proc.returncode}")
    got = [json.loads(o.read_text()) for o in outs]
    seconds = max(g["seconds"] for g in got)
    return {
        "startup_s": max(g["startup_s"] for g in got),
        "tokens_per_s": sum(g["tokens"] for g in got) / seconds,
        "digest": [g["digest"] for g in got],
        "peak_rss_mib": sum(g["peak_rss_mib"] for g in got),
        "cache_bytes": du(cache),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=40_000_000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--block-mib", type=float, default=8.0, help="per-block hash size")
    parser.add_argument("--tools", default="tokenmill,mosaic,litdata")
    parser.add_argument("--repeats", type=int, default=3, help="cold/warm first batches")
    parser.add_argument(
        "--jobs", type=int, default=1, help="job rounds (tools in turn): ranges and medians"
    )
    parser.add_argument("--first-only", action="store_true", help="only the first batches")
    parser.add_argument("--against", help="another checkout: its first batches too, alternating")
    args = parser.parse_args()
    tools = [] if args.first_only else args.tools.split(",")
    dataset_manifest.BLOCK_BYTES = int(args.block_mib * (1 << 20))  # what the writers record
    import boto3

    from tokenmill_dev.moto import free_port

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_stream_") as tmp:
        work = Path(tmp)
        manifest = build(work / "src", args.tokens, args.shards)
        convert(manifest, work / "anchors", tools)
        log = work / "moto.log"
        with moto_server(log) as endpoint:
            env = dict(
                os.environ,
                AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing",
                AWS_DEFAULT_REGION="us-east-1",
                AWS_ENDPOINT_URL=endpoint,
                S3_ENDPOINT_URL=endpoint,  # mosaicml-streaming's variable
                BENCH_MASTER_PORT=str(free_port()),
                PYTHONPATH=str(Path(__file__).resolve().parents[1]),
            )
            os.environ.update(env)
            client = boto3.session.Session().client("s3", endpoint_url=endpoint)
            client.create_bucket(Bucket="bench")
            upload(client, "bench", work / "src")
            for name in ("mds", "litdata"):
                if (work / "anchors" / name).is_dir():
                    upload(client, "bench", work / "anchors" / name, f"{name}/")
            uri = "s3://bench/blends/stream/manifest.json"
            version = str(open_blend(manifest, "train").version)
            env["BENCH_VERSION"] = version
            results["first_batch"] = first_batch(uri, version, work, args, client, env)
            if args.first_only:
                report_first(results["first_batch"])
                return
            sources = {
                "tokenmill": uri,
                "mosaic": "s3://bench/mds",
                "litdata": "s3://bench/litdata",
            }
            start = time.perf_counter()
            pulled = pull(uri, work / "pulled", progress=False)
            results["pull_s"] = time.perf_counter() - start
            sources["local"] = str(pulled.manifest)
            order = [*tools, "local"]
            for tool in order:
                results[tool] = {"cold": [], "warm": []} if tool != "local" else []
            for r in range(args.jobs):  # rounds: the tools in turn, starting one later each round
                k = r % len(order)
                for tool in order[k:] + order[:k]:
                    cache = work / f"cache-{tool}-{r}"  # empty: this round's cold job
                    if tool == "local":
                        results["local"].append(job(tool, sources[tool], cache, args, env))
                        continue
                    results[tool]["cold"].append(job(tool, sources[tool], cache, args, env))
                    results[tool]["warm"].append(job(tool, sources[tool], cache, args, env))
            results["moto_alone_mb_per_s"] = moto_alone(
                client, "bench", dataset_manifest.BLOCK_BYTES
            )
    report(results, args, tools)


def report_first(found: dict[str, Any]) -> None:
    """Print the first-batch runs: ranges of wall and CPU seconds, and moto's bound."""

    def span(values: list[float], digits: int = 2) -> str:
        return f"{min(values):.{digits}f}-{max(values):.{digits}f}"

    for kind, runs in found.items():
        if kind == "load" or kind.startswith("moto_alone_s"):
            continue
        print(
            f"one fresh process, {kind}: imports (numpy, tokenmill.loader, boto3) "
            f"{span([r['imports_s'] for r in runs])} s, then open "
            f"{span([r['open_s'] for r in runs])} s, first batch at "
            f"{span([r['first_batch_s'] for r in runs])} s, median "
            f"{float(np.median([r['first_batch_s'] for r in runs])):.2f} s ("
            f"{span([r['startup_s'] for r in runs])} s from the start), "
            f"{span([r['cpu_s'] for r in runs])} CPU-s by then "
            f"({span([r['cpu_exit_s'] for r in runs])} by its exit), "
            f"{span([r['open_requests'] for r in runs], 0)} requests in the open, "
            f"{span([r['requests'] for r in runs], 0)} by the end of the first batch"
        )
        moto = found.get("moto_alone_s" + kind.removeprefix("cold").removeprefix("warm"))
        if kind.startswith("cold") and moto:
            print(f"  moto alone serving the same GETs, 8 at once: {span(moto)} s")
    print(f"load average {found['load'][0]:.1f} before, {found['load'][-1]:.1f} after")


def spread(runs: list[dict[str, Any]], key: str, fmt: str) -> str:
    """One job's value, or ``min-max (median)`` over the rounds."""
    values = sorted(run[key] for run in runs)
    if len(values) == 1:
        return format(values[0], fmt)
    median = float(np.median(values))
    return f"{values[0]:{fmt}}-{values[-1]:{fmt}} ({median:{fmt}})"


def report(results: dict[str, Any], args: argparse.Namespace, tools: list[str]) -> None:
    """Print the table (each cell: one job, or the range and median over ``--jobs`` rounds)
    and write the JSON (every job)."""
    used = args.steps * args.batch * (SEQ + 1) * 2
    runs = [run for t in tools for kind in ("cold", "warm") for run in results[t][kind]]
    digests = {json.dumps(run["digest"]) for run in runs + results["local"]}
    rows = [["reading", "start-up s", "tokens/s", "cache bytes / used", "peak RSS MiB"]]
    for tool in tools:
        for kind in ("cold", "warm"):
            got = results[tool][kind]
            ratio = [{"r": run["cache_bytes"] / used} for run in got]
            rows.append(
                [
                    f"{tool}, {kind}",
                    spread(got, "startup_s", ".2f"),
                    spread(got, "tokens_per_s", ",.0f"),
                    spread(ratio, "r", ".1f") + "x" if kind == "cold" else "",
                    spread(got, "peak_rss_mib", ".0f"),
                ]
            )
    local = results["local"]
    rows.append(
        [
            f"local after pull ({results['pull_s']:.2f} s)",
            spread(local, "startup_s", ".2f"),
            spread(local, "tokens_per_s", ",.0f"),
            "",
            spread(local, "peak_rss_mib", ".0f"),
        ]
    )
    print(table(rows))
    if "tokenmill" in tools:
        warm = [run["tokens_per_s"] for run in results["tokenmill"]["warm"]]
        ratios = [w / run["tokens_per_s"] for w, run in zip(warm, local, strict=True)]
        print("tokenmill warm / local, per round: " + ", ".join(f"{r:.2f}" for r in ratios))
    report_first(results["first_batch"])
    print(
        f"moto alone {results['moto_alone_mb_per_s']:.0f} "
        f"MB/s; {args.ranks} ranks x {args.workers} workers, {args.steps} batches of "
        f"{args.batch} x {SEQ + 1} tokens, blend of {args.tokens:,} tokens, block "
        f"{args.block_mib:g} MiB; same tokens everywhere: {len(digests) == 1}"
    )
    write_results(f"bench_stream_{args.block_mib:g}mib", {**results, "args": vars(args)})


if __name__ == "__main__":
    main()
