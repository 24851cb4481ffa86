"""The quarantine file of a shard: bad input lines with their reasons, written atomically, and
the likely cause read back when a whole shard was quarantined."""

from __future__ import annotations

import base64
import contextlib
import json
import os
from pathlib import Path
from typing import IO

from tokenmill.atomic import CommitOnExit, commit, create_temp, discard_temp, name_os_errors


class Quarantine(CommitOnExit):
    """Collects bad lines (source path, 1-based line, reason, raw bytes) and writes them atomically.

    Spooled to a temporary sibling of ``path`` (bounded memory); each line is ``{"line", "raw_b64",
    "reason", "source"}`` with sorted keys, ``raw_b64`` the line's bytes without its ``\\n`` (a
    ``\\r`` and a first-line BOM kept). As a context manager: committed on a clean exit.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._tmp: Path | None = None
        self._fh: IO[bytes] | None = None
        self._count = 0
        self._finished = False

    def add(self, source: str, line: int, reason: str, raw: bytes) -> None:
        """Append one bad line."""
        fh = self._fh if self._fh is not None else self._open()
        record = {
            "line": line,
            "raw_b64": base64.b64encode(raw).decode("ascii"),
            "reason": reason,
            "source": str(source),
        }
        with name_os_errors(self.path):
            fh.write(json.dumps(record, sort_keys=True).encode("ascii") + b"\n")
        self._count += 1

    @property
    def count(self) -> int:
        """Number of lines added so far."""
        return self._count

    def commit(self) -> None:
        """Write ``path`` atomically when a line was quarantined. With none, nothing is written
        and a previous run's file is removed: no file means no bad lines (the counts say 0)."""
        if self._count == 0:
            self.discard()
            self.path.unlink(missing_ok=True)
            return
        fh = self._fh if self._fh is not None else self._open()
        with name_os_errors(self.path):
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
        self._fh = None
        if self._tmp is not None:
            commit(self._tmp, self.path)
            self._tmp = None
        self._finished = True

    def discard(self) -> None:
        """Drop everything collected; ``path`` is left untouched."""
        discard_temp(self._fh, self._tmp)
        self._fh, self._tmp = None, None
        self._finished = True

    def finalize(self) -> None:
        """``commit`` unless already committed or discarded (a clean exit from ``with``)."""
        if not self._finished:
            self.commit()

    abort = discard  # an exception in ``with``

    def _open(self) -> IO[bytes]:
        if self._finished:
            raise ValueError(f"{self.path}: quarantine already committed or discarded")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp, fh = create_temp(self.path, lambda t: open(t, "wb"))  # noqa: SIM115 - commit/discard close it
        self._tmp, self._fh = tmp, fh
        return fh


def quarantine_cause(path: str | os.PathLike[str], text_key: str, sample: int = 5) -> str:
    """The likely cause when every record of a shard was quarantined, read from the first
    ``sample`` records of its quarantine file: the text key against the keys those records
    have (a wrong ``text_key`` is the usual one), else the first record's reason."""
    keys: dict[str, None] = {}
    reasons: list[str] = []
    with open(path, "rb") as fh:
        for _, line in zip(range(sample), fh, strict=False):
            entry = json.loads(line)
            reasons.append(str(entry["reason"]))
            with contextlib.suppress(ValueError, RecursionError):
                record = json.loads(base64.b64decode(entry["raw_b64"]))
                keys.update(dict.fromkeys(map(str, record) if isinstance(record, dict) else ()))
    if keys and text_key not in keys:
        shown = ", ".join(sorted(keys)[:20]) + (", …" if len(keys) > 20 else "")
        return f"text_key {text_key!r} not found; the first records have keys: {shown}"
    return f"the first record's reason: {reasons[0]}" if reasons else "no record was read"
