"""A blend read straight from S3 (``open_blend("s3://...")``): small files fetched whole and
checked by sha256, token files read by fixed-size blocks through a node-local block cache.

The cache (``cache_dir``) is shared by every process on the node: a block is downloaded once
(an ``flock`` per block), checked against the per-block sha256 list its dataset manifest
records, written to a temp, fsynced and renamed (a reader never sees a partial block; a
killed writer leaves only a temp), and evicted oldest-first (mtime, refreshed on use) when
``cache_bytes`` would be exceeded. boto3 is imported only here, lazily, through
``tokenmill.storage.s3.make_client`` (endpoint and credentials from the AWS environment).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import create_temp, fsync_dir, remove_stale_temps, write_bytes
from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats.dataset_manifest import (
    BLOCK_BYTES,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDataset, data_file_path
from tokenmill.formats.virtual_merge import VirtualDataset

CACHE_ENV = "TOKENMILL_CACHE_DIR"
OPEN_BLOCKS = 64  # cached blocks a process keeps memory-mapped (address space, not RSS)
FETCH_THREADS = 8  # parallel range GETs for one batch or one prefetch
GET_ATTEMPTS = 2  # a block that fails its check is fetched once more, then refused


@dataclass(frozen=True)
class RemoteFile:
    """One token file in S3 and what its blocks must hash to (``()``: unverified, an artifact
    written before per-block hashes)."""

    bucket: str
    key: str
    size: int
    block_bytes: int
    block_sha256: tuple[str, ...]

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def span(self, i: int) -> tuple[int, int]:
        """Byte range [lo, hi) of block ``i``."""
        lo = i * self.block_bytes
        return lo, min(self.size, lo + self.block_bytes)


class BlockCache:
    """The node-local cache of token-file blocks under ``root`` (one per process and root)."""

    def __init__(self, root: Path, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ConfigError(f"cache_bytes must be a positive number of bytes, got {capacity}")
        self.root = Path(root)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._bases: dict[tuple[str, str, int], str] = {}
        self._checked: set[str] = set()  # block files this process hashed
        self._client: Any = None
        self._pid = 0
        self._used: int | None = None  # bytes of blocks, stored or reserved (capacity set)
        self._inflight = 0  # reserved for blocks being written by this process
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self.bytes_fetched = 0  # what this process downloaded (bench, tests)

    def client(self) -> Any:
        """One boto3 client per process (a forked worker makes its own), made on first GET."""
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                from tokenmill.storage.s3 import make_client

                self._client = make_client(None, max_pool_connections=FETCH_THREADS + 2)
                self._pid = os.getpid()
            return self._client

    def pool(self) -> ThreadPoolExecutor:
        """The fetch threads of this process (a forked worker makes its own)."""
        with self._lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="tokenmill-s3")
                self._pool_pid = os.getpid()
            return self._pool

    def _name(self, f: RemoteFile, i: int) -> str:
        """The block's file: ``blocks/<h[:2]>/<h>-<i>``, ``h`` a hash of the object's URI and
        size (string work only: this runs per piece read)."""
        where = (f.bucket, f.key, f.size)
        base = self._bases.get(where)
        if base is None:
            name = hashlib.sha256(f"{f.uri}\0{f.size}".encode()).hexdigest()[:32]
            base = self._bases[where] = os.path.join(self.root, "blocks", name[:2], name)
        return f"{base}-{i:08d}"

    def block(self, f: RemoteFile, i: int) -> mmap.mmap:
        """Block ``i`` of ``f``, checked, from the cache (fetched first when absent)."""
        key = self._name(f, i)
        with self._lock:
            found = self._maps.get(key)
            if found is not None:
                self._maps.move_to_end(key)
                return found
        path = Path(key)
        view = self._open_checked(f, i, path)
        for _ in range(GET_ATTEMPTS):  # evicted by another process in between: fill again
            if view is not None:
                break
            self._fill(f, i, path)
            view = self._open_checked(f, i, path)
        if view is None:
            raise CacheError(
                f"{f.uri}: block {i} at {path} is gone or fails its check right after it was "
                "stored: the cache is too small for the processes sharing it, or something "
                "else changes the cache directory"
            )
        with self._lock:
            self._maps[key] = view
            while len(self._maps) > OPEN_BLOCKS:  # unmapped once no thread holds it
                self._maps.popitem(last=False)
        return view

    def _open_checked(self, f: RemoteFile, i: int, path: Path) -> mmap.mmap | None:
        """The cached block mapped, or None when absent, short or not matching its hash (then
        it is removed: the caller fetches it again)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            lo, hi = f.span(i)
            if os.fstat(fd).st_size != hi - lo:
                view = None
            else:
                view = mmap.mmap(fd, hi - lo, prot=mmap.PROT_READ)
                os.utime(fd)  # the eviction order: least recently used first
        finally:
            os.close(fd)
        if view is not None and f.block_sha256 and str(path) not in self._checked:
            if hashlib.sha256(view).hexdigest() != f.block_sha256[i]:
                view.close()
                view = None
            else:
                self._checked.add(str(path))
        if view is None:
            path.unlink(missing_ok=True)
        return view

    def _fill(self, f: RemoteFile, i: int, path: Path) -> None:
        """Download block ``i`` once on this node (the lock file serializes the processes and
        threads that want it), check it, store it crash-safely."""
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(locks / path.name, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            if path.is_file():  # another process stored it meanwhile (checked by the caller)
                return
            data = self._get(f, i)
            self._make_room(len(data), f, i)
            remove_stale_temps(path)  # of killed writers: never renamed, never read
            tmp: Path | None = None
            try:
                tmp, fh = create_temp(path, lambda t: open(t, "wb"))  # noqa: SIM115 - closed below
                with fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
                fsync_dir(path.parent)
            except OSError as exc:
                self._release(len(data), stored=False)
                if tmp is not None:
                    tmp.unlink(missing_ok=True)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise CacheError(
                        f"{self.root}: the cache directory is full storing block {i} of "
                        f"{f.uri}: free space there or lower cache_bytes"
                    ) from exc
                raise
            self._release(len(data), stored=True)
            with self._lock:
                self._checked.add(str(path))

    def _get(self, f: RemoteFile, i: int) -> bytes:
        """Block ``i`` by a range GET, checked (size, and sha256 when recorded), fetched once
        more when it fails; CacheError naming the object and block after that."""
        from tokenmill.storage.s3 import BODY_ATTEMPTS, is_cut_body, s3_errors

        lo, hi = f.span(i)
        why = ""
        for _ in range(GET_ATTEMPTS):
            with s3_errors(f"reading block {i} (bytes {lo}..{hi}) of {f.uri}"):
                for attempt in range(1, BODY_ATTEMPTS + 1):
                    resp = self.client().get_object(
                        Bucket=f.bucket, Key=f.key, Range=f"bytes={lo}-{hi - 1}"
                    )
                    try:
                        data = bytes(resp["Body"].read())
                        break
                    except Exception as exc:
                        if attempt == BODY_ATTEMPTS or not is_cut_body(exc):
                            raise
                    finally:
                        resp["Body"].close()
            self.bytes_fetched += len(data)
            if len(data) != hi - lo:
                why = f"{len(data)} bytes, expected {hi - lo}"
            elif f.block_sha256 and hashlib.sha256(data).hexdigest() != f.block_sha256[i]:
                why = "sha256 differs from the dataset manifest's block list"
            else:
                return data
        raise CacheError(
            f"{f.uri}: block {i} (bytes {lo}..{hi}) refused after {GET_ATTEMPTS} fetches: {why}"
        )

    def _release(self, size: int, *, stored: bool) -> None:
        """End a reservation of ``_make_room`` (given back when its block was not stored)."""
        if self.capacity is None:
            return
        with self._lock:
            self._inflight -= size
            if not stored and self._used is not None:
                self._used -= size

    def _make_room(self, size: int, f: RemoteFile, i: int) -> None:
        """Evict least recently used blocks until ``size`` more bytes fit under capacity, and
        reserve them (threads filling blocks at once never overshoot together)."""
        if self.capacity is None:
            return
        if size > self.capacity:
            raise CacheError(
                f"cache_bytes={self.capacity} cannot hold block {i} of {f.uri} ({size} bytes)"
            )
        with self._lock:
            if self._used is not None and self._used + size <= self.capacity:
                self._used += size
                self._inflight += size
                return
            blocks = []
            for entry in (self.root / "blocks").glob("*/*"):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.is_file():
                    blocks.append((st.st_mtime, st.st_size, entry))
            used = sum(b[1] for b in blocks)
            for _, nbytes, entry in sorted(blocks):
                if used + self._inflight + size <= self.capacity:
                    break
                entry.unlink(missing_ok=True)  # a process reading it keeps its mapping
                self._checked.discard(str(entry))
                used -= nbytes
            self._used = used + self._inflight + size
            self._inflight += size

    def ensure(self, wanted: list[tuple[RemoteFile, int]]) -> None:
        """Make every (file, block) present, fetching the missing ones in parallel; CacheError
        when they cannot all be held at once (one batch larger than ``cache_bytes``)."""
        need = sum(f.span(i)[1] - f.span(i)[0] for f, i in wanted)
        if self.capacity is not None and need > self.capacity:
            raise CacheError(
                f"one batch needs {len(wanted)} blocks ({need} bytes), more than "
                f"cache_bytes={self.capacity} at {self.root}: raise cache_bytes"
            )
        missing = [(f, i) for f, i in wanted if not os.path.isfile(self._name(f, i))]
        if len(missing) > 1:
            list(self.pool().map(lambda fi: self.block(*fi), missing))
        elif missing:
            self.block(*missing[0])

    def prefetch(self, wanted: list[tuple[RemoteFile, int]]) -> None:
        """Fetch these blocks in the background (errors surface when the batch is read)."""
        missing = [(f, i) for f, i in wanted if not os.path.isfile(self._name(f, i))]
        if missing:
            pool = self.pool()
            for f, i in missing:
                pool.submit(self._quiet_block, f, i)

    def _quiet_block(self, f: RemoteFile, i: int) -> None:
        """A background fetch: a failure is left for the read that needs the block, which
        fetches it again and raises there."""
        try:
            self.block(f, i)
        except (CacheError, OSError):  # the foreground read retries and reports it
            return
        except Exception as exc:  # botocore errors: same, reported by the foreground read
            if type(exc).__module__.split(".")[0] not in ("botocore", "tokenmill"):
                raise


_CACHES: dict[tuple[str, int | None], BlockCache] = {}


def cache_for(root: str | os.PathLike[str], capacity: int | None) -> BlockCache:
    """The process's BlockCache for ``root`` (shared by every dataset read through it)."""
    key = (str(Path(root).resolve()), capacity)
    found = _CACHES.get(key)
    if found is None:
        found = _CACHES[key] = BlockCache(Path(key[0]), capacity)
    return found


class RemoteView:
    """The bytes of one token file, sliced as ``view[lo:hi]`` -> bytes through the cache."""

    def __init__(self, cache: BlockCache, f: RemoteFile) -> None:
        self.cache, self.f = cache, f
        self._last: tuple[int, mmap.mmap] | None = None  # the block the last slice read

    def _block(self, i: int) -> mmap.mmap:
        last = self._last
        if last is not None and last[0] == i:
            return last[1]
        view = self.cache.block(self.f, i)
        self._last = (i, view)
        return view

    def __len__(self) -> int:
        return self.f.size

    def __getitem__(self, where: slice) -> bytes:
        lo, hi, _ = where.indices(self.f.size)
        if hi <= lo:
            return b""
        size = self.f.block_bytes
        first, last = lo // size, (hi - 1) // size
        if first == last:
            return self._block(first)[lo - first * size : hi - first * size]
        out = []
        for i in range(first, last + 1):
            base = i * size
            out.append(self._block(i)[max(lo, base) - base : min(hi, base + size) - base])
        return b"".join(out)


class RemoteData:
    """A dataset whose index is local (fetched whole into the cache) and whose token files are
    read through the block cache; the reading surface of ``IndexedDataset``."""

    remote = True

    def __init__(
        self, data: IndexedDataset | VirtualDataset, files: list[RemoteFile], cache: BlockCache
    ) -> None:
        if len(files) != data.num_parts:
            raise FormatError(
                data.idx_path, "files", f"{len(files)} token files, expected {data.num_parts}"
            )
        self.data, self.files, self.cache = data, files, cache
        self.prefix, self.dtype, self.idx_path = data.prefix, data.dtype, data.idx_path
        self.num_parts = data.num_parts
        self.num_tokens = data.num_tokens
        self.masked = getattr(data, "masked", np.zeros(0, dtype=np.int64))  # taken down
        total = sum(f.size for f in files)
        if total != data.num_tokens * data.dtype.itemsize:
            raise FormatError(
                files[0].uri,
                "size",
                f"the index says {data.num_tokens} tokens x {data.dtype.itemsize} B, the "
                f"manifests record {total} bytes",
            )

    def __len__(self) -> int:
        return len(self.data)

    @property
    def num_documents(self) -> int:
        return self.data.num_documents

    def lengths_of(self, seq: np.ndarray) -> np.ndarray:
        return self.data.lengths_of(seq)

    def locate(self, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.data.locate(seq)

    def buffer(self, part: int) -> RemoteView:  # type: ignore[override]
        return RemoteView(self.cache, self.files[part])

    def check_pointers(self) -> None:
        """The index's full check (the lengths against the recorded token counts)."""
        self.data.check_pointers()

    def _blocks(
        self, parts: np.ndarray, starts: np.ndarray, stops: np.ndarray
    ) -> list[tuple[RemoteFile, int]]:
        """The distinct (file, block) the byte ranges touch, in order."""
        out: dict[tuple[int, int], None] = {}
        keep = stops > starts
        for p, lo, hi in zip(
            parts[keep].tolist(), starts[keep].tolist(), stops[keep].tolist(), strict=True
        ):
            size = self.files[p].block_bytes
            for i in range(lo // size, (hi - 1) // size + 1):
                out[(p, i)] = None
        return [(self.files[p], i) for p, i in out]

    def ensure(self, parts: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> None:
        """Fetch what one batch's byte ranges need before it is read (parallel range GETs)."""
        self.cache.ensure(self._blocks(parts, starts, stops))

    def prefetch(self, parts: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> None:
        """Fetch what future batches' byte ranges need, in the background."""
        self.cache.prefetch(self._blocks(parts, starts, stops))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the local prefix, where each token file lives and the cache settings: no
        data, no hash list (the receiver reads those from the dataset manifest in the cache)."""
        where = [(f.bucket, f.key, f.size) for f in self.files]
        return (
            _reopen_remote,
            (str(self.prefix), where, str(self.cache.root), self.cache.capacity),
        )


def _reopen_remote(
    prefix: str, where: list[tuple[str, str, int]], root: str, capacity: int | None
) -> RemoteData:
    """Inverse of ``RemoteData.__reduce__`` (a DataLoader worker on the same node): the block
    records are read again from the dataset manifest in the cache."""
    entries = _bin_entries(Path(prefix))
    if len(entries) != len(where):
        raise FormatError(
            prefix, "files", f"{len(entries)} token files, the sender had {len(where)}"
        )
    files = [
        _record(Path(prefix), RemoteFile(b, k, n, BLOCK_BYTES, ()), info)
        for (b, k, n), (_, info) in zip(where, entries, strict=True)
    ]
    return RemoteData(open_dataset(prefix, index_only=True), files, cache_for(root, capacity))


def default_cache_dir() -> Path:
    """``$TOKENMILL_CACHE_DIR``, else ``~/.cache/tokenmill/s3``."""
    found = os.environ.get(CACHE_ENV)
    return Path(found) if found else Path.home() / ".cache" / "tokenmill" / "s3"


def mirror_blend(
    uri: str, version: str | None, cache_dir: str | os.PathLike[str] | None
) -> tuple[Path, Path, dict[Path, RemoteFile]]:
    """Fetch a blend's manifest and small files (index descriptions and arrays, dataset
    manifests, ``.idx``) into ``<cache_dir>/files/<bucket>/...``, each checked by its sha256
    (re-hashed on every open: they are small), and describe its token files.

    Returns the cache root, the local blend manifest and ``{local .bin path: RemoteFile}``.
    """
    from tokenmill.storage.pull import plan_blend, sync_file

    root_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    source, raw, plan = plan_blend(uri, version=version)
    bucket = str(getattr(source, "bucket", ""))
    base = ""
    for want in plan.wanted:
        base = want.key[: len(want.key) - len(want.rel)]
        break
    mirror = root_dir / "files" / bucket / base
    remote: dict[Path, Any] = {}
    for want in plan.wanted:
        if want.rel.endswith(".bin"):
            remote[(mirror / want.rel).resolve()] = want
        else:
            sync_file(source, want, mirror)
    for rel, data in plan.dataset_manifests.items():
        path = mirror / rel
        if not (path.is_file() and path.read_bytes() == data):
            write_bytes(path, data)
    if plan.version_manifest is not None:
        path = mirror / plan.version_manifest[0]
        if not (path.is_file() and path.read_bytes() == plan.version_manifest[1]):
            write_bytes(path, plan.version_manifest[1])
    mpath = mirror / plan.manifest_rel
    if not (mpath.is_file() and mpath.read_bytes() == raw):
        write_bytes(mpath, raw)
    return (
        root_dir,
        mpath,
        {p: RemoteFile(bucket, w.key, w.size, BLOCK_BYTES, ()) for p, w in remote.items()},
    )


def _bin_entries(prefix: Path) -> list[tuple[Path, dict[str, Any]]]:
    """(local ``.bin`` path, its manifest record) of each part of the dataset at ``prefix``."""
    manifest = read_dataset_manifest(prefix)
    if "shards" in manifest:
        return [
            (data_file_path(os.path.normpath(prefix.parent / str(s["prefix"]))), s["files"]["bin"])
            for s in manifest["shards"]
        ]
    path = data_file_path(prefix)
    return [(path, manifest["files"][path.name])]


def _record(prefix: Path, found: RemoteFile, info: dict[str, Any]) -> RemoteFile:
    """``found`` with the block size and per-block hashes of its manifest record."""
    hashes = tuple(str(h) for h in info.get("block_sha256", ()))
    size = int(info.get("block_bytes", BLOCK_BYTES))
    if size < 1 or (hashes and len(hashes) != -(-found.size // size)):
        raise FormatError(
            prefix, "files.block_sha256", f"{len(hashes)} hashes of {size} B for {found.size} B"
        )
    return RemoteFile(found.bucket, found.key, found.size, size, hashes)


def remote_files(prefix: Path, bins: dict[Path, RemoteFile]) -> list[RemoteFile]:
    """The token files of the dataset at (local) ``prefix``, one per part, with the per-block
    hashes its dataset manifest records (a virtual merge: each shard's record)."""
    out = []
    for path, info in _bin_entries(prefix):
        found = bins.get(Path(path).resolve())
        if found is None:
            raise FormatError(prefix, "files", f"{path.name} is not among the blend's files")
        out.append(_record(prefix, found, info))
    return out
