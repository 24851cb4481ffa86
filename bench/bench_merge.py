"""Merge throughput vs ``cp`` of the same bytes (issue: ``tokenmill merge`` >= 0.8x of cp).

Builds N shards of random uint16 tokens (with manifests, as the pipeline produces them), then
alternates ``cp`` of one file holding the same bytes, ``cp`` + ``sync`` of it (a crash-safe copy),
and ``tokenmill merge`` (a subprocess: interpreter start, imports, copy, fsync, manifest).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import run_timed, table, write_results

from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter


def make_shards(root: Path, total_mb: int, shards: int) -> list[Path]:
    """Shards of random documents totalling ``total_mb`` MB of uint16 tokens."""
    rng = np.random.default_rng(0)
    per_shard = total_mb * (1 << 20) // 2 // shards
    prefixes = []
    for s in range(shards):
        tokens = rng.integers(0, 50257, per_shard, dtype=np.uint16)
        cuts = np.sort(rng.choice(per_shard, per_shard // 600, replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [per_shard]]))
        prefix = root / f"shard_{s:03d}_text_document"
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_documents(tokens, lengths)
        write_dataset_manifest(prefix, kind="tokens", inputs=[], config={}, counts={})
        prefixes.append(prefix)
    return prefixes


def main() -> None:
    """Run the benchmark and print/write the results."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=1024, help="total .bin size in MB")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="tm-bench-merge-"))
    root.mkdir(parents=True, exist_ok=True)
    prefixes = make_shards(root, args.mb, args.shards)
    ref = root / "same_bytes.bin"
    with open(ref, "wb") as out:
        for p in prefixes:
            with open(f"{p}.bin", "rb") as fh:
                shutil.copyfileobj(fh, out, 16 << 20)
    nbytes = ref.stat().st_size
    dst = root / "copy.bin"
    merged = root / "merged_text_document"
    cmds = {
        "cp": ["cp", str(ref), str(dst)],
        "cp+sync": ["sh", "-c", f"cp '{ref}' '{dst}' && sync '{dst}'"],
        "tokenmill merge": [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "merge",
            "--input",
            *map(str, prefixes),
            "--output-prefix",
            str(merged),
        ],
    }
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in cmds}
    for _ in range(args.repeat):
        for name, cmd in cmds.items():
            for leftover in (dst, Path(f"{merged}.bin"), Path(f"{merged}.idx")):
                leftover.unlink(missing_ok=True)
            os.sync()
            runs[name].append(run_timed(cmd))
    best_cp = statistics.median(r["wall"] for r in runs["cp"])
    rows = [["command", "wall median s", "wall min s", "cpu median s", "MB/s", "cp/this"]]
    summary = {}
    for name, rs in runs.items():
        wall = statistics.median(r["wall"] for r in rs)
        summary[name] = {
            "wall_median": wall,
            "wall_min": min(r["wall"] for r in rs),
            "cpu_median": statistics.median(r["cpu"] for r in rs),
            "mb_per_s": nbytes / 1e6 / wall,
            "ratio_vs_cp": best_cp / wall,
            "runs": rs,
        }
        s = summary[name]
        rows.append(
            [
                name,
                f"{wall:.3f}",
                f"{s['wall_min']:.3f}",
                f"{s['cpu_median']:.3f}",
                f"{s['mb_per_s']:.0f}",
                f"{s['ratio_vs_cp']:.2f}",
            ]
        )
    print(f"merge of {args.shards} shards, {nbytes / 1e6:.0f} MB, {args.repeat} alternating runs")
    print(table(rows))
    path = write_results("merge", {"bytes": nbytes, "shards": args.shards, "results": summary})
    print(f"wrote {path}")
    if not args.dir:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
