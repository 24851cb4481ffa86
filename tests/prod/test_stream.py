"""``open_blend("s3://...")``: every sample equals the local read; the block cache's checks,
bounds, sharing between processes and crash safety (moto_server on loopback)."""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import FLAG_COMBOS
from prod_servers import S3
from servers import build_stream_root
from tiny_pairs import random_dataset

import tokenmill.formats.dataset_manifest as dataset_manifest
import tokenmill.storage.s3 as s3_helpers
import tokenmill.storage.store as store_module
from tokenmill.errors import CacheError, FormatError
from tokenmill.formats.merge import virtual_merge
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.loader import BatchSampler, _s3, _s3_data, open_blend

BLOCK = 512  # tiny blocks, so that samples straddle them
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writers record 512-byte blocks; every test starts with no cache open in the process."""
    monkeypatch.setattr(dataset_manifest, "BLOCK_BYTES", BLOCK)
    monkeypatch.setattr(_s3, "_CACHES", {})


@pytest.fixture
def blend(s3: S3, tmp_path: Path) -> tuple[Path, str]:
    """(local manifest, its s3:// URI): blend ``mix`` (megatron) uploaded to moto."""
    local = build_stream_root(tmp_path / "src", "megatron")
    s3.upload_tree(tmp_path / "src", "data/v1")
    return local, f"s3://{s3.bucket}/data/v1/blends/mix/manifest.json"


@pytest.fixture
def gets(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None]]:
    """Every GET the process's S3 clients send from now on, as (key, bytes of its range or
    None for a whole object): new clients, each with a hook on its calls."""
    seen: list[tuple[str, int | None]] = []
    make = s3_helpers.make_client

    def record(params: dict[str, object], **_: object) -> None:
        found = re.fullmatch(r"bytes=(\d+)-(\d+)", str(params.get("Range", "")))
        size = int(found[2]) - int(found[1]) + 1 if found else None
        seen.append((str(params["Key"]), size))

    def hooked(*args: object, **kwargs: object) -> object:
        client = make(*args, **kwargs)
        client.meta.events.register("provide-client-params.s3.GetObject", record)
        return client

    monkeypatch.setattr(s3_helpers, "_CLIENTS", {})
    monkeypatch.setattr(s3_helpers, "make_client", hooked)
    return seen


def one_dataset_blend(
    root: Path, shards: list[Path], *, docs: int, lengths: tuple[int, int]
) -> Path:
    """Blend ``one`` (train split only) of one dataset: the pair ``shards[0]`` alone, or a
    virtual merge of ``shards``; returns its manifest."""
    for k, prefix in enumerate(shards):
        random_dataset(prefix, docs, k, kind="tokens", lengths=lengths, counted=True)
    data = shards[0]
    if len(shards) > 1 or "merge" in shards[0].name:
        data = root / "merged" / "merge_text_document"
        virtual_merge([(f"s{k}", p) for k, p in enumerate(shards)], data)
    settings = NanosetSettings(sequence_length=64, split_spec="100,0,0", train_samples=64)
    build_blend(
        "one",
        {"web": data},
        root / "blends" / "one",
        root / "nanoset",
        BlendSettings(settings, weights={"web": 1.0}),
    )
    return root / "blends" / "one" / "manifest.json"


@pytest.fixture
def cached(blend: tuple[Path, str], tmp_path: Path) -> tuple[str, Path, str]:
    """(URI, cache folder, digest): the train split of ``blend`` streamed once into the cache,
    equal to the local read (the digest of both)."""
    local_manifest, uri = blend
    cache = tmp_path / "cache"
    want = batch_digest(open_blend(local_manifest, "train"))
    assert batch_digest(open_blend(uri, "train", cache_dir=cache)) == want
    _s3.cache_for(cache, None).drain()  # the blocks served from memory are stored after
    return uri, cache, want


def read_again(uri: str, cache: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> str:
    """The digest of the train split as a new process reads it: no cache open in memory."""
    monkeypatch.setattr(_s3, "_CACHES", {})
    return batch_digest(open_blend(uri, "train", cache_dir=cache, **kw))


def block_files(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "blocks").glob("*/*") if p.is_file())


def batch_digest(ds: object) -> str:
    everything = np.arange(len(ds))  # type: ignore[arg-type]
    return hashlib.sha256(ds.get_batch(everything).tobytes()).hexdigest()  # type: ignore[attr-defined]


@pytest.mark.parametrize("semantics", ["megatron", "nanotron", "growing"])
def test_every_sample_and_flag_equals_the_local_read(
    s3: S3, tmp_path: Path, semantics: str
) -> None:
    local_manifest = build_stream_root(tmp_path / "src", semantics)
    s3.upload_tree(tmp_path / "src", "v1")
    uri = f"s3://{s3.bucket}/v1/blends/mix/manifest.json"
    cache = tmp_path / "cache"
    for split in ("train", "valid"):
        local = open_blend(local_manifest, split)
        remote = open_blend(uri, split, cache_dir=cache)
        assert remote.version == local.version and len(remote) == len(local) > 0
        everything = np.arange(len(local))
        np.testing.assert_array_equal(remote.get_batch(everything), local.get_batch(everything))
        for k in (0, len(local) // 2, len(local) - 1):
            np.testing.assert_array_equal(remote[k], local[k])
        rng = np.random.default_rng(0)
        ids = rng.permutation(len(local))[:32]
        for flags in FLAG_COMBOS:
            got = remote.get_training_batch(ids, eod_id=0, **flags)
            want = local.get_training_batch(ids, eod_id=0, **flags)
            assert got.keys() == want.keys()
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
    # verified: every block in the cache matches the hashes the writers recorded
    assert block_files(cache)


def test_a_pinned_version_and_pickles_send_no_data(blend: tuple[Path, str], tmp_path: Path) -> None:
    local_manifest, uri = blend
    local = open_blend(local_manifest, "train")
    remote = open_blend(uri, "train", version=local.version[:16], cache_dir=tmp_path / "c")
    wire = pickle.dumps(remote)
    assert len(wire) < 64_000
    again = pickle.loads(wire)
    assert batch_digest(again) == batch_digest(local)


def test_a_mirrored_version_reopens_without_a_request_until_a_file_changes(
    cached: tuple[str, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, cache, want = cached
    version = open_blend(uri, "train", cache_dir=cache).version  # through the pointer
    made: list[str] = []
    real = s3_helpers.shared_client
    for module in (s3_helpers, store_module):  # the store imports it by name
        monkeypatch.setattr(
            module, "shared_client", lambda *a, **k: made.append("c") or real(*a, **k)
        )
    # a resumed job, same node: no S3 client at all
    assert read_again(uri, cache, monkeypatch, version=version) == want
    assert made == []
    assert not list((cache / "files").rglob("*.idx"))  # read by blocks, never mirrored
    index = next((cache / "files").rglob("*-Nanoset-train-shuffle_index.npy"))
    index.write_bytes(index.read_bytes())  # written since it was checked: mirrored again
    assert read_again(uri, cache, monkeypatch, version=version) == want
    assert made


def test_a_block_corrupted_in_the_cache_is_fetched_again(
    cached: tuple[str, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, cache, want = cached
    victim = block_files(cache)[3]
    data = bytearray(victim.read_bytes())
    data[7] ^= 0xFF
    victim.write_bytes(bytes(data))
    # a new process: blocks are checked on first use
    assert read_again(uri, cache, monkeypatch) == want
    assert victim.read_bytes() != bytes(data)


def test_a_checked_block_is_trusted_by_its_stamp_until_written_again(
    cached: tuple[str, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, cache, want = cached
    hashed: list[int] = []
    digest = _s3.block_digest
    monkeypatch.setattr(_s3, "block_digest", lambda data: hashed.append(len(data)) or digest(data))
    # a restarted job: its blocks were checked once
    assert read_again(uri, cache, monkeypatch) == want
    assert hashed == []
    victim = block_files(cache)[0]
    victim.write_bytes(victim.read_bytes())  # written again (same bytes): checked again
    assert read_again(uri, cache, monkeypatch) == want
    assert hashed == [victim.stat().st_size]


def test_missing_consecutive_blocks_come_by_one_range_get(
    blend: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_manifest, uri = blend
    ranges: list[str] = []
    make = _s3.BlockCache.client

    def counting(self: _s3.BlockCache) -> object:
        client = make(self)
        if not hasattr(client, "real_get"):  # the process's one client, wrapped once
            client.real_get = client.get_object

            def get_object(**kwargs: object) -> object:
                if str(kwargs["Key"]).endswith(".bin"):  # token blocks (the open mirrors the rest)
                    ranges.append(str(kwargs["Range"]))
                return client.real_get(**kwargs)

            client.get_object = get_object
        return client

    monkeypatch.setattr(s3_helpers, "_CLIENTS", {})  # a client of its own, wrapped for this test
    monkeypatch.setattr(_s3.BlockCache, "client", counting)
    cache = tmp_path / "cache"
    remote = open_blend(uri, "train", cache_dir=cache)
    assert batch_digest(remote) == batch_digest(open_blend(local_manifest, "train"))
    _s3.cache_for(cache, None).drain()
    stored = len(block_files(cache))  # .bin and .idx blocks
    objects = 5  # three shards, the physical merge, code: runs never join two objects
    assert len(ranges) <= stored // _s3.RUN_BLOCKS + objects
    assert _s3.cache_for(cache, None).bytes_fetched == sum(
        p.stat().st_size for p in block_files(cache)
    )


def test_an_object_corrupted_in_s3_is_refused_naming_object_and_block(
    s3: S3, blend: tuple[Path, str], tmp_path: Path
) -> None:
    _, uri = blend
    key = "data/v1/merged/code.bin"
    body = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[BLOCK + 3] ^= 0xFF  # block 1, same size
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
    ds = open_blend(uri, "train", cache_dir=tmp_path / "cache")
    with pytest.raises(CacheError, match=rf"s3://{s3.bucket}/{key}: block 1 .*refused after 2"):
        ds.get_batch(np.arange(len(ds)))


def test_the_cache_stays_under_its_bound_and_a_batch_too_big_is_a_clear_error(
    blend: tuple[Path, str], tmp_path: Path
) -> None:
    local_manifest, uri = blend
    local = open_blend(local_manifest, "train")
    cache = tmp_path / "cache"
    bound = 24 * BLOCK
    remote = open_blend(uri, "train", cache_dir=cache, cache_bytes=bound)
    for indices in BatchSampler(len(local), global_batch_size=4):
        np.testing.assert_array_equal(remote.get_batch(indices), local.get_batch(indices))
        _s3.cache_for(cache, bound).drain()  # the batch's blocks are stored
        assert sum(p.stat().st_size for p in block_files(cache)) <= bound
    with pytest.raises(CacheError, match=r"one batch needs \d+ blocks .*raise cache_bytes"):
        remote.get_batch(np.arange(len(remote)))


def test_a_full_cache_directory_is_a_clear_error(
    blend: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_manifest, uri = blend
    ds = open_blend(uri, "train", cache_dir=tmp_path / "cache")

    class Full:
        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(_s3, "create_temp", lambda path, make: (Path(str(path) + ".t"), Full()))
    want = open_blend(local_manifest, "train").get_batch([0])
    with pytest.raises(CacheError, match=r"the cache directory is full storing block \d+ of s3://"):
        for _ in range(2):  # a read is served from the checked bytes; the next one says so
            np.testing.assert_array_equal(ds.get_batch([0]), want)
            _s3.cache_for(tmp_path / "cache", None).drain()
    assert not block_files(tmp_path / "cache")


def test_prefetch_fills_the_cache_for_the_next_batches(
    blend: tuple[Path, str], tmp_path: Path
) -> None:
    _, uri = blend
    cache = tmp_path / "cache"
    ds = open_blend(uri, "train", cache_dir=cache)
    sampler = BatchSampler(len(ds), global_batch_size=8)
    ds.prefetch(np.concatenate([sampler.indices(1), sampler.indices(2)]))
    _s3.cache_for(cache, None).drain()
    fetched = _s3.cache_for(cache, None).bytes_fetched
    assert fetched > 0
    ds.get_batch(sampler.indices(1))
    ds.get_batch(sampler.indices(2))
    assert _s3.cache_for(cache, None).bytes_fetched == fetched  # nothing more to fetch


SCRIPT = """
import hashlib, sys
import numpy as np
from tokenmill.loader import open_blend
ds = open_blend(sys.argv[1], "train", cache_dir=sys.argv[2])
print(hashlib.sha256(ds.get_batch(np.arange(len(ds))).tobytes()).hexdigest())
"""


def test_two_processes_fill_one_cache(blend: tuple[Path, str], tmp_path: Path) -> None:
    local_manifest, uri = blend
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, uri, str(cache)], stdout=subprocess.PIPE, env=env
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [batch_digest(open_blend(local_manifest, "train"))] * 2


KILLED = """
import os, sys, time
import numpy as np
real = os.replace
def stuck(src, dst):
    if "/blocks/" in str(dst):
        open(sys.argv[3], "w").close()
        time.sleep(600)
    real(src, dst)
os.replace = stuck
from tokenmill.loader import open_blend
ds = open_blend(sys.argv[1], "train", cache_dir=sys.argv[2])
ds.get_batch([0])
"""


def test_a_writer_killed_mid_block_leaves_no_block(blend: tuple[Path, str], tmp_path: Path) -> None:
    local_manifest, uri = blend
    cache, flag = tmp_path / "cache", tmp_path / "writing"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED, uri, str(cache), str(flag)], env=env)
    deadline = time.monotonic() + 120
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert block_files(cache) == []  # the written temp was never renamed
    assert list(cache.rglob("*.tmp-*")), "the killed writer's temp is left behind"
    assert batch_digest(open_blend(uri, "train", cache_dir=cache)) == batch_digest(
        open_blend(local_manifest, "train")
    )
    _s3.cache_for(cache, None).drain()
    assert not [p for p in cache.rglob("*.tmp-*") if p.is_file()]  # removed when refilled


def test_a_batch_is_served_from_the_checked_bytes_while_its_blocks_are_stored(
    blend: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_manifest, uri = blend
    cache = tmp_path / "cache"
    ds = open_blend(uri, "train", cache_dir=cache)
    disk = threading.Event()
    store = _s3.BlockCache._store

    def slow(self: _s3.BlockCache, *args: Any) -> None:  # a slow disk, for the writer thread
        if threading.current_thread().name.startswith("tokenmill-s3-store"):
            assert disk.wait(60)
        store(self, *args)

    monkeypatch.setattr(_s3.BlockCache, "_store", slow)
    indices = np.arange(24)
    want = open_blend(local_manifest, "train").get_batch(indices)
    np.testing.assert_array_equal(ds.get_batch(indices), want)
    assert block_files(cache) == []  # served before any block was stored
    busy = [lock for lock in (cache / "locks").iterdir() if not free(lock)]
    assert busy  # the blocks being stored: another process waits for their files
    disk.set()
    _s3.cache_for(cache, None).drain()
    assert all(free(lock) for lock in busy)
    assert len(block_files(cache)) >= len(busy)
    assert _s3.cache_for(cache, None).bytes_fetched == sum(
        p.stat().st_size for p in block_files(cache)
    )  # each block downloaded once
    np.testing.assert_array_equal(ds.get_batch(indices), want)  # now from the stored files


def free(lock: Path) -> bool:
    """Whether another process could take this block lock now."""
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_a_forked_child_keeps_no_block_lock_of_its_parent(tmp_path: Path) -> None:
    cache = _s3.BlockCache(tmp_path, None)
    block = tmp_path / "blocks" / "ab" / "ab-00000000"
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    with cache._locked(block):  # another thread of the parent, storing it
        pid = os.fork()
        if pid == 0:  # a DataLoader worker forked meanwhile: alive until told
            os.write(ready_w, b"r")
            os.read(done_r, 1)
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"r"
        assert free(tmp_path / "locks" / block.name)  # released, though the child lives
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)


def test_torch_dataloader_workers_read_an_s3_blend(blend: tuple[Path, str], tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from tokenmill.loader.torch import TrainingDataset, packed_collate

    local_manifest, uri = blend
    local = open_blend(local_manifest, "train")
    remote = open_blend(uri, "train", cache_dir=tmp_path / "cache")
    sampler = BatchSampler(len(remote), global_batch_size=8)
    loader = torch.utils.data.DataLoader(
        TrainingDataset(remote, eod_id=0),
        batch_sampler=[list(map(int, b)) for b in sampler],
        num_workers=2,
        collate_fn=packed_collate,
        multiprocessing_context="spawn",
    )
    for indices, got in zip(sampler, loader, strict=True):
        want = local.get_training_batch(indices, eod_id=0)
        np.testing.assert_array_equal(got["input_ids"].numpy(), want["tokens"])
        np.testing.assert_array_equal(got["position_ids"].numpy(), want["position_ids"])


def test_block_hash_list_recorded_by_writers(blend: tuple[Path, str]) -> None:
    local_manifest, _ = blend
    root = local_manifest.parents[2]
    for prefix, kind in itertools.product(
        ("merged/code", "merged/phys", "tokens/docs/s0_text_document"), ("bin", "idx")
    ):
        path = dataset_manifest.dataset_manifest_path(root / prefix)
        entry = json.loads(path.read_text())["files"][f"{Path(prefix).name}.{kind}"]
        data = (root / f"{prefix}.{kind}").read_bytes()
        assert entry["block_bytes"] == BLOCK
        assert entry["block_sha256"] == [
            hashlib.sha256(data[i : i + BLOCK]).hexdigest() for i in range(0, len(data), BLOCK)
        ]


def test_the_user_guide_example_runs_against_moto(s3: S3, tmp_path: Path) -> None:
    guide = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    section = guide[guide.index("### Streaming a blend from S3") :]
    code = section[section.index("```python\n") + 10 : section.index("```\n", 10)]
    build_stream_root(tmp_path / "src", "megatron")
    s3.upload_tree(tmp_path / "src", "")
    code = code.replace("s3://tokenmill-demo/", f"s3://{s3.bucket}/")
    code = code.replace('"/tmp/tokenmill-cache"', repr(str(tmp_path / "cache")))
    scope: dict[str, object] = {}
    exec(compile(code, "user-guide.md", "exec"), scope)
    local = open_blend(tmp_path / "src" / "blends" / "mix" / "manifest.json", "train")
    last = scope["sampler"].indices(scope["step"])  # type: ignore[attr-defined]
    np.testing.assert_array_equal(scope["tokens"], local.get_batch(last))
    assert scope["version"] == local.version


def test_a_dataset_written_before_block_hashes_streams_unverified(s3: S3, tmp_path: Path) -> None:
    local_manifest = build_stream_root(tmp_path / "src", "megatron")
    for prefix in ("merged/code", "merged/phys"):  # their manifests as older writers left them
        path = dataset_manifest.dataset_manifest_path(tmp_path / "src" / prefix)
        manifest = json.loads(path.read_text())
        for info in manifest["files"].values():
            info.pop("block_bytes", None)
            info.pop("block_sha256", None)
        path.write_text(json.dumps(manifest))
    s3.upload_tree(tmp_path / "src", "old")
    uri = f"s3://{s3.bucket}/old/blends/mix/manifest.json"
    remote = open_blend(uri, "train", cache_dir=tmp_path / "cache")
    parts = {ds.name: ds.data.files for ds in remote.datasets.values()}  # type: ignore[attr-defined]
    assert [f.block_sha256 for f in parts["code"]] == [()]
    assert all(f.verified for f in parts["docs"])  # the virtual merge's shards: verified
    assert batch_digest(remote) == batch_digest(open_blend(local_manifest, "train"))
    key = "old/merged/code.idx"  # unverified: its header is still checked against the counts
    idx = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    idx[17] = 4  # int32, where the manifests record uint16
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(idx))
    fresh = open_blend(uri, "train", cache_dir=tmp_path / "fresh")
    with pytest.raises(FormatError, match=rf"s3://{s3.bucket}/{key}: dtype code: found 4"):
        fresh.get_batch(np.arange(len(fresh)))


def test_a_shards_block_list_comes_by_reference_once_and_checked(
    s3: S3, blend: tuple[Path, str], tmp_path: Path
) -> None:
    local, uri = blend
    cache = tmp_path / "cache"
    ds = open_blend(uri, "train", cache_dir=cache)
    assert batch_digest(ds) == batch_digest(open_blend(local, "train"))
    lists = sorted(p for p in (cache / "blocklists").glob("*/*") if p.is_file())
    assert len(lists) == 6  # a .bin's and an .idx's per shard of the virtual merge docs
    key = "data/v1/tokens/docs/manifests/s1_text_document.manifest.json"
    manifest = json.loads(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    manifest["files"]["s1_text_document.bin"]["block_sha256"][0] = "0" * 64
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=json.dumps(manifest).encode())
    fresh = open_blend(uri, "train", cache_dir=tmp_path / "fresh")
    with pytest.raises(CacheError, match=rf"s3://{s3.bucket}/{key}: its block list .* not the"):
        fresh.get_batch(np.arange(len(fresh)))


def test_an_idx_is_read_by_the_blocks_a_batch_needs(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gets: list[tuple[str, int | None]]
) -> None:
    monkeypatch.setattr(dataset_manifest, "BLOCK_BYTES", 1024)
    src = tmp_path / "src"
    local_manifest = one_dataset_blend(
        src, [src / "tokens" / "big_text_document"], docs=100_000, lengths=(5, 60)
    )
    s3.upload_tree(src, "v1")
    idx_size = (src / "tokens" / "big_text_document.idx").stat().st_size
    local = open_blend(local_manifest, "train")
    remote = open_blend(
        f"s3://{s3.bucket}/v1/blends/one/manifest.json", "train", cache_dir=tmp_path / "c"
    )
    assert not [key for key, _ in gets if key.endswith(".idx")]  # the open reads no index
    batch = BatchSampler(len(local), global_batch_size=8).indices(0)
    np.testing.assert_array_equal(remote.get_batch(batch), local.get_batch(batch))
    for k in (1, len(local) - 1):
        np.testing.assert_array_equal(remote[k], local[k])
    fetched = sum(n or 0 for key, n in gets if key.endswith(".idx"))
    assert idx_size > 2_000_000
    assert 0 < fetched < idx_size // 20  # header and the blocks of the batch's sequences


@pytest.mark.parametrize("shards", [1, 50])
def test_the_open_sends_as_many_requests_for_50_shards_as_for_1(
    s3: S3, tmp_path: Path, gets: list[tuple[str, int | None]], shards: int
) -> None:
    src = tmp_path / "src"
    prefixes = [src / "tokens" / f"s{k}_text_document" for k in range(shards)]
    if shards == 1:
        prefixes = [src / "tokens" / "merge_one_text_document"]
    local_manifest = one_dataset_blend(src, prefixes, docs=400 // shards, lengths=(5, 60))
    s3.upload_tree(src, "v1")
    uri = f"s3://{s3.bucket}/v1/blends/one/manifest.json"
    remote = open_blend(uri, "train", cache_dir=tmp_path / "cache")
    opened = list(gets)
    # the pointer, its version's manifest, the merge's manifest, 2 blend arrays, the index's
    # description and 3 arrays: nothing per shard
    assert len(opened) == 9
    assert not [key for key, _ in opened if key.endswith((".bin", ".idx"))]
    local = open_blend(local_manifest, "train")
    everything = np.arange(len(local))
    np.testing.assert_array_equal(remote.get_batch(everything), local.get_batch(everything))
    manifests = [key for key, _ in gets[len(opened) :] if key.endswith(".manifest.json")]
    assert len(manifests) == len(set(manifests)) <= shards  # block lists: one GET per shard


def test_a_first_batch_over_50_shards_gets_each_file_once_token_blocks_with_the_index(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gets: list[tuple[str, int | None]]
) -> None:
    """Shards whose files are one block each: the first batch GETs each touched shard's
    ``.idx`` and ``.bin`` once, whole, and the token blocks go out with the index reads (they
    need no pointer), not after them."""
    monkeypatch.setattr(dataset_manifest, "BLOCK_BYTES", 1 << 20)
    src = tmp_path / "src"
    prefixes = [src / "tokens" / f"s{k}_text_document" for k in range(50)]
    local_manifest = one_dataset_blend(src, prefixes, docs=8, lengths=(5, 60))
    s3.upload_tree(src, "v1")
    uri = f"s3://{s3.bucket}/v1/blends/one/manifest.json"
    remote = open_blend(uri, "train", cache_dir=tmp_path / "cache")
    opened = len(gets)
    local = open_blend(local_manifest, "train")
    batch = BatchSampler(len(local), global_batch_size=16).indices(0)
    np.testing.assert_array_equal(remote.get_batch(batch), local.get_batch(batch))
    sent = gets[opened:]
    shards = {key.rsplit(".", 1)[0] for key, _ in sent}
    sizes = {key: (src / key.removeprefix("v1/")).stat().st_size for key, _ in sent}
    assert len(shards) > 1 and sorted(sent) == sorted(
        (f"{shard}.{ext}", sizes[f"{shard}.{ext}"]) for shard in shards for ext in ("bin", "idx")
    )
    kinds = [key.rsplit(".", 1)[1] for key, _ in sent]
    assert kinds.index("bin") < len(kinds) - 1 - kinds[::-1].index("idx")


@pytest.mark.parametrize(("shards", "held"), [(1, 1), (3, 3), (3, 2)])
def test_a_one_block_idx_is_indexed_in_place_once_cached(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int, held: int
) -> None:
    """Once a part's one-block ``.idx`` is a file in the cache, later batches index its mapped
    block as a memmap would (no byte ranges gathered): the same samples as the local read, for
    a pair and a virtual merge, while the ``.bin`` files still span blocks; at most ``held``
    (OPEN_BLOCKS) parts keep their block mapped."""
    monkeypatch.setattr(dataset_manifest, "BLOCK_BYTES", 1 << 16)
    monkeypatch.setattr(_s3_data, "OPEN_BLOCKS", held)
    src = tmp_path / "src"
    prefixes = [src / "tokens" / f"s{k}_text_document" for k in range(shards)]
    if shards == 1:
        prefixes = [src / "tokens" / "one_text_document"]
    local_manifest = one_dataset_blend(src, prefixes, docs=300, lengths=(5, 600))
    assert all(p.with_suffix(".bin").stat().st_size > 2 << 16 for p in prefixes)
    assert all(p.with_suffix(".idx").stat().st_size < 1 << 16 for p in prefixes)
    s3.upload_tree(src, "v1")
    cache = tmp_path / "cache"
    remote = open_blend(f"s3://{s3.bucket}/v1/blends/one/manifest.json", "train", cache_dir=cache)
    local = open_blend(local_manifest, "train")
    (data,) = [ds.data for ds in remote.datasets.values()]  # type: ignore[attr-defined]
    sampler = BatchSampler(len(local), global_batch_size=8)
    for _ in range(2):
        for step in range(len(local) // 8):
            batch = sampler.indices(step)
            np.testing.assert_array_equal(remote.get_batch(batch), local.get_batch(batch))
            _s3.cache_for(cache, None).drain()  # the blocks served from memory are stored
        for k in (0, len(local) - 1):
            np.testing.assert_array_equal(remote[k], local[k])
    assert len(data._tables) == held  # parts read in place, the last ones used kept
    assert set(data._tables) <= set(range(shards))
