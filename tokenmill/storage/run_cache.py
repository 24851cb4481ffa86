"""A run's download cache on this host: steps of one run (in one process or several) that read
the same S3 object download it once (``tokenmill.storage.staging`` fetches through it).

An entry is named by the object's bucket, key, ETag and size (a changed object is a new entry)
and reaches a step's work directory as a hard link (a copy across file systems). Steps replace
files by rename, never in place; the entry is read-only with a fixed mtime, so one written in
place anyway (as root) no longer matches and is downloaded again. What a step uploads is kept too
(one HEAD names its ETag), so later steps of the run read it without a download.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.atomic import commit, create_temp, temp_path_for
from tokenmill.storage.s3 import S3Object, download

RUN_CACHE_PREFIX = "tokenmill-run-"
CACHE_MTIME_NS = 1_000_000_000 * 10**9  # every cache entry's mtime; any write changes it


@dataclass(frozen=True)
class RunCache:
    """Objects downloaded during one run (``root``: ``<work dir>/tokenmill-run-<run id>``)."""

    root: Path

    @classmethod
    def open(cls, base: Path, run_id: str, max_age_hours: float) -> RunCache:
        """The run's cache under ``base`` (made if needed); other runs' caches unused for
        ``max_age_hours`` are removed on the way (a run that died without cleaning up)."""
        safe = "".join(c for c in run_id if c.isalnum() or c in "-_") or "run"
        cache = cls(base / f"{RUN_CACHE_PREFIX}{safe}")
        cache.root.mkdir(parents=True, exist_ok=True)
        cache.touch()
        cutoff = time.time() - max_age_hours * 3600
        for other in base.glob(f"{RUN_CACHE_PREFIX}*"):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile by another run
                if other != cache.root and other.stat().st_mtime < cutoff:
                    shutil.rmtree(other, ignore_errors=True)
        return cache

    def touch(self) -> None:
        """Mark the cache as in use now (its age counts from the last use)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.root)

    def remove(self) -> None:
        """Delete the whole cache (the run is over)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def entry(self, bucket: str, obj: S3Object) -> Path:
        """Where ``obj`` (at its current ETag and size) is kept."""
        name = hashlib.sha256(f"{bucket}\0{obj.key}\0{obj.etag}\0{obj.size}".encode())
        return self.root / "objects" / name.hexdigest()

    def holds(self, entry: Path, size: int) -> bool:
        """True when ``entry`` is complete and unmodified."""
        try:
            st = entry.stat()
        except FileNotFoundError:
            return False
        return st.st_size == size and st.st_mtime_ns == CACHE_MTIME_NS

    def keep(self, client: Any, bucket: str, key: str, path: Path) -> None:
        """Take ``path``, just uploaded to ``s3://bucket/key``, into the cache (one HEAD names its
        ETag) for later steps of the run. Best effort: a failure leaves the cache as it was."""
        from botocore.exceptions import BotoCoreError, ClientError

        with contextlib.suppress(OSError, BotoCoreError, ClientError, KeyError, ValueError):
            head = client.head_object(Bucket=bucket, Key=key)
            obj = S3Object(key, int(head["ContentLength"]), str(head["ETag"]).strip('"'))
            entry = self.entry(bucket, obj)
            if obj.size != path.stat().st_size or self.holds(entry, obj.size):
                return
            entry.parent.mkdir(parents=True, exist_ok=True)
            try:
                incoming, _ = create_temp(entry, functools.partial(os.link, path))
            except OSError:
                incoming, _ = create_temp(entry, functools.partial(shutil.copyfile, path))
            os.chmod(incoming, 0o444)
            os.utime(incoming, ns=(CACHE_MTIME_NS, CACHE_MTIME_NS))
            os.replace(incoming, entry)

    def fetch(self, client: Any, bucket: str, obj: S3Object, path: Path) -> bool:
        """``obj`` at ``path``: linked from the cache, downloaded into it first when it does not
        hold the object (then True). Falls back to a plain download when the cache cannot be
        used (e.g. removed meanwhile); an object that changed since it was listed is not kept."""
        entry = self.entry(bucket, obj)
        incoming: Path | None = None
        try:
            if not self.holds(entry, obj.size):
                entry.parent.mkdir(parents=True, exist_ok=True)
                incoming = temp_path_for(entry)  # download() creates it (through its own temp)
                download(client, bucket, obj.key, incoming)
                if incoming.stat().st_size != obj.size:  # rewritten after the listing
                    path.parent.mkdir(parents=True, exist_ok=True)
                    commit(incoming, path)
                    return True
                os.chmod(incoming, 0o444)
                os.utime(incoming, ns=(CACHE_MTIME_NS, CACHE_MTIME_NS))
                os.replace(incoming, entry)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            try:
                os.link(entry, path)
            except OSError:  # another file system, or no hard links there
                shutil.copyfile(entry, path)
        except OSError:
            if incoming is not None:
                incoming.unlink(missing_ok=True)
            download(client, bucket, obj.key, path)
            return True
        return incoming is not None
