"""Benchmark reading a pinned blend straight from S3 (moto_server on loopback) as a training
job would, against reading the local copy after ``tokenmill pull``, all in one run.

The blend: a virtual merge of ``--shards`` random shards (``--tokens`` uint16 tokens in all,
documents of 100..4,000 tokens), sequence length 2,048 (+1), batches of ``--batch`` samples;
uploaded once to a fresh bucket (not timed). One process, one rank, this rank's next two
batches prefetched while the current one is read (``ds.prefetch``). Measured:

* start-up: ``open_blend("s3://...")`` plus the first batch, cold cache, and the requests
  moto logged for each;
* cold and warm tokens/s over ``--steps`` batches (warm: the same cache, a fresh BlockCache as
  a restarted job has; blocks are re-hashed once on first use; then a second warm pass);
* bytes fetched (block GETs) against bytes used (the batches' tokens);
* peak RSS of this process while reading (``VmHWM`` reset after the build; moto runs in its
  own), file-backed pages of mapped cache blocks included;
* ``tokenmill pull`` of the blend (wall time), then the same batches from the local copy.

* moto alone: range GETs of every block of every token file, 8 at once (the cache's fetch
  threads), nothing stored or hashed: the server's own bound.

    python bench/bench_stream.py [--tokens 40000000] [--shards 4] [--steps 40] [--batch 64]
        [--block-mib 8]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import table, write_results

import tokenmill.formats.dataset_manifest as dataset_manifest
from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.formats.merge import virtual_merge
from tokenmill.indices.blend_build import build_blend
from tokenmill.loader import BatchSampler, _s3, open_blend
from tokenmill.storage.pull import pull
from tokenmill_dev.moto import moto_server

SEQ = 2048


def build(root: Path, tokens: int, shards: int, steps: int, batch: int) -> Path:
    """The blend ``stream`` under ``root``; returns its manifest."""
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
        weights={"web": 1.0},
        sequence_length=SEQ,
        split_spec="100,0,0",
        train_samples=steps * batch,
    )
    return root / "blends" / "stream" / "manifest.json"


def upload(client: object, bucket: str, root: Path) -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, path.relative_to(root).as_posix())  # type: ignore[attr-defined]


def requests(log: Path) -> int:
    """Requests moto has logged so far (its 206 lines start with colour codes)."""
    time.sleep(0.2)  # let the server flush its log line
    return len(re.findall(rb"(?:GET|HEAD|PUT|POST) /\S* HTTP/", log.read_bytes()))


def reset_peak_rss() -> None:
    """Start the peak RSS (``VmHWM``) again from the current RSS (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak_rss_mib() -> float:
    """``VmHWM`` of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def moto_alone(client: object, bucket: str, block: int, threads: int = 8) -> float:
    """MB/s of moto itself: every block of every ``.bin`` by range GET, ``threads`` at once
    (the cache's fetch threads), nothing stored or hashed."""
    from concurrent.futures import ThreadPoolExecutor

    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)  # type: ignore[attr-defined]
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


def read_all(ds: object, batches: list[np.ndarray], prefetch: bool) -> float:
    """Seconds to read every batch (prefetching the next two when asked)."""
    start = time.perf_counter()
    for step, indices in enumerate(batches):
        if prefetch:  # keep the next two batches in flight: each is asked for once
            for ahead in (
                batches[step + 1 : step + 3] if step == 0 else batches[step + 2 : step + 3]
            ):
                ds.prefetch(ahead)  # type: ignore[attr-defined]
        ds.get_batch(indices)  # type: ignore[attr-defined]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=40_000_000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--block-mib", type=float, default=8.0, help="per-block hash size")
    args = parser.parse_args()
    dataset_manifest.BLOCK_BYTES = int(args.block_mib * (1 << 20))  # what the writers record
    import boto3

    with tempfile.TemporaryDirectory(prefix="bench_stream_") as tmp:
        work = Path(tmp)
        manifest = build(work / "src", args.tokens, args.shards, args.steps, args.batch)
        with moto_server(work / "moto.log") as endpoint:
            os.environ.update(
                AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing",
                AWS_DEFAULT_REGION="us-east-1",
                AWS_ENDPOINT_URL=endpoint,
            )
            client = boto3.session.Session().client("s3", endpoint_url=endpoint)
            client.create_bucket(Bucket="bench")
            upload(client, "bench", work / "src")
            uri = "s3://bench/blends/stream/manifest.json"
            reset_peak_rss()  # the reads' peak, not the build's (again for the warm job)
            version = open_blend(manifest, "train").version
            cache = work / "cache"
            log = work / "moto.log"
            seen = requests(log)
            start = time.perf_counter()
            ds = open_blend(uri, "train", version=version, cache_dir=cache)
            opened = requests(log)
            batches = list(BatchSampler(len(ds), global_batch_size=args.batch))
            ds.get_batch(batches[0])
            startup = time.perf_counter() - start
            first = requests(log)
            cold = read_all(ds, batches[1:], prefetch=True)
            fetched = _s3.cache_for(cache, None).bytes_fetched
            cold_rss = peak_rss_mib()
            del ds  # a restarted job on the same node: warm cache, nothing mapped yet
            _s3._CACHES.clear()
            reset_peak_rss()
            warm_ds = open_blend(uri, "train", version=version, cache_dir=cache)
            warm = read_all(warm_ds, batches, prefetch=True)
            hot = read_all(warm_ds, batches, prefetch=True)  # same process: blocks checked
            start = time.perf_counter()
            pulled = pull(uri, work / "pulled", progress=False)
            pull_s = time.perf_counter() - start
            local = open_blend(pulled.manifest, "train")
            local_s = read_all(local, batches, prefetch=False)
            moto_mbs = moto_alone(client, "bench", dataset_manifest.BLOCK_BYTES)
    width = SEQ + 1
    used = len(batches) * args.batch * width * 2
    tok = args.batch * width
    rows = [
        ["reading", "start-up s", "tokens/s", "note"],
        [
            "S3, cold cache",
            f"{startup:.2f}",
            f"{(len(batches) - 1) * tok / cold:,.0f}",
            "first batch in start-up",
        ],
        ["S3, warm cache", "", f"{len(batches) * tok / warm:,.0f}", "blocks re-hashed once"],
        ["S3, warm, 2nd pass", "", f"{len(batches) * tok / hot:,.0f}", "blocks already checked"],
        ["local after pull", f"pull {pull_s:.2f}", f"{len(batches) * tok / local_s:,.0f}", ""],
    ]
    print(table(rows))
    print(
        f"requests: {opened - seen} to open, {first - opened} more for the first batch "
        f"({first - seen} before it)"
    )
    rss = peak_rss_mib()  # from the warm job on (the local read and moto alone included)
    print(
        f"block {args.block_mib} MiB; moto alone {moto_mbs:.0f} MB/s; "
        f"bytes fetched {fetched:,} / used {used:,} "
        f"({fetched / used:.2f}x); peak RSS cold {cold_rss:.0f} MiB, warm {rss:.0f} MiB; "
        f"{len(batches)} batches of "
        f"{args.batch} x {width} tokens, blend of {args.tokens:,} tokens"
    )
    write_results(
        f"bench_stream_{args.block_mib:g}mib",
        {
            "startup_s": startup,
            "cold_tokens_per_s": (len(batches) - 1) * tok / cold,
            "warm_tokens_per_s": len(batches) * tok / warm,
            "warm_second_pass_tokens_per_s": len(batches) * tok / hot,
            "local_tokens_per_s": len(batches) * tok / local_s,
            "pull_s": pull_s,
            "requests_open": opened - seen,
            "requests_first_batch": first - opened,
            "moto_alone_mb_per_s": moto_mbs,
            "bytes_fetched": fetched,
            "bytes_used": used,
            "peak_rss_cold_mib": cold_rss,
            "peak_rss_warm_mib": rss,
            "args": vars(args),
        },
    )


if __name__ == "__main__":
    main()
