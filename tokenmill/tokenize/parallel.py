"""Process-parallel tokenization: inputs cut into byte ranges, one part file per range.

A plain ``.jsonl`` is cut into ranges on line boundaries; a compressed file, a Parquet/Arrow file
or a dataset folder is one range. Workers are forked after the encoder is loaded (they share its
pages), take ranges in ``schedule`` order from a shared counter and write each one's tokens to a
temp part in the output folder's ``.tmp/``; its lengths, counts, quarantined lines (range-local
numbers) and checker sample come back over a pipe (raw bytes and JSON, no pickles).
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import temp_path_for
from tokenmill.errors import BadRecordError, TokenmillError
from tokenmill.formats.shard_records import IngestStats
from tokenmill.ingest.records import Quarantine, read_jsonl_batches
from tokenmill.ingest.sources import read_input_batches
from tokenmill.tokenize.engines import Encoder
from tokenmill.tokenize.outputs import input_bytes
from tokenmill.tokenize.procs import SAMPLE_CHARS, SAMPLE_DOCS, fork

MIN_RANGE_BYTES = 4 << 20  # smaller ranges cost more in per-range overhead than they balance
MAX_RANGE_BYTES = 64 << 20
RANGES_PER_WORKER = 8  # ranges per worker on a big input: the last range to end is short
# A worker's read batch: each process faults in its working set (parsed texts, ids) once, about
# 10x this; at 4 MiB that was ~11k minor faults per worker, ~0.03 CPU-s each here.
BATCH_BYTES = 1 << 20
_SCAN = 1 << 16


@dataclass(frozen=True)
class InputRange:
    """One worker's share: input ``index``'s bytes ``[start, end)``, or all of it (None)."""

    index: int
    path: Path
    byte_range: tuple[int, int] | None
    size: int

    @property
    def first(self) -> bool:
        """Whether the range starts its input (its first documents are the checker's sample)."""
        return self.byte_range is None or self.byte_range[0] == 0


def splittable(path: Path) -> bool:
    """Plain JSONL files are cut into ranges; anything compressed or columnar is read whole."""
    return path.name.endswith(".jsonl") and path.is_file()


def plan_ranges(inputs: list[Path], workers: int) -> list[InputRange]:
    """The inputs as ranges in input order: about ``RANGES_PER_WORKER`` per worker over the
    plain files' bytes, each between ``MIN_RANGE_BYTES`` and ``MAX_RANGE_BYTES`` (a line longer
    than that makes its range longer)."""
    total = sum(p.stat().st_size for p in inputs if splittable(p))
    target = math.ceil(total / (workers * RANGES_PER_WORKER)) if total else 1
    target = max(MIN_RANGE_BYTES, min(MAX_RANGE_BYTES, target), 1)
    out: list[InputRange] = []
    for index, path in enumerate(inputs):
        if not splittable(path):
            out.append(InputRange(index, path, None, input_bytes(path)))
            continue
        size = path.stat().st_size
        bounds = [0, *_line_cuts(path, size, target), size]
        for start, end in itertools.pairwise(bounds):
            out.append(InputRange(index, path, (start, end), end - start))
    return out


def _line_cuts(path: Path, size: int, target: int) -> list[int]:
    """Offsets just after a newline, about ``target`` bytes apart, strictly inside the file."""
    cuts: list[int] = []
    with open(path, "rb") as fh:
        at = target
        while at < size:
            fh.seek(at - 1)  # a newline right before ``at`` makes ``at`` itself the cut
            pos = at - 1
            while (chunk := fh.read(_SCAN)) and (k := chunk.find(b"\n")) < 0:
                pos += len(chunk)
            if not chunk:
                break
            cut = pos + k + 1
            if cut >= size:
                break
            cuts.append(cut)
            at = cut + target
    return cuts


@dataclass
class RangeResult:
    """What a worker made of one range: its part file and lengths, or the error it hit."""

    index: int
    range: InputRange
    part: Path | None
    lengths: np.ndarray
    stats: dict[str, Any]
    routed: dict[str, int]
    bad: list[tuple[int, str, bytes]]  # (range-local line, reason, raw bytes)
    sample: list[str] | None
    error: dict[str, Any] | None


class _Spool(Quarantine):
    """A worker's bad lines, kept with their range-local numbers for the parent to renumber."""

    def __init__(self) -> None:
        super().__init__(os.devnull)
        self.lines: list[tuple[int, str, bytes]] = []

    def add(self, source: str, line: int, reason: str, raw: bytes) -> None:
        self.lines.append((line, reason, raw))
        self._count += 1


@dataclass(frozen=True)
class Job:
    """The parts of a run every worker shares (inherited at the fork)."""

    ranges: list[InputRange]
    order: list[int]  # range indices in the order workers take them
    parts: list[Path]  # per range: a temp of the final .bin (see ``part_paths``)
    text_key: str
    on_bad_record: str
    eod: int | None
    dtype: np.dtype


def part_paths(bin_path: Path, count: int) -> list[Path]:
    """Temp names in ``bin_path``'s ``.tmp/`` for ``count`` parts, named by this (the parent)
    process: a part is judged stale only once the run is gone, never while the parent may still
    stitch it, and the parent knows every name to remove on failure."""
    base = temp_path_for(bin_path)
    return [base.with_name(f"{base.name}{k:06x}") for k in range(count)]


def schedule(ranges: list[InputRange]) -> list[int]:
    """Whole inputs first (largest first), then the split ranges in input order."""
    whole = sorted((i for i, r in enumerate(ranges) if r.byte_range is None),
                   key=lambda i: (-ranges[i].size, i))  # fmt: skip
    return [*whole, *(i for i, r in enumerate(ranges) if r.byte_range is not None)]


def _tokenize_range(
    job: Job, encoder: Encoder, index: int, parent: int
) -> tuple[dict[str, Any], np.ndarray]:
    """Tokenize one range into its part file: the result's JSON header and the lengths."""
    rng = job.ranges[index]
    stats = IngestStats(path=str(rng.path))
    spool = _Spool() if job.on_bad_record == "quarantine" else None
    options: dict[str, Any] = {"quarantine": spool, "stats": stats}
    options.update(text_key=job.text_key, on_bad_record=job.on_bad_record)
    if rng.byte_range is None:
        batches = read_input_batches(rng.path, **options)
    else:
        batches = read_jsonl_batches(
            rng.path, byte_range=rng.byte_range, batch_bytes=BATCH_BYTES, **options
        )
    part = job.parts[index]
    fh = open(part, "wb")  # noqa: SIM115 - closed below
    lengths: list[np.ndarray] = []
    sample = None
    try:
        with fh:
            for batch in batches:
                if os.getppid() != parent:
                    os._exit(1)
                if rng.first and (sample is None or len(sample) < SAMPLE_DOCS):
                    room = SAMPLE_DOCS - len(sample or [])
                    sample = [*(sample or []), *(t[:SAMPLE_CHARS] for t in batch.texts[:room])]
                flat, lens = encoder.pack(batch.texts, job.eod, job.dtype)
                fh.write(np.ascontiguousarray(flat, dtype=job.dtype).data.cast("B"))
                lengths.append(lens)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    header = {
        "part": str(part),
        "stats": stats.to_dict(),
        "routed": dict(encoder.routed),
        "bad": [[n, why, base64.b64encode(raw).decode()] for n, why, raw in spool.lines]
        if spool is not None
        else [],
        "sample": sample,
    }
    encoder.routed.clear()
    return header, np.concatenate(lengths) if lengths else np.empty(0, np.int64)


def _worker(job: Job, encoder: Encoder, counter: Any, out: Any, parent: int) -> None:
    """Take ranges until none is left; each result is a JSON header and the lengths' bytes. A
    range that fails is reported and the next one taken: the parent raises the first failure in
    input order, as one process reading the inputs in order would."""
    while True:
        with counter.get_lock():
            k = counter.value
            counter.value = k + 1
        if k >= len(job.order):
            return
        index = job.order[k]
        try:
            header, lengths = _tokenize_range(job, encoder, index, parent)
        except BadRecordError as exc:
            error = {"kind": "bad_record", "path": exc.path, "line": exc.line, "reason": exc.reason}
        except Exception as exc:  # reported to the parent, which raises it
            error = {"kind": type(exc).__name__, "message": str(exc)}
        else:
            out.send_bytes(json.dumps({"range": index, **header}).encode())
            out.send_bytes(lengths.astype(np.int64).tobytes())
            continue
        out.send_bytes(json.dumps({"range": index, "error": error}).encode())


class RangeWorkers:
    """Forked workers tokenizing a ``Job``'s ranges; ``results`` hands them back in input order,
    ``close`` stops them and removes the parts nobody took (a killed worker's too)."""

    def __init__(self, job: Job, encoder: Encoder, processes: int, open_conns: list[Any]) -> None:
        ctx = multiprocessing.get_context("fork")
        self.job = job
        counter = ctx.Value("q", 0)
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for _ in range(processes):
            read, write = ctx.Pipe(duplex=False)
            proc = fork(_worker, (job, encoder, counter, write), [*self.conns, read, *open_conns])
            write.close()
            self.conns.append(read)
            self.procs.append(proc)
        self.pending: dict[int, RangeResult] = {}
        self.done = False

    def _receive(self, conn: Any) -> RangeResult | None:
        """The next result on ``conn``; None once its worker has exited normally."""
        try:
            header = json.loads(conn.recv_bytes())
            error = header.get("error")
            body = b"" if error else conn.recv_bytes()
        except EOFError:
            proc = self.procs[self.conns.index(conn)]
            proc.join()
            if proc.exitcode != 0:
                raise TokenmillError(
                    f"tokenize: worker process {proc.pid} died (exit code {proc.exitcode})"
                ) from None
            return None
        index = int(header["range"])
        bad = [(int(n), str(why), base64.b64decode(raw)) for n, why, raw in header.get("bad", ())]
        return RangeResult(
            index=index,
            range=self.job.ranges[index],
            part=Path(header["part"]) if not error else None,
            lengths=np.frombuffer(body, dtype=np.int64),
            stats=header.get("stats") or {},
            routed=header.get("routed") or {},
            bad=bad,
            sample=header.get("sample"),
            error=error,
        )

    def results(self) -> Iterator[RangeResult]:
        """Every range's result, in input order, as soon as it and all before it are in."""
        live = list(self.conns)
        for index in range(len(self.job.ranges)):
            while index not in self.pending:
                if not live:
                    raise TokenmillError("tokenize: the worker processes ended before range "
                                         f"{index} of {len(self.job.ranges)} was done")  # fmt: skip
                for conn in multiprocessing.connection.wait(live):
                    result = self._receive(conn)
                    if result is None:
                        live.remove(conn)
                    else:
                        self.pending[result.index] = result
            yield self.pending.pop(index)
        self.done = True

    def close(self) -> None:
        """Stop the workers (at once after an error), then remove parts nobody took."""
        for proc in self.procs:
            if not self.done:
                proc.terminate()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()
        self.pending.clear()
        for part in self.job.parts:  # taken ones are gone; the rest may be partly written
            part.unlink(missing_ok=True)
