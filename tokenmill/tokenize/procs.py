"""Processes and threads behind ``tokenmill.tokenize.run``: forked encoder workers, the reference
checker, and ``Background`` stages that overlap reading, encoding and writing in one process.

Children are forked after the tokenizer is loaded (no reload, shared pages), close the parent's
pipe ends they inherit, and exit by themselves when the parent disappears (polled once a
second), so a killed run leaves no orphans.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from tokenmill.errors import TokenmillError
from tokenmill.tokenize.tokenizer import Encoder, TokenizerInfo, first_mismatch, reference_encoder

IN_FLIGHT = 2  # batches queued per worker process
T = TypeVar("T")
SAMPLE_CHARS = 2048  # characters of each sampled document the checker compares


class EngineMismatch(Exception):
    """The checker saw the engine disagree with the reference."""


def _fork(target: Any, args: tuple[Any, ...], foreign: list[Any]) -> Any:
    """Start ``target(*args, parent_pid)`` in a forked child that first closes ``foreign``.

    ``foreign`` are the parent's pipe ends the child inherits; closing them lets the child see
    EOF/EPIPE when the parent goes away instead of holding its own pipes open.
    """
    proc = multiprocessing.get_context("fork").Process(
        target=_child, args=(target, args, foreign, os.getpid()), daemon=True
    )
    proc.start()
    return proc


def _child(target: Any, args: tuple[Any, ...], foreign: list[Any], parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    for conn in foreign:
        conn.close()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    target(*args, parent)


def _receive(conn: Any, parent: int) -> Any:
    """The next message, or None at EOF; exits quietly if the parent process died meanwhile."""
    while not conn.poll(1.0):
        if os.getppid() != parent:
            os._exit(1)
    try:
        return conn.recv()
    except EOFError:
        return None


def _worker(
    encoder: Encoder, dtype: np.dtype, eod: int | None, tasks: Any, out: Any, parent: int
) -> None:
    while True:
        texts = _receive(tasks, parent)
        if texts is None:
            return
        try:
            flat, lengths = encoder.pack(texts, eod, dtype)
        except Exception as exc:  # reported to the parent, which raises it
            out.send_bytes(b"E" + f"{type(exc).__name__}: {exc}".encode())
            return
        out.send_bytes(b"K" + lengths.tobytes())
        out.send_bytes(flat)
        out.send_bytes(json.dumps(encoder.routed).encode())  # this batch's guard counts
        encoder.routed.clear()


class Pool:
    """Forked encoder processes, fed round-robin by a reader thread, drained in input order.

    The documents the workers' guards send to the reference are added to ``encoder.routed``.
    """

    def __init__(
        self,
        encoder: Encoder,
        workers: int,
        dtype: np.dtype,
        eod: int | None,
        open_conns: list[Any],
    ) -> None:
        ctx = multiprocessing.get_context("fork")
        self.encoder = encoder
        self.dtype = dtype
        self.tasks: list[Any] = []
        self.results: list[Any] = []
        self.procs: list[Any] = []
        for _ in range(workers):
            task_r, task_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            foreign = [*self.tasks, *self.results, task_w, res_r, *open_conns]
            proc = _fork(_worker, (encoder, dtype, eod, task_r, res_w), foreign)
            task_r.close()
            res_w.close()
            self.tasks.append(task_w)
            self.results.append(res_r)
            self.procs.append(proc)
        self.slots = threading.Semaphore(IN_FLIGHT * workers)
        self.tickets: queue.Queue[Any] = queue.Queue()
        self.stopping = False
        self.done = False

    def _feed(self, batches: Iterator[list[str]]) -> None:
        try:
            for k, texts in enumerate(batches):
                self.slots.acquire()
                if self.stopping:
                    return
                worker = k % len(self.tasks)
                self.tasks[worker].send(texts)
                self.tickets.put(worker)
            self.tickets.put(None)
        except BaseException as exc:  # handed to the consuming thread
            self.tickets.put(exc)

    def map(self, batches: Iterator[list[str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Encoded batches in input order; errors of the reader or a worker are re-raised."""
        feeder = threading.Thread(target=self._feed, args=(batches,), daemon=True)
        feeder.start()
        while (ticket := self.tickets.get()) is not None:
            if isinstance(ticket, BaseException):
                raise ticket
            conn = self.results[ticket]
            try:
                head = conn.recv_bytes()
                body = conn.recv_bytes() if head[:1] == b"K" else b""
                routed = conn.recv_bytes() if head[:1] == b"K" else b"{}"
            except EOFError:
                raise TokenmillError(f"tokenize: encoder process {ticket} died") from None
            if head[:1] != b"K":
                raise TokenmillError(f"tokenize: encoder process failed: {head[1:].decode()}")
            self.slots.release()
            self.encoder.routed.update(json.loads(routed))
            yield np.frombuffer(body, dtype=self.dtype), np.frombuffer(head[1:], dtype=np.int64)
        feeder.join()
        self.done = True

    def close(self) -> None:
        """Stop the workers: politely after a complete run, at once after an error."""
        self.stopping = True
        self.slots.release()
        for conn, proc in zip(self.tasks, self.procs, strict=True):
            if self.done:
                conn.send(None)
            else:
                proc.terminate()
        for conn, proc in zip(self.tasks, self.procs, strict=True):
            proc.join()
            conn.close()
        for conn in self.results:
            conn.close()


def _check_worker(info: TokenizerInfo, conn: Any, parent: int) -> None:
    """Checker process: load the reference, then compare each submitted sample's engine ids."""
    reference = reference_encoder(info)
    while True:
        item = _receive(conn, parent)
        if item is None:
            with contextlib.suppress(OSError):
                conn.send("")
            return
        label, texts, got = item
        mismatch = first_mismatch(texts, reference.encode(texts), got)
        if mismatch is not None:
            conn.send(f"{label} document {mismatch[0] + 1}: {mismatch[1]}")
            return


class Checker:
    """The run's sample check against the reference, in a forked process (off the hot path).

    Samples go through a sender thread: the checker reads them only once its reference has
    loaded, and the reader must not wait for that.
    """

    def __init__(self, info: TokenizerInfo) -> None:
        self.conn, child = multiprocessing.get_context("fork").Pipe()
        self.proc = _fork(_check_worker, (info, child), [self.conn])
        child.close()
        self.answer: str | None = None
        self.outbox: queue.Queue[Any] = queue.Queue()
        self.sender: threading.Thread | None = None

    def _send_all(self) -> None:
        while True:
            item = self.outbox.get()
            with contextlib.suppress(OSError):  # the checker stopped early to report
                self.conn.send(item)
            if item is None:
                return

    def _post(self, item: Any) -> None:
        if self.sender is None:  # started late, after any fork of encoder processes
            self.sender = threading.Thread(target=self._send_all, daemon=True)
            self.sender.start()
        self.outbox.put(item)

    def submit(self, path: Path, texts: list[str], encoder: Encoder) -> None:
        """Queue an input's first documents (cut to SAMPLE_CHARS) with the engine's ids."""
        if self.answer is None:
            sample = [t[:SAMPLE_CHARS] for t in texts]
            self._post((str(path), sample, encoder.encode(sample)))

    def verdict(self, *, wait: bool) -> None:
        """Raise EngineMismatch once the checker reported one (blocking when ``wait``)."""
        if self.answer is None and wait:
            self._post(None)
        if self.answer is None and (wait or self.conn.poll()):
            try:
                self.answer = self.conn.recv()
            except EOFError:
                raise TokenmillError("tokenize: the engine check process died") from None
        if self.answer:
            raise EngineMismatch(self.answer)

    def close(self) -> None:
        """Stop the checker: it has answered on success; on an error path it is not needed."""
        if self.answer is None:
            self.proc.terminate()
        if self.sender is not None:
            self.outbox.put(None)
            self.sender.join()
        self.conn.close()
        self.proc.join()


class Background(Generic[T]):
    """Runs an iterator on a daemon thread, at most ``depth`` items ahead of the consumer.

    Iterating yields its items in order and re-raises its exception; ``close`` (also when the
    consumer stops early) stops it after the item in progress and joins the thread, closing the
    iterator on its own thread so a nested ``Background`` stops too.
    """

    def __init__(self, items: Iterator[T], depth: int = 2) -> None:
        self._items = items
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._items:
                if not self._put(("item", item)):
                    break
            else:
                self._put(("end", None))
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put(("error", exc))
        finally:
            close = getattr(self._items, "close", None)
            if close is not None:
                close()

    def _put(self, message: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[T]:
        try:
            while True:
                kind, item = self._queue.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Stop the producer and wait for its thread."""
        self._stop.set()
        self._thread.join()
