"""One pulled file, block by block: verify what is there, resume a partial, fetch the rest.

A file is a list of blocks, each fetched by one range GET and checked on its own: the per-block
sha256 list a ``.bin``'s manifest records, else the parts a merge records, else the whole file as
one block. Blocks land in a partial file (``<folder>/.tmp/<name>.partial`` when a ledger records
them, a unique temp otherwise), are fsynced, then recorded in the destination's ledger
(``tokenmill.storage.pull_ledger``); the whole file is checked against its sha256 (or parts)
before it is renamed into place.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.atomic import commit, name_os_errors, remove_stale_temps, temp_dir, temp_path_for
from tokenmill.errors import CacheError, FormatError, InputError
from tokenmill.storage.pull_ledger import Ledger
from tokenmill.storage.s3 import BODY_ATTEMPTS, is_s3_error
from tokenmill.storage.store import Store, ranged

BLOCK_ATTEMPTS = 2  # a block failing its sha256 is fetched once more, then refused
SYNC_BYTES = 64 << 20  # new blocks are fsynced and recorded at least this often
PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class Wanted:
    """One file the blend needs: where it comes from, where it goes, what it must hash to."""

    key: str  # source key (posix, relative to the source root: bucket or "/")
    rel: str  # destination path relative to the pull directory
    size: int
    sha256: str  # "" for a file recorded by its parts only (a merged .bin)
    parts: tuple[tuple[int, str], ...] = ()  # (bytes, sha256) ranges from the dataset manifest
    what: str = ""
    block_bytes: int = 0  # the per-block sha256 list of a .bin (dataset or merge manifest)
    block_sha256: tuple[str, ...] = ()

    @property
    def identity(self) -> str:
        """The content this entry names (size and sha256, or the hash of its parts)."""
        parts = "".join(d for _, d in self.parts).encode()
        return f"{self.size}:{self.sha256 or hashlib.sha256(parts).hexdigest()}"

    def blocks(self) -> list[tuple[int, int, str | None]]:
        """``(start, stop, sha256)`` of each block fetched and checked on its own: the per-block
        list, else the recorded parts, else the whole file (None: checked as a whole)."""
        if self.block_sha256:
            b, size = self.block_bytes, self.size
            return [(i * b, min(size, (i + 1) * b), d) for i, d in enumerate(self.block_sha256)]
        if self.parts:
            ends = itertools.accumulate(n for n, _ in self.parts)
            return [(end - n, end, d) for end, (n, d) in zip(ends, self.parts, strict=True)]
        return [(0, self.size, None)] if self.size else []


class Hasher:
    """sha256 of a whole stream, and of consecutive parts when the file is recorded by parts."""

    def __init__(self, want: Wanted) -> None:
        self.want = want
        self.whole = hashlib.sha256()
        self.size = 0
        self.part_hashes: list[str] = []
        self.part = hashlib.sha256()
        self.part_left = want.parts[0][0] if want.parts else -1

    def copy(self) -> Hasher:
        """An independent copy of the state (a block is taken only once it verifies)."""
        other = copy.copy(self)
        other.whole, other.part = self.whole.copy(), self.part.copy()
        other.part_hashes = list(self.part_hashes)
        return other

    def update(self, chunk: bytes) -> None:
        self.whole.update(chunk)
        self.size += len(chunk)
        view = memoryview(chunk)
        while self.want.parts and view.nbytes and len(self.part_hashes) < len(self.want.parts):
            take = min(self.part_left, view.nbytes)
            self.part.update(view[:take])
            view, self.part_left = view[take:], self.part_left - take
            if self.part_left == 0:
                self.part_hashes.append(self.part.hexdigest())
                self.part = hashlib.sha256()
                nxt = len(self.part_hashes)
                self.part_left = self.want.parts[nxt][0] if nxt < len(self.want.parts) else 0

    def problem(self) -> str | None:
        """Why the bytes seen do not match the recorded size/hashes, or None."""
        if self.size != self.want.size:
            return f"{self.size} bytes, the manifest records {self.want.size}"
        offset = 0
        for i, (n, digest) in enumerate(self.want.parts):
            if i >= len(self.part_hashes) or self.part_hashes[i] != digest:
                return (
                    f"sha256 of part {i} (bytes {offset}..{offset + n}) differs from the manifest"
                )
            offset += n
        if self.want.sha256 and self.whole.hexdigest() != self.want.sha256:
            return "sha256 differs from the manifest"
        if not (self.want.sha256 or self.want.parts):
            return "the manifest records no hash for it"
        return None


def check_local(
    path: Path, want: Wanted, advance: Callable[[int], None]
) -> tuple[set[int], bool, int]:
    """Hash a destination file of the right size block by block: the blocks that match their
    sha256, whether the whole file is complete and verified, and the bytes read."""
    running, good, ok = Hasher(want), set(), True
    with open(path, "rb") as fh:
        for i, (lo, hi, digest) in enumerate(want.blocks()):
            fh.seek(lo)
            block = hashlib.sha256()
            for chunk in ranged(fh, hi - lo):
                block.update(chunk)
                running.update(chunk)
                advance(len(chunk))
            if digest is not None and block.hexdigest() == digest:
                good.add(i)
            elif digest is not None:
                ok = False
    return good, ok and running.problem() is None, running.size


def _take(
    chunks: Iterator[bytes],
    out: Any,
    lo: int,
    hi: int,
    digest: str | None,
    running: Hasher,
    where: Path,
) -> Hasher | None:
    """Feed one block to a copy of ``running`` (and write it at ``lo`` of ``out`` unless None);
    the copy when the block is whole and matches ``digest``, else None."""
    tentative, block, off = running.copy(), hashlib.sha256(), lo
    for chunk in chunks:
        if out is not None:
            with name_os_errors(where):  # a full disk here is the destination's
                _write_all(out, chunk, off)
        tentative.update(chunk)
        block.update(chunk)
        off += len(chunk)
    if off != hi or (digest is not None and block.hexdigest() != digest):
        return None
    return tentative


def _fetch_block(
    source: Store,
    want: Wanted,
    block: tuple[int, int, str | None],
    out: Any,
    running: Hasher,
    advance: Callable[[int], None],
) -> Hasher | None:
    """One range GET of a block into ``out``, hashed; ``_take``'s answer. A request is retried
    by botocore; a body cut mid-stream (which it cannot retry) is fetched again, up to
    ``BODY_ATTEMPTS`` tries; other failures are InputError naming the object."""
    lo, hi, digest = block
    seen = [0]

    def counted(chunks: Iterator[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            seen[0] += len(chunk)
            advance(len(chunk))
            yield chunk

    for attempt in range(1, BODY_ATTEMPTS + 1):
        seen[0], streaming = 0, False
        try:
            with source.chunks(want.key, lo, hi) as chunks:
                streaming = True
                return _take(counted(chunks), out, lo, hi, digest, running, Path(out.name))
        except Exception as exc:
            advance(-seen[0])
            if streaming and attempt < BODY_ATTEMPTS and source.cut(exc):
                continue
            if source.missing(exc):
                raise InputError(
                    f"{source.where(want.key)} ({want.what}): missing at the source"
                ) from None
            if not (is_s3_error(exc) or isinstance(exc, OSError)):
                raise  # a programming error, not a problem of the source or the disk
            raise InputError(f"{source.where(want.key)} ({want.what}): {exc}") from exc
    raise AssertionError("unreachable: the last attempt returns or raises")


def _fill(
    source: Store,
    want: Wanted,
    partial: Path,
    local: Path | None,
    good: set[int],
    ledger: Ledger | None,
    advance: Callable[[int], None],
) -> int:
    """Complete ``partial`` block by block; the bytes fetched. A block in ``good`` is taken from
    ``local`` (the partial, or an older copy) while it matches its sha256, any other is fetched
    (once more if it fails its sha256, then CacheError naming object and block). New blocks are
    fsynced, then recorded in the ledger, every ``SYNC_BYTES`` (a crash loses at most that
    much); the whole file is checked at the end."""
    running, fetched = Hasher(want), 0
    blocks = want.blocks()
    pending: list[int] = []  # new blocks written since the last fsync (recorded after it)
    pending_bytes = 0
    uri = f"{source.where(want.key)} ({want.what})"
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(partial, "r+b", buffering=0))
        src: Any = out  # where blocks in ``good`` are read: the partial, or an older copy
        if local is not None and local != partial:
            src = stack.enter_context(open(local, "rb"))
        for i, block in enumerate(blocks):
            lo, hi, digest = block
            taken = None
            if i in good and digest is not None:
                src.seek(lo)
                copy = None if src is out else out
                taken = _take(ranged(src, hi - lo), copy, lo, hi, digest, running, partial)
                advance(hi - lo if taken is not None else 0)
            fresh = taken is None or src is not out
            for _ in range(BLOCK_ATTEMPTS):
                if taken is not None:
                    break
                taken = _fetch_block(source, want, block, out, running, advance)
                fetched += hi - lo
            if taken is None:
                raise CacheError(
                    f"{uri}: sha256 of block {i} (bytes {lo}..{hi}) differs from the "
                    f"manifest's block list after {BLOCK_ATTEMPTS} fetches; not pulled"
                )
            running = taken
            if fresh and ledger is not None and len(blocks) > 1:
                pending.append(i)
                pending_bytes += hi - lo
            last = i == len(blocks) - 1
            if ledger is not None and pending and (pending_bytes >= SYNC_BYTES or last):
                with name_os_errors(partial):
                    os.fsync(out.fileno())
                ledger.blocks_done(want.rel, want.identity, pending)
                pending, pending_bytes = [], 0
        with name_os_errors(partial):
            os.fsync(out.fileno())
    if problem := running.problem():
        partial.unlink(missing_ok=True)
        raise CacheError(f"{uri}: {problem}; not pulled")
    return fetched


def _write_all(out: Any, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of an unbuffered file (a write may take part of it)."""
    view = memoryview(data)
    out.seek(offset)
    while view:
        written = out.write(view)
        view = view[written:]


def sync(
    source: Store,
    want: Wanted,
    root: Path,
    advance: Callable[[int], None],
    ledger: Ledger | None = None,
) -> int | None:
    """Make one destination file complete: None when it already was, else the bytes fetched. A
    file the ledger records as complete (same inode, mtime, size) is trusted; one of the right
    size is hashed block by block and kept when whole, else its good blocks go into a new partial
    and only the others are fetched. Otherwise a partial the ledger knows resumes from its
    recorded blocks; anything else starts afresh."""
    path = root / want.rel
    if root not in path.parents:
        raise FormatError(want.key, "path", f"resolves outside {root}; refusing to pull")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    key = want.identity
    # With a ledger (one pull per destination at a time) the partial has a stable name to resume
    # from; without one (the streaming reader's mirror, shared by processes) a unique temp.
    if ledger is None:
        partial = temp_path_for(path)
    else:
        partial = temp_dir(path.parent) / f"{path.name}{PARTIAL_SUFFIX}"
    if ledger is not None and ledger.trusted(want.rel, key, path):
        partial.unlink(missing_ok=True)  # a resume's leftover: the file is complete
        advance(want.size)
        return None
    good: set[int] = set()
    local: Path | None = None
    if path.is_file() and path.stat().st_size == want.size:
        good, whole, seen = check_local(path, want, advance)
        if whole:
            if ledger is not None:
                partial.unlink(missing_ok=True)
                ledger.done(want.rel, key, path)
            return None
        advance(-seen)
        local = path
    recorded = set()
    partial_size = partial.stat().st_size if partial.is_file() else -1  # ours: the folder's flock
    if local is None and ledger is not None and partial_size == want.size:
        recorded = ledger.blocks(want.rel, key)  # empty: the partial of other content
    if recorded:
        good, local = recorded, partial
    else:
        with name_os_errors(partial), open(partial, "wb") as fh:
            fh.truncate(want.size)
        if ledger is not None:
            ledger.start(want.rel, key)
    try:
        fetched = _fill(source, want, partial, local, good, ledger, advance)
    except BaseException:
        if ledger is None:  # nothing records its blocks: no resume from it
            partial.unlink(missing_ok=True)
        raise
    commit(partial, path)
    if ledger is not None:
        ledger.done(want.rel, key, path)
    return fetched
