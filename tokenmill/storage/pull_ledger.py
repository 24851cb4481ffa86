"""The crash-safe record of a ``tokenmill pull`` destination: complete files, verified blocks.

``<dest>/.tokenmill-pull.jsonl`` is an append-only JSON-lines file. Each line is written only
after the bytes it vouches for are fsynced, and is fsynced itself, so a crash loses at most the
line being written (a torn last line is ignored: it vouched for nothing). Records::

    {"start": rel, "key": K}                   a fresh partial of rel (earlier blocks are void)
    {"block": rel, "key": K, "i": [i, ...]}    blocks of it written, fsynced, sha256 matched
    {"done": rel, "key": K, "ino": .., "mtime_ns": .., "size": ..}   rel complete and verified

``K`` names the wanted content (size and sha256, or the hash of its parts). A later pull trusts a
complete file while its inode, mtime and size are the recorded ones (a file changed behind the
file system's back is ``tokenmill verify``'s to find) and resumes a partial from its recorded
blocks. :meth:`Ledger.compact` rewrites the file (atomically) with one line per complete file.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenmill.atomic import read_if_exists, write_bytes

LEDGER_NAME = ".tokenmill-pull.jsonl"


class Ledger:
    """The ledger of one destination folder (thread-safe appends). Opening it takes an
    exclusive ``flock`` on the folder until :meth:`close`: a second pull into the same folder
    waits for the first, then finds its files complete."""

    def __init__(self, root: Path) -> None:
        self.path = root / LEDGER_NAME
        self._dir_fd: int | None = os.open(root, os.O_RDONLY)
        fcntl.flock(self._dir_fd, fcntl.LOCK_EX)
        self._lock = threading.Lock()
        self._done: dict[str, tuple[Any, int, int, int]] = {}
        self._partial: dict[str, tuple[Any, set[int]]] = {}
        self._fd: int | None = None
        raw = read_if_exists(self.path) or b""
        self._newline = bool(raw) and not raw.endswith(b"\n")  # torn: start the next line anew
        for line in raw.splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # torn by a crash while it was written: it vouched for nothing
                continue
            if isinstance(record, dict):
                self._apply(record)

    def _apply(self, record: dict[str, Any]) -> None:
        key = record.get("key")
        if "done" in record:
            rel = str(record["done"])
            self._done[rel] = (key, record["ino"], record["mtime_ns"], record["size"])
            self._partial.pop(rel, None)
        elif "start" in record:
            self._partial[str(record["start"])] = (key, set())
            self._done.pop(str(record["start"]), None)
        elif "block" in record:
            owner = self._partial.get(str(record["block"]))
            if owner is not None and owner[0] == key:
                owner[1].update(int(i) for i in record["i"])

    def trusted(self, rel: str, key: str, path: Path) -> bool:
        """True when ``path`` is the complete, verified file recorded for ``rel`` and ``key``."""
        done = self._done.get(rel)
        if done is None or done[0] != key:
            return False
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        return (st.st_ino, st.st_mtime_ns, st.st_size) == done[1:]

    def blocks(self, rel: str, key: str) -> set[int]:
        """The verified blocks of ``rel``'s partial download of ``key`` (empty: none)."""
        owner = self._partial.get(rel)
        return set(owner[1]) if owner is not None and owner[0] == key else set()

    def start(self, rel: str, key: str) -> None:
        """Record that a fresh partial download of ``rel`` begins."""
        self._append({"start": rel, "key": key})

    def blocks_done(self, rel: str, key: str, blocks: list[int]) -> None:
        """Record ``blocks`` of ``rel``'s partial as durable and verified (after their fsync)."""
        self._append({"block": rel, "key": key, "i": list(blocks)})

    def done(self, rel: str, key: str, path: Path) -> None:
        """Record ``path`` (renamed into place, verified) as the complete file of ``rel``."""
        st = path.stat()
        record = {"done": rel, "key": key, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}
        self._append({**record, "size": st.st_size})

    def _append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if self._newline:
                line, self._newline = b"\n" + line, False
            os.write(self._fd, line)
            os.fsync(self._fd)
            self._apply(record)

    def compact(self, rels: Iterable[str]) -> None:
        """Rewrite the ledger atomically with the complete-file records of ``rels`` only."""
        lines = []
        for rel in rels:
            if rel in self._done:
                key, ino, mtime_ns, size = self._done[rel]
                record = {"done": rel, "key": key, "ino": ino, "mtime_ns": mtime_ns, "size": size}
                lines.append(json.dumps(record, separators=(",", ":")) + "\n")
        data = "".join(lines).encode()
        with self._lock:
            self.close()
            if read_if_exists(self.path) != data:  # a pull that changed nothing leaves it untouched
                write_bytes(self.path, data)

    def close(self) -> None:
        """Close the append handle (a later append opens it again)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Close the ledger and release the folder's lock."""
        self.close()
        if self._dir_fd is not None:
            os.close(self._dir_fd)  # closing the descriptor drops its flock
            self._dir_fd = None
