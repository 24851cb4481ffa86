"""The S3 reader's node-local block cache; over 400 lines: its fetch, check, store, eviction.

A blend read from S3 reads its ``.bin`` and ``.idx`` by fixed-size blocks through this cache
(the datasets over it: ``_s3_data``; the small files: ``_s3_open``), shared by every process on
the node. A block is downloaded once (an ``flock`` per block; runs of blocks by one range GET),
checked against the sha256 its dataset manifest records, stored crash-safely (temp, fsync,
rename), stamped checked (later processes map it without hashing until it is written again)
and evicted least recently used first beyond ``cache_bytes``. boto3 comes lazily, only here,
through ``tokenmill.storage.s3.shared_client``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import posixpath
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.atomic import create_temp, load_json, remove_stale_temps, write_bytes
from tokenmill.errors import CacheError, ConfigError, InputError
from tokenmill.formats.dataset_manifest import DATASET_MANIFEST_SUFFIX, DATASET_MANIFESTS
from tokenmill.formats.virtual_merge import block_list_digest

OPEN_BLOCKS = 64  # cached blocks a process keeps memory-mapped (address space, not RSS)
FETCH_THREADS = 8  # parallel range GETs for one batch or one prefetch
GET_ATTEMPTS = 2  # a block that fails its check is fetched once more, then refused
STORE_THREADS = 4  # blocks a batch was served from memory, written at once (others wait on them)
RUN_BLOCKS = 8  # consecutive missing blocks of one object fetched by one range GET


Fresh = tuple[str, memoryview]  # a block served from memory (its file), being stored


def block_digest(data: bytes | mmap.mmap) -> str:
    """The sha256 a block is checked against (hashlib releases the GIL while it hashes)."""
    return hashlib.sha256(data).hexdigest()


def _stamp_of(st: os.stat_result) -> bytes:
    """What a block's stamp records: its file's inode, size and mtime."""
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns}".encode()


@dataclass(frozen=True)
class RemoteFile:
    """One ``.bin`` or ``.idx`` in S3 and what its blocks must hash to: ``block_sha256``
    inline, or the digest (``block_list``) of a list its dataset manifest holds; neither:
    unverified. ``sha256``: the whole file's, when recorded."""

    bucket: str
    key: str
    size: int
    block_bytes: int
    block_sha256: tuple[str, ...]
    block_list: str = ""  # block_list_digest of the list in the dataset manifest
    sha256: str = ""

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def verified(self) -> bool:
        """Whether its blocks are checked against recorded hashes."""
        return bool(self.block_sha256 or self.block_list)

    @property
    def manifest_key(self) -> str:
        """The key of the dataset manifest of the pair this file belongs to."""
        folder, name = posixpath.split(self.key)
        name = posixpath.splitext(name)[0] + DATASET_MANIFEST_SUFFIX
        return posixpath.join(folder, DATASET_MANIFESTS, name)

    @property
    def blocks(self) -> int:
        """How many blocks the file has."""
        return -(-self.size // self.block_bytes)

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
        self._maps: OrderedDict[str, memoryview] = OrderedDict()
        self._bases: dict[tuple[str, str, int], str] = {}
        self._checked: set[str] = set()  # block files this process hashed
        self._lists: dict[str, tuple[str, ...]] = {}  # block lists fetched by reference
        self._owned: dict[str, tuple[int, Any]] = {}  # per process: client, pools (see _own)
        self._used: int | None = None  # bytes of blocks, stored or reserved (capacity set)
        self._inflight = 0  # reserved for blocks being written by this process
        self._jobs: list[Future[None]] = []  # background jobs not known to have ended
        self._failed: Exception | None = None  # a store after the batch failed (raised next)
        self.bytes_fetched = 0  # what this process downloaded (bench, tests)

    def _own(self, name: str, make: Callable[[], Any]) -> Any:
        """This process's ``name`` (client, thread pool), made on first use: a forked worker
        makes its own."""
        with self._lock:
            pid, found = self._owned.get(name, (0, None))
            if found is None or pid != os.getpid():
                found = make()
                self._owned[name] = (os.getpid(), found)
            return found

    def client(self) -> Any:
        """One boto3 client per process, made on first GET."""
        from tokenmill.storage.s3 import shared_client

        return self._own(
            "client", lambda: shared_client(None, max_pool_connections=FETCH_THREADS + 2)
        )

    def pool(self) -> ThreadPoolExecutor:
        """The fetch threads of this process."""
        return self._own("pool", lambda: ThreadPoolExecutor(FETCH_THREADS, "tokenmill-s3"))

    def later(self, work: Callable[[], object]) -> None:
        """Run ``work`` (e.g. reading the index blocks a prefetch needs) in the background on
        this process's planning thread, not a fetch thread: it may wait on them."""
        self._submit(self._own("planner", lambda: ThreadPoolExecutor(1, "tokenmill-s3-plan")), work)

    def _submit(self, pool: ThreadPoolExecutor, work: Callable[..., object], *args: Any) -> None:
        """Run ``work(*args)`` on ``pool`` in the background (``_quiet``), kept until it ends
        (``drain`` waits for those still running)."""
        job = pool.submit(self._quiet, work, *args)
        with self._lock:
            self._jobs = [j for j in self._jobs if not j.done()]
            self._jobs.append(job)

    def drain(self) -> None:
        """Wait until the background work (prefetches) submitted so far, and the fetches it
        started, have ended."""
        while True:
            with self._lock:
                jobs = [j for j in self._jobs if not j.done()]
            if not jobs:
                return
            wait(jobs)

    def hashes(self, f: RemoteFile) -> tuple[str, ...]:
        """``f``'s per-block sha256 list (``()``: none recorded): inline; by reference, a
        one-block file's sha256, else ``blocklists/<digest>``, fetched once per node from its
        dataset manifest (one GET for the ``.bin``'s and the ``.idx``'s)."""
        if f.block_sha256 or not f.block_list:
            return f.block_sha256
        found = self._lists.get(f.block_list)
        one = f.blocks == 1 and f.sha256
        if found is None and one and block_list_digest([f.sha256]) == f.block_list:
            found = (f.sha256,)
        if found is None:
            found = self._cached_list(f.block_list)
        if found is None:
            with self._locked(self._list_path(block_list_digest([f.manifest_key]))):
                found = self._cached_list(f.block_list)
                if found is None:
                    found = self._fetch_list(f)
        self._lists[f.block_list] = found
        if len(found) != f.blocks:
            raise CacheError(
                f"{f.uri}: its block list has {len(found)} hashes of {f.block_bytes} B for "
                f"{f.size} B"
            )
        return found

    def _list_path(self, digest: str) -> Path:
        """Where the block list of this digest is kept: ``blocklists/<d[:2]>/<d>``."""
        return self.root / "blocklists" / digest[:2] / digest

    def _cached_list(self, digest: str) -> tuple[str, ...] | None:
        """The block list of ``digest`` stored in the cache, when it is there and intact."""
        try:
            text = self._list_path(digest).read_bytes().decode()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        found = tuple(text.split("\n")) if text else ()
        return found if block_list_digest(found) == digest else None

    def _fetch_list(self, f: RemoteFile) -> tuple[str, ...]:
        """``f``'s block list from its dataset manifest (one GET; every list there is stored by
        its digest); CacheError naming the manifest when it is not the digest recorded."""
        from tokenmill.storage.s3 import read_object

        uri = f"s3://{f.bucket}/{f.manifest_key}"
        raw = read_object(self.client(), f.bucket, f.manifest_key)
        if raw is None:
            raise CacheError(f"{uri}: missing; it holds the block list of {f.uri}")
        try:
            files = load_json(raw, uri, "manifest")["files"]
            lists = {
                name: (int(info["block_bytes"]), tuple(str(h) for h in info["block_sha256"]))
                for name, info in files.items()
                if "block_sha256" in info
            }
            size, found = lists[posixpath.basename(f.key)]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CacheError(f"{uri}: no block list for {f.uri} ({exc!r})") from exc
        if size != f.block_bytes or block_list_digest(found) != f.block_list:
            raise CacheError(
                f"{uri}: its block list of {f.uri} is not the one the merge recorded "
                "(the shard changed after the merge)"
            )
        for _, hashes in lists.values():
            digest = block_list_digest(hashes)
            self._lists[digest] = hashes
            write_bytes(self._list_path(digest), "\n".join(hashes).encode())
        return found

    def matches(self, f: RemoteFile, i: int, data: bytes | mmap.mmap) -> bool:
        """Block ``i``'s bytes hash to its recorded sha256 (True when none is recorded)."""
        hashes = self.hashes(f)
        return not hashes or block_digest(data) == hashes[i]

    def _name(self, f: RemoteFile, i: int) -> str:
        """The block's file: ``blocks/<h[:2]>/<h>-<i>``, ``h`` a hash of the object's URI and
        size (string work only: this runs per piece read)."""
        where = (f.bucket, f.key, f.size)
        base = self._bases.get(where)
        if base is None:
            name = hashlib.sha256(f"{f.uri}\0{f.size}".encode()).hexdigest()[:32]
            base = self._bases[where] = os.path.join(self.root, "blocks", name[:2], name)
        return f"{base}-{i:08d}"

    def block(self, f: RemoteFile, i: int) -> memoryview:
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
            with self._locked(path):  # fetched once on this node
                if not path.is_file():  # else another process stored it meanwhile
                    self._store(f, i, path, self._get(f, i))
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

    def _stamp_path(self, path: Path) -> Path:
        """Where the stamp of a checked block lives: ``verified/<h[:2]>/<name>``."""
        return self.root / "verified" / path.parent.name / path.name

    def _stamp(self, path: Path, st: os.stat_result) -> None:
        """Record that the block file ``st`` describes was checked; a torn or lost stamp only
        costs a re-hash, so it is renamed into place without an fsync."""
        stamp = self._stamp_path(path)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(_stamp_of(st))
        os.replace(tmp, stamp)

    def _stamped(self, path: Path, st: os.stat_result) -> bool:
        """True when the block was checked since it was last written; refreshes the stamp's
        mtime (the eviction order)."""
        stamp = self._stamp_path(path)
        try:
            found = stamp.read_bytes()
            os.utime(stamp)
        except FileNotFoundError:
            return False
        return found == _stamp_of(st)

    def _open_checked(self, f: RemoteFile, i: int, path: Path) -> memoryview | None:
        """The cached block mapped, or None (then removed) when absent, short or not matching
        its hash; hashed once after it is written, then trusted while its stamp matches."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            lo, hi = f.span(i)
            st = os.fstat(fd)
            view = None
            if st.st_size == hi - lo:
                view = mmap.mmap(fd, hi - lo, prot=mmap.PROT_READ)
                if not f.verified:
                    os.utime(fd)  # the eviction order (checked blocks: their stamp's mtime)
        finally:
            os.close(fd)
        if view is not None and f.verified and str(path) not in self._checked:
            if self._stamped(path, st):
                self._checked.add(str(path))
            elif not self.matches(f, i, view):
                view.close()
                view = None
            else:
                self._stamp(path, st)
                self._checked.add(str(path))
        if view is None:
            path.unlink(missing_ok=True)
            return None
        return memoryview(view)

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        """Hold the node-wide lock of one block file (an ``flock`` on ``locks/<name>``)."""
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / path.name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _HELD.add(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _HELD.discard(fd)
            os.close(fd)

    def _store(self, f: RemoteFile, i: int, path: Path, data: bytes) -> None:
        """Write checked block ``data`` crash-safely (temp, fsync, rename) under the capacity,
        and stamp it checked."""
        self._make_room(len(data), f, i)
        remove_stale_temps(path)  # of killed writers: never renamed, never read
        tmp: Path | None = None
        try:
            tmp, fh = create_temp(path, lambda t: open(t, "wb"))  # noqa: SIM115 - closed below
            with fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)  # no fsync of the folder: a rename a power cut loses
            # leaves the block absent, fetched again (a cache; one fsync fewer per block)
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
        if f.verified:
            self._stamp(path, os.stat(path))
        with self._lock:
            self._checked.add(str(path))

    def _fill_run(
        self, f: RemoteFile, first: int, stop: int, fresh: list[Fresh] | None = None
    ) -> None:
        """Download the missing blocks of ``first..stop-1`` of ``f`` by one range GET, once on
        this node (locks taken in ascending order: no two runs deadlock); ``fresh``: a batch's
        read, served from memory (``_keep``). A failed check or a cut body ends the run: the
        rest is fetched block by block when read."""
        from tokenmill.storage.s3 import is_cut_body, s3_errors

        if stop - first == 1 and fresh is None:
            self.block(f, first)
            return
        with contextlib.ExitStack() as held:
            locks = {}
            for i in range(first, stop):
                locks[i] = contextlib.ExitStack()
                held.callback(locks[i].close)  # unless handed over with the block
                locks[i].enter_context(self._locked(Path(self._name(f, i))))
            missing = [i for i in locks if not os.path.isfile(self._name(f, i))]
            if not missing:
                return
            first, stop = missing[0], missing[-1] + 1
            lo, hi = f.span(first)[0], f.span(stop - 1)[1]
            with s3_errors(f"reading block {first} (bytes {lo}..{hi}) of {f.uri}"):
                body = self.client().get_object(
                    Bucket=f.bucket, Key=f.key, Range=f"bytes={lo}-{hi - 1}"
                )["Body"]
                try:
                    for i in range(first, stop):  # until a block fails its check
                        a, b = f.span(i)
                        data = bytes(body.read(b - a))
                        self.bytes_fetched += len(data)
                        if len(data) != b - a or not self.matches(f, i, data):
                            return
                        path = Path(self._name(f, i))
                        if path.is_file():
                            continue
                        if fresh is None:
                            self._store(f, i, path, data)
                        else:
                            fresh.append(self._keep(f, i, path, data, locks[i].pop_all()))
                except Exception as exc:
                    if not is_cut_body(exc):
                        raise
                finally:
                    body.close()

    def _get(self, f: RemoteFile, i: int) -> bytes:
        """Block ``i`` by a range GET, checked (size, and sha256 when recorded), fetched once
        more when it fails; CacheError naming the object and block after that."""
        from tokenmill.storage.s3 import read_object

        lo, hi = f.span(i)
        why, what = "", f"reading block {i} (bytes {lo}..{hi}) of {f.uri}"
        for _ in range(GET_ATTEMPTS):
            data = read_object(self.client(), f.bucket, f.key, (lo, hi), what)
            if data is None:
                raise InputError(f"{what}: the object is missing")
            self.bytes_fetched += len(data)
            if len(data) != hi - lo:
                why = f"{len(data)} bytes, expected {hi - lo}"
            elif not self.matches(f, i, data):
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
                    blocks.append((self._last_use(entry, st), st.st_size, entry))
            used = sum(b[1] for b in blocks)
            for _, nbytes, entry in sorted(blocks):
                if used + self._inflight + size <= self.capacity:
                    break
                entry.unlink(missing_ok=True)  # a process reading it keeps its mapping
                self._stamp_path(entry).unlink(missing_ok=True)
                self._checked.discard(str(entry))
                used -= nbytes
            self._used = used + self._inflight + size
            self._inflight += size

    def _last_use(self, path: Path, st: os.stat_result) -> float:
        """When a block was last mapped: its stamp's mtime (checked blocks), else its own."""
        try:
            return max(st.st_mtime, self._stamp_path(path).stat().st_mtime)
        except FileNotFoundError:
            return st.st_mtime

    def views(self, wanted: list[tuple[RemoteFile, int]]) -> list[memoryview]:
        """Every (file, block) mapped and checked, the missing ones fetched first, in parallel,
        contiguous blocks of one object by one range GET; CacheError when they cannot all be
        held at once (one batch larger than ``cache_bytes``)."""
        self.stored_failure()
        if self.capacity is not None:
            need = sum(f.span(i)[1] - f.span(i)[0] for f, i in wanted)
            if need > self.capacity:
                raise CacheError(
                    f"one batch needs {len(wanted)} blocks ({need} bytes), more than "
                    f"cache_bytes={self.capacity} at {self.root}: raise cache_bytes"
                )
        found = [self._maps.get(self._name(f, i)) for f, i in wanted]
        todo = [k for k, v in enumerate(found) if v is None]
        if not todo:
            return found  # type: ignore[return-value]
        runs = self._runs([wanted[k] for k in todo])
        fresh: list[Fresh] = []
        if len(runs) > 1:
            list(self.pool().map(lambda r: self._fill_run(r[0], r[1], r[2], fresh), runs))
        elif runs:
            self._fill_run(*runs[0], fresh=fresh)
        served = dict(fresh)
        for k in todo:
            view = served.get(self._name(*wanted[k]))
            found[k] = self.block(*wanted[k]) if view is None else view
        return found  # type: ignore[return-value]

    def _keep(
        self, f: RemoteFile, i: int, path: Path, data: bytes, lock: contextlib.ExitStack
    ) -> Fresh:
        """Serve this fetched, checked block from memory, and store it on a writer thread,
        off the batch's path: its ``lock`` is released once it is stored (until then other
        processes wait for the file and this one reads the bytes); a failure (the cache
        directory full) is raised by the next read (``stored_failure``)."""
        view = memoryview(data)
        with self._lock:
            self._maps[str(path)] = view

        def store() -> None:
            try:
                self._store(f, i, path, data)
            except Exception as exc:
                with self._lock:
                    self._failed = self._failed or exc
            finally:
                lock.close()
                with self._lock:  # read from the file from now on (or fetched again)
                    if self._maps.get(str(path)) is view:
                        del self._maps[str(path)]

        self._submit(
            self._own("writer", lambda: ThreadPoolExecutor(STORE_THREADS, "tokenmill-s3-store")),
            store,
        )
        return str(path), view

    def stored_failure(self) -> None:
        """Raise, once, the failure of storing blocks a batch was served from memory."""
        with self._lock:
            failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def _runs(self, wanted: list[tuple[RemoteFile, int]]) -> list[tuple[RemoteFile, int, int]]:
        """The blocks not on disk, as runs (file, first, stop) of consecutive blocks of one
        file, at most ``RUN_BLOCKS`` long (one range GET each)."""
        missing = sorted(
            {(f.uri, i): f for f, i in wanted if not os.path.isfile(self._name(f, i))}.items()
        )
        runs: list[tuple[RemoteFile, int, int]] = []
        for (uri, i), f in missing:
            last = runs[-1] if runs else None
            if last and last[0].uri == uri and last[2] == i and i - last[1] < RUN_BLOCKS:
                runs[-1] = (f, last[1], i + 1)
            else:
                runs.append((f, i, i + 1))
        return runs

    def prefetch(self, wanted: list[tuple[RemoteFile, int]]) -> None:
        """Fetch these blocks in the background (errors surface when the batch is read)."""
        for run in self._runs([(f, i) for f, i in wanted if self._name(f, i) not in self._maps]):
            self._submit(self.pool(), self._fill_run, *run)

    def prefetch_lists(self, files: list[RemoteFile]) -> None:
        """Fetch the block lists ``files`` hold by reference in the background, one GET per
        dataset manifest (it then overlaps the GETs of their first blocks)."""
        wanted = {
            f.manifest_key: f
            for f in files
            if f.block_list and f.block_list not in self._lists and f.blocks > 1
        }
        for f in wanted.values():
            self._submit(self.pool(), self.hashes, f)

    @staticmethod
    def _quiet(fetch: Any, *args: Any) -> None:
        """A background fetch: a failure (OSError, tokenmill's or botocore's) is left for the
        read that needs what it fetches, which fetches it again and raises there."""
        try:
            fetch(*args)
        except OSError:
            return
        except Exception as exc:
            if type(exc).__module__.split(".")[0] not in ("botocore", "tokenmill"):
                raise


_HELD: set[int] = set()  # descriptors of the block locks (flock) this process holds
_CACHES: dict[tuple[str, int | None], BlockCache] = {}


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) gets fresh thread locks (a parent's thread may have
    held one at the fork), none of the parent's jobs, reservations, failures or blocks held for
    its writer (their threads are not here), and closes the inherited block locks (they would
    stay held after the parent releases them)."""
    for cache in _CACHES.values():
        cache._lock = threading.Lock()
        cache._jobs, cache._inflight, cache._failed = [], 0, None
        for key in [k for k, v in cache._maps.items() if isinstance(v.obj, bytes)]:
            del cache._maps[key]
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def cache_for(root: str | os.PathLike[str], capacity: int | None) -> BlockCache:
    """The process's BlockCache for ``root`` (shared by every dataset read through it)."""
    key = (str(Path(root).resolve()), capacity)
    if key not in _CACHES:
        _CACHES[key] = BlockCache(Path(key[0]), capacity)
    return _CACHES[key]
