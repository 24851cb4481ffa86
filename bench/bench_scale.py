"""Work per step at scale: does a shard step stay O(its shard), and a refresh O(what changed)?

``python bench/bench_scale.py [--shards 1000] [--docs 8]`` builds ``--shards`` JSONL shards of
real text (stdlib sources, ``--docs`` documents each) and runs every shard stage of each shard
by invoking the assets as a run would (``build_asset_context``, a local storage root), in
order, timing the CPU of each step. Then it refreshes (``dataset_info``, ``merged``,
``pruned``, ``nanoset``, the blend), adds one shard and refreshes again.

Reported per step: CPU seconds (``time.process_time``), bytes read through ``read`` calls
(``rchar`` of ``/proc/self/io``; memory-mapped and kernel-copied bytes are not in it) and the
files opened below the storage root with their total size (an audit hook sees every Python
``open``; pyarrow's own I/O is not seen). The claim under test: the shard step's CPU for shard
#N is within 1.2× of shard #10 (medians of 9-shard windows), and a refresh after one new shard
opens that shard's files plus the merge's inputs (the copy), not every Parquet or raw file.
Part 2 runs ``--s3-shards`` shards on an S3 root (moto_server): each shard run's download
against its source size (goal ≤ 1.5×), then a refresh and an unchanged refresh, which must
upload no index array. Part 3 builds a blend over a ``--blend-gb`` GB merged dataset whose
``.bin`` is sparse and reports what was read: a blend must never open a merged ``.bin``.
Part 4 measures the refresh after one new shard (CPU-s, bytes written per folder, and on S3 the
bytes up and down) for ``merge: virtual`` and ``physical`` under megatron and growing semantics
(growing: index entries extended, not rebuilt); ``--refresh-only`` runs parts 1 and 4 alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _util import OUT_DIR, table, write_results  # noqa: E402
from corpus import stdlib_texts  # noqa: E402

SHARD_STAGES = ("raw_jsonl", "hf_dataset", "tokens")
REFRESH = (("docs", "dataset_info"), ("docs", "merged"), ("docs", "pruned"), ("docs", "nanoset"))
REFRESH_REBUILT = (("docs", "merged"), ("docs", "nanoset"), ("blend", "all"))
_OPENED: list[str] | None = None
_LAST_OPENED: list[str] = []  # what the last measured block opened


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], str | bytes):
        _OPENED.append(os.fsdecode(args[0]))


def rchar() -> int:
    """Bytes this process has read through read-like system calls so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


@contextmanager
def measured(root: Path, into: dict[str, Any]) -> Iterator[None]:
    """CPU, rchar and the files under ``root`` opened inside the block."""
    global _OPENED
    _OPENED = []
    cpu, chars = time.process_time(), rchar()
    try:
        yield
    finally:
        into["cpu"] = time.process_time() - cpu
        into["rchar"] = rchar() - chars
        opened, _OPENED = sorted(set(_OPENED)), None
        _LAST_OPENED[:] = opened
        ours = [Path(p) for p in opened if p.startswith(str(root))]
        files = [p for p in ours if p.is_file()]
        into["files_opened"] = len(files)
        into["bytes_of_files_opened"] = sum(p.stat().st_size for p in files)


def write_shards(source: Path, count: int, docs: int, start: int = 0) -> None:
    """``count`` shards of ``docs`` real documents each (stdlib sources, in path order)."""
    source.mkdir(parents=True, exist_ok=True)
    texts = [text for _, text in stdlib_texts() if 200 < len(text) < 20_000]
    for i in range(start, start + count):
        lines = [
            json.dumps({"text": texts[(i * docs + j) % len(texts)]}) + "\n" for j in range(docs)
        ]
        (source / f"part-{i:05d}.jsonl").write_text("".join(lines), encoding="utf-8")


MODES = (("virtual", "megatron"), ("physical", "megatron"), ("virtual", "growing"),
         ("physical", "growing"))  # fmt: skip


def nanoset_settings(semantics: str = "megatron") -> dict[str, Any]:
    """The recipe's ``nanoset`` section (growing: no cap, the index grows with the data)."""
    samples = None if semantics == "growing" else 2000
    return {"sequence_length": 512, "split": "90,5,5", "train_samples": samples,
            "semantics": semantics}  # fmt: skip


def make_recipe(
    work: Path, tokenizer: Path, merge: str = "virtual", semantics: str = "megatron"
) -> Path:
    """A one-dataset recipe over ``work/sources/docs`` with one blend."""
    import yaml

    recipe = {
        "storage": {"root": str(work / "data")},
        "tokenizer": {"path": str(tokenizer), "append_eod": True},
        "datasets": {"docs": {"source": str(work / "sources" / "docs")}},
        "nanoset": nanoset_settings(semantics),
        "blends": {"all": {"weights": {"docs": 1.0}}},
        "merge": merge,
    }
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


class Runner:
    """Invokes the recipe's assets one at a time, as a run would, on one ephemeral instance."""

    def __init__(self, recipe_path: Path) -> None:
        from dagster import DagsterInstance

        from assets.factory import build_assets
        from pipelines.build import resources_for
        from tokenmill.recipe import load_recipe

        self.recipe = load_recipe(recipe_path)
        self.assets = {a.key: a for a in build_assets(self.recipe)[0]}
        self.resources = resources_for(self.recipe)
        self.instance = DagsterInstance.ephemeral()
        self.root = Path(self.recipe.storage.root).resolve()

    def add(self, keys: list[str]) -> None:
        self.instance.add_dynamic_partitions("docs_shards", keys)

    def run(self, key: tuple[str, ...], partition: str | None = None) -> dict[str, Any]:
        from dagster import AssetKey, build_asset_context

        result: dict[str, Any] = {"asset": "/".join(key), "partition": partition}
        with (
            build_asset_context(
                resources=self.resources, instance=self.instance, partition_key=partition
            ) as context,
            measured(self.root, result),
        ):
            self.assets[AssetKey(list(key))](context)
        return result


def window(steps: list[dict[str, Any]], around: int) -> float:
    """Median CPU of the shard steps (all stages summed) of the 9 shards ending at ``around``."""
    per_shard: dict[str, float] = {}
    for step in steps:
        per_shard[step["partition"]] = per_shard.get(step["partition"], 0.0) + step["cpu"]
    cpus = list(per_shard.values())[max(0, around - 9) : around]
    return statistics.median(cpus)


def local_scale(shards: int, docs: int, tokenizer: Path, work: Path) -> dict[str, Any]:
    """Part 1: ``shards`` shards on a local root, a refresh, one more shard, a refresh."""
    source = work / "sources" / "docs"
    write_shards(source, shards, docs)
    runner = Runner(make_recipe(work, tokenizer))
    keys = [f"part-{i:05d}" for i in range(shards)]
    runner.add(keys)
    steps = []
    started = time.perf_counter()
    for n, key in enumerate(keys, 1):
        for stage in SHARD_STAGES:
            steps.append(runner.run(("docs", stage), key))
        if n % 100 == 0:
            print(f"  {n} shards in {time.perf_counter() - started:.0f} s", flush=True)
    refresh = [runner.run(key) for key in (*REFRESH, ("blend", "all"))]
    new = f"part-{shards:05d}"
    write_shards(source, 1, docs, start=shards)
    runner.add([new])
    added = [runner.run(("docs", stage), new) for stage in SHARD_STAGES]
    again = [runner.run(key) for key in (*REFRESH, ("blend", "all"))]
    merged_bytes = sum(p.stat().st_size for p in (runner.root / "merged" / "docs").rglob("*.bin"))
    shard_bytes = (source / f"{new}.jsonl").stat().st_size
    return {
        "shards": shards,
        "docs_per_shard": docs,
        "shard_bytes": shard_bytes,
        "cpu_shard_10": window(steps, 10),
        "cpu_shard_last": window(steps, shards),
        "shard_steps": steps,
        "refresh": refresh,
        "added_shard": added,
        "refresh_after_one_shard": again,
        "merged_bin_bytes_all_versions": merged_bytes,
    }


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: relative path -> (size, mtime_ns)."""
    out = {}
    for p in root.rglob("*"):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def _written(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> dict[str, int]:
    """Bytes of the files that are new or changed between two snapshots, per top folder."""
    out: dict[str, int] = {}
    for rel, (size, mtime) in after.items():
        if before.get(rel) != (size, mtime):
            top = rel.split("/", 1)[0]
            out[top] = out.get(top, 0) + size
    return out


def refresh_cost(source_root: Path, shards: int, tokenizer: Path, work: Path) -> dict[str, Any]:
    """Part 4: the refresh after one new shard, ``merge: virtual`` against ``merge: physical``,
    under megatron and growing semantics, on copies of part 1's per-shard artifacts
    (``shards`` + 1 tokenized shards): the first refresh over ``shards``, then the new shard
    registered and the refresh again, measuring its CPU and the bytes it wrote (files new or
    changed under the root, per folder)."""
    import shutil

    out: dict[str, Any] = {"shards": shards}
    for merge, semantics in MODES:
        mode_work = work / f"refresh-{merge}-{semantics}"
        root = mode_work / "data"
        for folder in ("raw", "hf", "tokens"):
            shutil.copytree(source_root / folder, root / folder)
        (mode_work / "sources" / "docs").mkdir(parents=True)
        runner = Runner(make_recipe(mode_work, tokenizer, merge, semantics))
        runner.add([f"part-{i:05d}" for i in range(shards)])
        for key in REFRESH_REBUILT:
            runner.run(key)
        runner.add([f"part-{shards:05d}"])
        before = _files(root)
        steps = [runner.run(key) for key in REFRESH_REBUILT]
        by_folder = _written(before, _files(root))
        out[f"{merge}-{semantics}"] = {
            "cpu": sum(step["cpu"] for step in steps),
            "bytes_written": sum(by_folder.values()),
            "bytes_written_by_folder": by_folder,
            "steps": steps,
        }
        print(f"  part 4, {merge}/{semantics}: {out[f'{merge}-{semantics}']['cpu']:.2f} CPU-s, "
              f"{by_folder}", flush=True)  # fmt: skip
    new = source_root / "tokens" / "docs" / f"part-{shards:05d}_text_document.bin"
    out["new_shard_token_bytes"] = new.stat().st_size
    return out


def refresh_cost_s3(source_root: Path, shards: int, tokenizer: Path, work: Path) -> dict[str, Any]:
    """Part 4 on an S3 root (moto_server): part 1's per-shard artifacts uploaded once per mode,
    a refresh over ``shards``, then one more shard and the refresh again, counting the bytes
    the pipeline's S3 client moves and the CPU of that refresh."""
    import boto3
    import yaml
    from _pipeline_s3 import count_transfers, moto_server
    from dagster import DagsterInstance

    from pipelines.build import build_definitions
    from pipelines.jobs import REFRESH_JOB
    from tokenmill.recipe import load_recipe
    from tokenmill.storage.s3 import shared_client

    work.mkdir(parents=True, exist_ok=True)
    quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
    out: dict[str, Any] = {"shards": shards}
    with moto_server(work / "moto.log") as url:
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
        )
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket="bench")
        files = [p for p in source_root.rglob("*") if p.is_file() and ".tmp" not in p.parts]
        files = [p for p in files if p.relative_to(source_root).parts[0] in ("raw", "hf", "tokens")]
        new = f"part-{shards:05d}"
        late = [p for p in files if p.name.startswith(f"{new}.") or p.name.startswith(f"{new}_")]
        for merge, semantics in MODES:
            mode = f"{merge}-{semantics}"

            def upload(paths: list[Path], mode: str = mode) -> None:
                for p in paths:
                    client.upload_file(str(p), "bench", f"{mode}/{p.relative_to(source_root)}")

            upload([p for p in files if p not in late])
            recipe = {
                "storage": {"root": f"s3://bench/{mode}", "s3_endpoint_url": url},
                "tokenizer": {"path": str(tokenizer), "append_eod": True},
                "datasets": {"docs": {"source": "s3://bench/no-sources/"}},
                "nanoset": nanoset_settings(semantics),
                "blends": {"all": {"weights": {"docs": 1.0}}},
                "merge": merge,
            }
            path = work / f"{mode}.yaml"
            path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
            job = build_definitions(load_recipe(path)).resolve_job_def(REFRESH_JOB)
            moved = count_transfers(shared_client(url))
            with DagsterInstance.ephemeral() as instance:
                old = [f"part-{i:05d}" for i in range(shards)]
                instance.add_dynamic_partitions("docs_shards", old)
                job.execute_in_process(run_config=quiet, instance=instance)
                upload(late)  # after the first refresh: its pruned step would remove them
                instance.add_dynamic_partitions("docs_shards", [new])
                before, cpu = dict(moved), time.process_time()
                result = job.execute_in_process(run_config=quiet, instance=instance)
                out[mode] = {
                    "ok": bool(result.success),
                    "cpu": time.process_time() - cpu,
                    "bytes_up": moved["up"] - before["up"],
                    "bytes_down": moved["down"] - before["down"],
                }
            print(f"  part 4 on S3, {mode}: {out[mode]}", flush=True)
    return out


def refresh_report(local: dict[str, Any], remote: dict[str, Any] | None) -> str:
    """The table of part 4: each merge mode and semantics."""
    rows = [
        [
            "refresh after 1 new shard",
            "CPU s",
            "MB written",
            "of which nanoset/",
            "MB up (S3)",
            "MB down (S3)",
            "CPU s (S3)",
        ]
    ]
    for merge, semantics in MODES:
        mode = f"{merge}-{semantics}"
        s3_part = (remote or {}).get(mode) or {}
        part = local[mode]
        rows.append(
            [
                f"merge: {merge}, {semantics}, {local['shards']} shards",
                f"{part['cpu']:.2f}",
                f"{part['bytes_written'] / 1e6:.3f}",
                f"{part['bytes_written_by_folder'].get('nanoset', 0) / 1e6:.3f}",
                f"{s3_part['bytes_up'] / 1e6:.3f}" if s3_part else "",
                f"{s3_part['bytes_down'] / 1e6:.3f}" if s3_part else "",
                f"{s3_part['cpu']:.2f}" if s3_part else "",
            ]
        )
    new = local["new_shard_token_bytes"]
    return table(rows) + f"\nthe new shard's token .bin: {new / 1e6:.3f} MB"


def big_blend(gigabytes: float, work: Path) -> dict[str, Any]:
    """Part 3: a blend over a merged dataset of ``gigabytes`` GB (uint16 tokens, documents of
    1,000-3,000 tokens) whose ``.bin`` is a sparse file: building the blend must not read it
    (a read would show in ``rchar`` and in the files opened)."""
    import numpy as np

    from tokenmill.formats.dataset_manifest import write_dataset_manifest
    from tokenmill.formats.indexed import encode_index
    from tokenmill.indices.blend_build import build_blend
    from tokenmill.indices.settings import BlendSettings, NanosetSettings

    root = work / "big"
    prefix = root / "merged" / "big" / "0123456789abcdef" / "big_text_document"
    prefix.parent.mkdir(parents=True)
    tokens = int(gigabytes * 1e9) // 2
    rng = np.random.default_rng(0)
    lengths = rng.integers(1000, 3000, size=tokens // 2000 + 1, dtype=np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens))]
    docs = np.arange(len(lengths) + 1, dtype=np.int64)
    Path(f"{prefix}.idx").write_bytes(encode_index(np.uint16, lengths, docs))
    size = int(lengths.sum()) * 2
    with open(f"{prefix}.bin", "wb") as fh:
        fh.truncate(size)  # sparse: no data written, none to read
    write_dataset_manifest(
        prefix,
        kind="merged",
        inputs=[],
        config={"order": "given", "dtype": "uint16"},
        counts={"documents": len(lengths), "sequences": len(lengths), "tokens": size // 2},
        bin_parts=[{"bytes": size, "sha256": "0" * 64}],  # never checked by a blend build
    )
    result: dict[str, Any] = {"bin_bytes": size, "documents": len(lengths)}
    with measured(root, result):
        start = time.perf_counter()
        build_blend(
            "big",
            {"big": prefix},
            root / "blends" / "big",
            root / "nanoset",
            BlendSettings(
                NanosetSettings(sequence_length=2048, split_spec="100,0,0", train_samples=100_000),
                weights={"big": 1.0},
            ),
        )
        result["wall"] = time.perf_counter() - start
    bin_opened = [p for p in _LAST_OPENED if p.endswith(".bin")]
    result["bin_opened"] = bin_opened
    return result


def s3_scale(shards: int, docs: int, tokenizer: Path, work: Path) -> dict[str, Any]:
    """Part 2: ``shards`` shards on an S3 root (moto_server): bytes each shard run downloads
    against its source's size, then a refresh and an unchanged refresh, counting the index
    arrays (``.npy``) each uploads."""
    import boto3
    import yaml
    from _pipeline_s3 import count_transfers, moto_server, request_kinds
    from dagster import DagsterInstance

    from pipelines.build import build_definitions
    from pipelines.jobs import REFRESH_JOB
    from tokenmill.recipe import load_recipe
    from tokenmill.storage.s3 import shared_client

    source = work / "s3-sources"
    write_shards(source, shards, docs)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "moto.log"
    quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
    with moto_server(log) as url:
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
        )
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket="bench")
        for shard in sorted(source.iterdir()):
            client.upload_file(str(shard), "bench", f"sources/docs/{shard.name}")
        recipe = {
            "storage": {"root": "s3://bench/root", "s3_endpoint_url": url},
            "tokenizer": {"path": str(tokenizer), "append_eod": True},
            "datasets": {"docs": {"source": "s3://bench/sources/docs/"}},
            "nanoset": {"sequence_length": 512, "split": "90,5,5", "train_samples": 2000},
            "blends": {"all": {"weights": {"docs": 1.0}}},
        }
        path = work / "s3-recipe.yaml"
        path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
        defs = build_definitions(load_recipe(path))
        moved = count_transfers(shared_client(url))
        keys = [f"part-{i:05d}" for i in range(shards)]
        runs = []
        with DagsterInstance.ephemeral() as instance:
            instance.add_dynamic_partitions("docs_shards", keys)
            jobs = [("docs_shard_job", k) for k in keys]
            jobs += [(REFRESH_JOB, "refresh"), (REFRESH_JOB, "unchanged refresh")]
            for job, key in jobs:
                seen, before = len(log.read_text().splitlines()), dict(moved)
                partition = key if job != REFRESH_JOB else None
                result = defs.resolve_job_def(job).execute_in_process(
                    run_config=quiet, instance=instance, partition_key=partition
                )
                lines = log.read_text().splitlines()[seen:]
                npy_puts = sum(1 for line in lines if '"PUT ' in line and ".npy" in line)
                runs.append(
                    {
                        "job": job,
                        "what": key,
                        "ok": bool(result.success),
                        "requests": dict(request_kinds(lines)),
                        "bytes_down": moved["down"] - before["down"],
                        "bytes_up": moved["up"] - before["up"],
                        "npy_puts": npy_puts,
                        "input_bytes": (source / f"{key}.jsonl").stat().st_size
                        if job != REFRESH_JOB
                        else None,
                    }
                )
    shard_runs = [r for r in runs if r["input_bytes"]]
    return {
        "shards": shards,
        "runs": runs,
        "max_download_ratio": max(r["bytes_down"] / r["input_bytes"] for r in shard_runs),
    }


def stale_temp_scan(work: Path, names: int = 50_000) -> dict[str, Any]:
    """CPU per ``remove_stale_temps`` call in a folder of ``names`` finished files (a
    10,000-shard ``tokens/<ds>/``), against the scan it replaced (list the whole folder, keep
    the names with the path's temp prefix), measured here on the same folder."""
    from tokenmill.atomic import TMP_MARK, remove_stale_temps, temp_path_for, writer_alive

    folder = work / "stale-temps"
    folder.mkdir(parents=True)
    for i in range(names):
        (folder / f"part-{i:05d}_text_document.bin").touch()
    path = folder / "part-00007_text_document.bin"
    temp_path_for(path)  # the folder's .tmp/, made once as by any first write

    def whole_folder() -> None:  # the scan before temps moved into .tmp/
        prefix = f"{path.name}{TMP_MARK}"
        with os.scandir(folder) as entries:
            for e in entries:
                if e.name.startswith(prefix):
                    writer_alive(e.name[len(prefix) :])

    out: dict[str, Any] = {"names": names}

    def own_temps() -> None:
        remove_stale_temps(path)

    for key, scan, calls in (("before", whole_folder, 30), ("after", own_temps, 3000)):
        start = time.process_time()
        for _ in range(calls):
            scan()
        out[f"cpu_per_call_{key}"] = (time.process_time() - start) / calls
    return out


def report(local: dict[str, Any]) -> str:
    """The tables printed for part 1."""
    ratio = local["cpu_shard_last"] / local["cpu_shard_10"]
    lines = [
        f"shard steps (raw_jsonl + hf_dataset + tokens), median CPU over 9 shards: "
        f"#10 {local['cpu_shard_10']:.3f} s, #{local['shards']} {local['cpu_shard_last']:.3f} s "
        f"-> {ratio:.2f}x (goal <= 1.2x)",
        "",
    ]
    rows = [["step", "CPU s", "rchar MB", "files opened", "MB of files opened"]]
    for title, part in (
        ("new shard", local["added_shard"]),
        ("refresh after it", local["refresh_after_one_shard"]),
        ("first refresh", local["refresh"]),
    ):
        rows.append([f"[{title}]", "", "", "", ""])
        for step in part:
            rows.append(
                [
                    step["asset"],
                    f"{step['cpu']:.3f}",
                    f"{step['rchar'] / 1e6:.2f}",
                    str(step["files_opened"]),
                    f"{step['bytes_of_files_opened'] / 1e6:.2f}",
                ]
            )
    lines.append(table(rows))
    lines.append(f"\nthe new shard: {local['shard_bytes'] / 1e6:.3f} MB of JSONL")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--docs", type=int, default=8, help="documents per shard")
    parser.add_argument("--tokenizer", type=Path, default=ROOT / ".tokenizers" / "gpt2")
    parser.add_argument("--work", type=Path, default=OUT_DIR / "scale")
    parser.add_argument("--blend-gb", type=float, default=5.0, help="merged .bin size, GB")
    parser.add_argument("--s3-shards", type=int, default=50, help="shards on the S3 root")
    parser.add_argument(
        "--refresh-only",
        action="store_true",
        help="parts 1 and 4 only (the shard artifacts, then the refresh costs)",
    )
    parser.add_argument(
        "--no-s3-refresh",
        dest="s3_refresh",
        action="store_false",
        help="skip the virtual/physical refresh on an S3 root",
    )
    parser.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="part 4 alone, on the shard artifacts of an earlier run's --work folder",
    )
    args = parser.parse_args()
    if args.work.exists():
        import shutil

        shutil.rmtree(args.work)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.addaudithook(_audit)
    if args.reuse is not None:
        costs = refresh_cost(args.reuse / "data", args.shards, args.tokenizer, args.work)
        remote = None
        if args.s3_refresh:
            remote = refresh_cost_s3(
                args.reuse / "data", args.shards, args.tokenizer, args.work / "s3-refresh"
            )
        print("\n" + refresh_report(costs, remote))
        path = write_results("scale_refresh", {"refresh_cost": costs, "refresh_cost_s3": remote})
        print(f"\nwrote {path}")
        return
    local = local_scale(args.shards, args.docs, args.tokenizer, args.work)
    print(report(local))
    source_root = args.work / "data"
    costs = refresh_cost(source_root, args.shards, args.tokenizer, args.work)
    costs_s3 = None
    if args.s3_refresh:
        s3_work = args.work / "s3-refresh"
        costs_s3 = refresh_cost_s3(source_root, args.shards, args.tokenizer, s3_work)
    print("\n" + refresh_report(costs, costs_s3))
    if args.refresh_only:
        path = write_results(
            "scale_refresh", {"refresh_cost": costs, "refresh_cost_s3": costs_s3, "local": local}
        )
        print(f"\nwrote {path}")
        return
    big = big_blend(args.blend_gb, args.work)
    print(
        f"\nblend over a {big['bin_bytes'] / 1e9:.1f} GB merged .bin ({big['documents']:,} "
        f"documents): {big['wall']:.1f} s wall, {big['cpu']:.1f} s CPU, rchar "
        f"{big['rchar'] / 1e6:.1f} MB, {big['files_opened']} files opened, .bin opened: "
        f"{big['bin_opened'] or 'never'}"
    )
    temps = stale_temp_scan(args.work)
    print(
        f"\nstale-temp scan in a folder of {temps['names']:,} files: "
        f"{temps['cpu_per_call_after'] * 1e6:.1f} µs CPU per call (.tmp/ only), was "
        f"{temps['cpu_per_call_before'] * 1e3:.1f} ms (the whole folder)"
    )
    remote = s3_scale(args.s3_shards, args.docs, args.tokenizer, args.work / "s3")
    rows = [["S3 run", "ok", "MB down", "MB up", "index arrays put", "requests"]]
    for run in remote["runs"][:3] + remote["runs"][-2:]:
        rows.append(
            [
                str(run["what"]),
                str(run["ok"]),
                f"{run['bytes_down'] / 1e6:.3f}",
                f"{run['bytes_up'] / 1e6:.3f}",
                str(run["npy_puts"]),
                " ".join(f"{k} {v}" for k, v in sorted(run["requests"].items())),
            ]
        )
    print("\n" + table(rows))
    print(
        f"largest download of a shard run / its source: {remote['max_download_ratio']:.2f}x "
        "(goal <= 1.5x)"
    )
    ratio = local["cpu_shard_last"] / local["cpu_shard_10"]
    unchanged = remote["runs"][-1]
    rows = [
        {
            "benchmark": f"scale: {local['shards']} shards, local root",
            "measure": f"shard-step CPU of #{local['shards']} vs #10",
            "ours": f"{local['cpu_shard_last']:.3f} CPU-s",
            "baseline": f"#10: {local['cpu_shard_10']:.3f} CPU-s",
            "ratio": f"{ratio:.2f}×",
            "target": "≤ 1.2×",
            "met": ratio <= 1.2 if local["shards"] >= 100 else None,
        },
        {
            "benchmark": f"scale: {remote['shards']} shards, S3 root",
            "measure": "download of a shard run / its source; index arrays an unchanged "
            "refresh uploads",
            "ours": f"{remote['max_download_ratio']:.2f}×; {unchanged['npy_puts']} arrays",
            "baseline": "",
            "ratio": "",
            "target": "≤ 1.5×; 0",
            "met": remote["max_download_ratio"] <= 1.5 and unchanged["npy_puts"] == 0,
        },
        {
            "benchmark": f"scale: blend over {big['bin_bytes'] / 1e9:.1f} GB merged",
            "measure": "bytes read (rchar), merged .bin opened",
            "ours": f"{big['rchar'] / 1e6:.1f} MB; {'yes' if big['bin_opened'] else 'never'}",
            "baseline": f".bin {big['bin_bytes'] / 1e9:.1f} GB",
            "ratio": "",
            "target": ".bin never read",
            "met": not big["bin_opened"],
        },
        {
            "benchmark": f"scale: stale-temp scan, {temps['names']:,} names in the folder",
            "measure": "CPU per remove_stale_temps call",
            "ours": f"{temps['cpu_per_call_after'] * 1e6:.1f} µs",
            "baseline": f"whole-folder scan {temps['cpu_per_call_before'] * 1e3:.1f} ms",
            "ratio": f"{temps['cpu_per_call_before'] / temps['cpu_per_call_after']:.0f}× less",
            "target": "O(temps in flight)",
            "met": temps["cpu_per_call_after"] * 100 <= temps["cpu_per_call_before"],
        },
    ]
    for merge, semantics in MODES:
        mode = f"{merge}-{semantics}"
        part = (costs_s3 or {}).get(mode, {})
        up = f", {part['bytes_up'] / 1e6:.2f} MB up on S3" if part else ""
        physical = costs[f"physical-{semantics}"]["bytes_written"]
        saved = physical / max(1, costs[mode]["bytes_written"])
        rows.append(
            {
                "benchmark": f"scale: refresh after 1 new shard of {local['shards']}, "
                f"merge: {merge}, {semantics}",
                "measure": "bytes written (local), uploaded (S3); CPU-s",
                "ours": f"{costs[mode]['bytes_written'] / 1e6:.2f} MB{up}; "
                f"{costs[mode]['cpu']:.2f} CPU-s",
                "baseline": f"merge: physical, {semantics}" if merge == "virtual" else "",
                "ratio": f"{saved:.0f}× less" if merge == "virtual" else "",
                "target": "O(new shard + N × a small record)" if merge == "virtual" else "",
                "met": None,
            }
        )
    results = {
        "refresh_cost": costs,
        "refresh_cost_s3": costs_s3,
        "local": local,
        "big_blend": big,
        "stale_temps": temps,
        "s3": remote,
        "report_rows": rows,
    }
    path = write_results("scale", results)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
