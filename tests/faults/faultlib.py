"""Helpers of the fault suite: kill a CLI run at a known point, fail chosen writes with an
errno, and audit an output tree against its manifests.

* :func:`kill_parked` runs ``tokenmill <command>`` in a child that stops ("parks") at the n-th
  call of one chosen function, then SIGKILLs it there: the kill lands mid-work every time.
* :func:`failing_writes` makes writes (or fsyncs) of files with a chosen name fail with
  ``ENOSPC``/``EIO`` after N bytes, in process, the way a full or broken disk reports it (an
  ``OSError`` without a file name).
* :func:`audit` lists temp files, manifests that do not match their files, and final-named
  files that no manifest (dataset, blend, index-cache description, ``dataset_info.json``)
  covers.
"""

from __future__ import annotations

import builtins
import errno
import fnmatch
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest

from tokenmill.atomic import TMP_MARK, file_sha256, is_temp
from tokenmill.errors import CacheError, FormatError, TokenmillError
from tokenmill.formats.blend_manifest import read_blend_manifest, resolve
from tokenmill.formats.dataset_manifest import (
    check_dataset_files,
    prefix_of_manifest,
    read_dataset_manifest,
    write_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDatasetWriter, data_file_path, index_file_path
from tokenmill.formats.nanoset_cache import load_array, read_description
from tokenmill.storage.pull_blocks import PARTIAL_SUFFIX
from tokenmill.storage.pull_ledger import LEDGER_NAME
from tokenmill.verify import verify_blend
from tokenmill_dev.corpus import stdlib_documents

PARK_SECONDS = 60  # how long a child may take to reach its parking point
DATASET_MANIFEST = ".manifest.json"

# The child: import the command and its library, wrap one function so that its n-th call parks
# (after telling the parent through the marker file), then run the CLI.
_CHILD = """
import importlib, sys, threading, time
marker, target, call, when, *argv = sys.argv[1:]
LIBRARY = {"tokenize": "tokenize.run", "merge": "formats.merge", "index": "indices.nanoset",
           "blend": "indices.blend_build", "pull": "storage.pull"}
importlib.import_module("tokenmill.commands." + argv[0])
importlib.import_module("tokenmill." + LIBRARY[argv[0]])
module, _, attr = target.partition(":")
owner = importlib.import_module(module)
*parents, name = attr.split(".")
for part in parents:
    owner = getattr(owner, part)
original, lock, seen = getattr(owner, name), threading.Lock(), [0]

def park():
    open(marker, "x").close()
    while True:
        time.sleep(60)

def hooked(*args, **kwargs):
    with lock:
        seen[0] += 1
        n = seen[0]
    if n == int(call) and when == "before":
        park()
    result = original(*args, **kwargs)
    if n == int(call) and when == "after":
        park()
    return result

setattr(owner, name, hooked)
from tokenmill.cli import main
sys.exit(main(argv))
"""


def kill_parked(
    argv: list[str], hook: str, marker: Path, *, call: int = 1, after: bool = False
) -> None:
    """Run ``tokenmill *argv`` until the ``call``-th call of ``hook`` (``"module:attr"``, attr may
    be ``Class.method``) starts (or returns, ``after``), then SIGKILL it there.

    Fails the test if the run ends before reaching that point. Children the run forked are
    waited for (they exit when their parent dies); any still alive after 10 s are killed by PID.
    """
    when = "after" if after else "before"
    cmd = [sys.executable, "-c", _CHILD, str(marker), hook, str(call), when, *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + PARK_SECONDS
    try:
        while not marker.exists():
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                pytest.fail(f"{argv} ended ({proc.returncode}) before {hook} #{call}: {err}")
            if time.monotonic() > deadline:
                pytest.fail(f"{argv} did not reach {hook} #{call} in {PARK_SECONDS}s")
            time.sleep(0.005)
        children = psutil.Process(proc.pid).children(recursive=True)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        child.kill()
    marker.unlink()


@dataclass
class Audit:
    """The state of an output tree (paths relative to its root)."""

    temps: list[str]  # temps (in a .tmp/ folder, or with the temp mark): left by a killed writer
    orphans: list[str]  # final-named files that no valid manifest or description covers
    problems: list[str]  # manifests/descriptions present but not matching their files
    manifests: list[str]  # manifests/descriptions present


def audit(root: Path) -> Audit:
    """Check every manifest, blend manifest and index description under ``root`` in full."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    temps = [p for p in files if is_temp(p.relative_to(root).as_posix())]
    covered: set[Path] = set(temps)
    problems: list[str] = []
    manifests = []
    for path in files:
        if path in covered:
            continue
        if path.name.endswith(DATASET_MANIFEST):
            found, paths = _dataset(path)
        elif path.name == "manifest.json":
            found, paths = _blend(path)
        elif path.name.endswith("-description.json"):
            found, paths = _index_entry(path)
        elif path.name == "dataset_info.json":
            found, paths = _hf_info(path)
        else:
            continue
        manifests.append(path)
        problems += found
        covered |= {path, *paths}
    orphans = [
        p for p in files if p not in covered and p.suffix != ".lock" and p.name != LEDGER_NAME
    ]
    rel = lambda paths: sorted(p.relative_to(root).as_posix() for p in paths)  # noqa: E731
    return Audit(rel(temps), rel(orphans), problems, rel(manifests))


def _dataset(path: Path) -> tuple[list[str], list[Path]]:
    """A dataset manifest covers its pair and, for a tokenize run that quarantined, the
    ``<output prefix>.quarantine.jsonl`` beside it (checked by its line count: the manifest
    records no hash of it)."""
    prefix = prefix_of_manifest(path)
    try:
        problems = check_dataset_files(prefix, full=True)
        manifest = read_dataset_manifest(prefix)
    except TokenmillError as exc:
        return [str(exc)], []
    covered = [data_file_path(prefix), index_file_path(prefix)]
    suffix = f"_{manifest['config'].get('text_key', 'text')}_document"
    quarantine = Path(str(prefix).removesuffix(suffix) + ".quarantine.jsonl")
    if quarantine.is_file():
        covered.append(quarantine)
        lines = len(quarantine.read_bytes().splitlines())
        if lines != manifest["counts"].get("quarantined"):
            problems.append(
                f"{quarantine}: {lines} lines, the manifest counts {manifest['counts']}"
            )
    return problems, covered


def _blend(path: Path) -> tuple[list[str], list[Path]]:
    try:
        manifest = read_blend_manifest(path)
        problems = verify_blend(path, full=True)
    except TokenmillError as exc:
        return [str(exc)], []
    entries = [f for ds in manifest["datasets"] for f in ds["files"].values()]
    for split in manifest["splits"].values():
        entries += split["files"].values()
        entries += [f for ds in split["datasets"] for f in ds["index"]["files"].values()]
    return problems, [resolve(path, entry["path"]) for entry in entries]


def _index_entry(path: Path) -> tuple[list[str], list[Path]]:
    description = read_description(path)
    if description is None:
        return [f"{path}: unreadable description"], []
    paths, problems = [], []
    for record in description.get("files", {}).values():
        array = path.with_name(record["file"])
        paths.append(array)
        try:
            load_array(array, record, full=True)
        except (CacheError, FormatError) as exc:
            problems.append(str(exc))
    return problems, paths


def _hf_info(path: Path) -> tuple[list[str], list[Path]]:
    shards = json.loads(path.read_text(encoding="utf-8"))["shards"]
    paths, problems = [], []
    for shard in shards:
        paths.append(path.parent / shard["file"])
        if not paths[-1].is_file() or file_sha256(paths[-1]) != shard["sha256"]:
            problems.append(f"{paths[-1]}: missing or not the shard {path} describes")
    return problems, paths


def tree_digest(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root`` (a pull's ledger aside: it
    records inodes)."""
    return {
        p.relative_to(root).as_posix(): file_sha256(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != LEDGER_NAME
    }


@dataclass
class WriteFault:
    """Writes to files whose final name matches ``pattern`` fail with ``error`` once ``after``
    bytes of that file were written (``on="write"``), or their fsync fails (``on="fsync"``)."""

    pattern: str
    error: int = errno.ENOSPC
    after: int = 0
    on: str = "write"
    fired: list[str] = field(default_factory=list)
    _written: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def matches(self, path: str | os.PathLike[str]) -> bool:
        final = Path(path).name.split(TMP_MARK)[0].removesuffix(PARTIAL_SUFFIX)
        return fnmatch.fnmatch(final, self.pattern)

    def allow(self, path: str, nbytes: int) -> int:
        """How many of ``nbytes`` the file still takes (and count them as written)."""
        with self._lock:
            done = self._written.get(path, 0)
            take = max(0, min(nbytes, self.after - done))
            self._written[path] = done + take
            return take

    def fail(self, path: str) -> OSError:
        """The error a disk reports: errno and message, no file name (the caller knows it)."""
        self.fired.append(path)
        return OSError(self.error, os.strerror(self.error))


class _FailingFile:
    """A writable file whose writes stop at the fault's byte budget (not an ``io`` instance, so
    ``np.save`` writes through ``write`` too instead of handing the fd to C)."""

    def __init__(self, fh: Any, fault: WriteFault, path: str) -> None:
        self._fh, self._fault, self._path = fh, fault, path

    def write(self, data: Any) -> int:
        view = memoryview(data.encode() if isinstance(data, str) else data).cast("B")
        take = self._fault.allow(self._path, view.nbytes)
        if take < view.nbytes:
            self._fh.write(view[:take])
            raise self._fault.fail(self._path)
        return int(self._fh.write(view))

    def __enter__(self) -> _FailingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@contextmanager
def failing_writes(fault: WriteFault) -> Iterator[WriteFault]:
    """Inject ``fault`` into ``open`` (write modes), ``os.sendfile``, ``os.fsync`` and pyarrow's
    ``ParquetWriter.write_table`` for the duration of the block."""
    mp = pytest.MonkeyPatch()
    real_open, real_sendfile, real_fsync = builtins.open, os.sendfile, os.fsync
    real_write_table = pq.ParquetWriter.write_table

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(file, mode, *args, **kwargs)
        writing = isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+")
        if fault.on == "write" and writing and fault.matches(file):
            return _FailingFile(fh, fault, os.path.realpath(file))
        return fh

    def sendfile(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        path = _fd_path(out_fd)
        if fault.on != "write" or not fault.matches(path):
            return real_sendfile(out_fd, in_fd, offset, count)
        take = fault.allow(path, count)
        if take == 0:
            raise fault.fail(path)
        return real_sendfile(out_fd, in_fd, offset, take)

    def fsync(fd: int) -> None:
        path = _fd_path(fd)
        if fault.on == "fsync" and os.path.isfile(path) and fault.matches(path):
            raise fault.fail(path)
        real_fsync(fd)

    def write_table(self: Any, table: Any, row_group_size: int | None = None) -> None:
        path = os.path.realpath(self.where)
        on = fault.on == "write" and fault.matches(path)
        if on and fault.allow(path, table.nbytes) < table.nbytes:
            raise fault.fail(path)
        real_write_table(self, table, row_group_size=row_group_size)

    mp.setattr(builtins, "open", open_)
    mp.setattr(io, "open", open_)
    mp.setattr(os, "sendfile", sendfile)
    mp.setattr(os, "fsync", fsync)
    mp.setattr(pq.ParquetWriter, "write_table", write_table)
    try:
        yield fault
    finally:
        mp.undo()


def build_sources(root: Path) -> Path:
    """Inputs every stage can start from: ``a.jsonl``/``b.jsonl`` (40 real documents each),
    ``bad.jsonl`` (one good line, two to quarantine);
    token datasets ``s0``..``s2`` (same lengths, other tokens: merges in any order have the same
    sizes), ``docs`` and ``code`` (to index and blend), each ``<name>_text_document``."""
    docs = stdlib_documents()
    for name in ("a", "b"):
        lines = [json.dumps({"text": next(docs)["text"][:3000], "n": i}) for i in range(40)]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "bad.jsonl").write_text('{"text": "kept"}\n{"text": 1}\nnot json\n', encoding="utf-8")
    lengths = np.random.default_rng(0).integers(20, 400, 100)
    for seed, name in enumerate(["s0", "s1", "s2", "docs", "code"], start=1):
        tokens = np.random.default_rng(seed).integers(0, 50000, int(lengths.sum()))
        prefix = root / f"{name}_text_document"
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            writer.add_documents(tokens, lengths if name != "code" else lengths[::-1])
        write_dataset_manifest(prefix, kind="tokens", inputs=[], config={}, counts={})
    return root
