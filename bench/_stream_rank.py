"""One rank of ``bench_stream.py``'s training job: a torch DataLoader with DataLoader workers
reading this rank's slice of each global batch, from tokenmill (``s3://`` or a local copy),
MosaicML streaming (MDS) or litdata, all over the same samples in the same order.

    python bench/_stream_rank.py TOOL SOURCE CACHE RANK WORLD STEPS BATCH WORKERS OUT.json

Writes {startup_s, seconds, tokens, digest, peak_rss_mib} to OUT.json: start-up is from before
the tool's import to the first batch, seconds and tokens those of the batches after it; the
digest (sha256 of every batch's tokens, in order) shows each tool read the same tokens.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import resource
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stand_in_torchvision() -> None:
    """mosaicml-streaming imports torchvision for its vision datasets only; the CPU torch
    here has no matching torchvision wheel, so an empty stand-in is registered (the MDS reader
    never touches it)."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        for name in ("torchvision", "torchvision.datasets", "torchvision.transforms"):
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = module
        functional = types.ModuleType("torchvision.transforms.functional")
        functional.__spec__ = importlib.machinery.ModuleSpec(functional.__name__, None)
        functional.to_tensor = None  # type: ignore[attr-defined]
        sys.modules[functional.__name__] = functional
        sys.modules["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})  # type: ignore[attr-defined]


class Anchor(Dataset):  # type: ignore[type-arg]
    """A map-style view of an anchor's dataset (made in each worker): sample ``i`` is its
    ``tokens`` bytes as uint16, read by random access in the order the batch sampler gives."""

    def __init__(self, tool: str, source: str, cache: str, size: int) -> None:
        self.tool, self.source, self.cache, self.size = tool, source, cache, size
        self.inner = self.open()  # in the rank: its DataLoader workers get a forked copy
        self.ready = tool == "mosaic"  # litdata: its reader is made in each worker

    def __len__(self) -> int:
        return self.size

    def open(self) -> Any:
        if self.tool == "mosaic":
            stand_in_torchvision()
            from streaming import StreamingDataset

            return StreamingDataset(
                remote=self.source, local=self.cache, shuffle=False, batch_size=1
            )
        import litdata.streaming.downloader as downloader
        from litdata import StreamingDataset as LitDataset

        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # obstore refuses http://
        for attempt in range(50):  # the other rank may be writing index.json into the cache
            try:
                return LitDataset(
                    self.source,
                    cache_dir=self.cache,
                    storage_options={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]},
                )
            except ValueError:
                if attempt == 49:
                    raise
                time.sleep(0.1)
        raise AssertionError("unreachable")

    def reader(self) -> None:
        """litdata's reader in this worker: random access defaults to per-item range reads,
        which return empty items against moto here, so chunks are downloaded into its cache,
        as its own iteration does it."""
        from litdata.utilities.env import _WorkerEnv

        ds = self.inner
        ds.worker_env = _WorkerEnv.detect()
        ds.cache = ds._create_cache(worker_env=ds.worker_env)
        ds.shuffler = ds._create_shuffler(ds.cache)
        ds.on_demand_bytes = False
        self.ready = True

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        if not self.ready:
            self.reader()
        rows = [np.frombuffer(self.inner[i]["tokens"], dtype=np.uint16) for i in indices]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.__getitems__([i])[0]


def rss_mib() -> float:
    """Peak RSS of this rank and of its largest DataLoader worker, added (MiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + workers) / 1024


def main() -> None:
    tool, source, cache, rank, world, steps, batch, workers, out = sys.argv[1:]
    r, w, n_steps, b, n_workers = int(rank), int(world), int(steps), int(batch), int(workers)
    start = time.perf_counter()
    version = os.environ.get("BENCH_VERSION") or None
    if tool in ("tokenmill", "local"):
        from tokenmill.loader import open_blend
        from tokenmill.loader.torch import TokenDataset

        if tool == "tokenmill":
            ds = open_blend(source, "train", version=version, cache_dir=cache)
        else:
            ds = open_blend(source, "train")
        dataset: Dataset = TokenDataset(ds)  # type: ignore[type-arg]
    else:
        dataset = Anchor(tool, source, cache, n_steps * b)
    share = b // w
    batches = [list(range(s * b + r * share, s * b + (r + 1) * share)) for s in range(n_steps)]
    loader = DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=n_workers,
        collate_fn=lambda x: x,
        multiprocessing_context="fork" if n_workers else None,
        prefetch_factor=2 if n_workers else None,
        persistent_workers=False,
    )
    digest = hashlib.sha256()
    first = 0.0
    tokens = 0
    for k, got in enumerate(loader):
        if k == 0:
            first = time.perf_counter() - start
        else:
            tokens += got.numel()  # throughput: the batches after the first
        digest.update(got.numpy().astype(np.uint16).tobytes())
    seconds = time.perf_counter() - start - first
    del loader
    result = {
        "startup_s": first,
        "seconds": seconds,
        "tokens": tokens,
        "digest": digest.hexdigest(),
        "peak_rss_mib": rss_mib(),
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
