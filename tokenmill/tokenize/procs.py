"""Processes and threads behind ``tokenmill.tokenize.run``: forked children (range workers and
the reference checker) and ``Background`` stages that overlap reading, encoding and writing.

Children are forked after the tokenizer is loaded (shared pages), close the parent's pipe ends
they inherit and exit when the parent disappears (polled each second): a killed run leaves no
orphans.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from tokenmill.errors import TokenmillError
from tokenmill.tokenize.engines import Encoder, reference_encoder
from tokenmill.tokenize.tokenizer import first_mismatch
from tokenmill.tokenize.tokenizer_info import TokenizerInfo

T = TypeVar("T")
SAMPLE_DOCS = 64  # documents per input compared with the reference
SAMPLE_CHARS = 2048  # characters of each sampled document the checker compares
RUN_END = "end"  # a run's last message to the checker: answer now


class EngineMismatch(Exception):
    """The checker saw the engine disagree with the reference."""


def fork(target: Any, args: tuple[Any, ...], foreign: list[Any]) -> Any:
    """Start ``target(*args, parent_pid)`` in a forked child that first closes ``foreign``, the
    parent's pipe ends it inherits: it then sees EOF/EPIPE when the parent goes away."""
    proc = multiprocessing.get_context("fork").Process(
        target=_child, args=(target, args, foreign, os.getpid()), daemon=True
    )
    proc.start()
    return proc


def _child(target: Any, args: tuple[Any, ...], foreign: list[Any], parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the handler the parent may have set
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


def _check_worker(info: TokenizerInfo, conn: Any, parent: int) -> None:
    """Checker process: load the reference, then compare each submitted sample's engine ids;
    answer ``""`` at each run's end (and wait for the next run's samples), a mismatch at once
    (and stop). Ends when the parent closes its end."""
    # The reference encodes each sample on every core (tokenizers' pool, made in this process):
    # one process checks every input's sample, and with many inputs on many cores it was the
    # run's last step (16 inputs: 0.55 s on one core, 0.32 s on two). A pool the parent used
    # before the fork stays off here (tokenizers' own fork guard).
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    reference = reference_encoder(info)
    while True:
        item = _receive(conn, parent)
        if item is None:
            return
        if item == RUN_END:
            with contextlib.suppress(OSError):
                conn.send("")
            continue
        label, texts, got = item
        mismatch = first_mismatch(texts, reference.encode(texts), got)
        if mismatch is not None:
            conn.send(f"{label} document {mismatch[0] + 1}: {mismatch[1]}")
            return


class Checker:
    """The run's sample check against the reference, in a forked process (off the hot path).
    Samples go through a sender thread, as the checker reads them only once its reference has
    loaded; after a pass it serves a session's next run (:meth:`reuse`)."""

    def __init__(self, info: TokenizerInfo) -> None:
        self.conn, child = multiprocessing.get_context("fork").Pipe()
        self.proc = fork(_check_worker, (info, child), [self.conn])
        child.close()
        self.answer: str | None = None
        self.outbox: queue.Queue[Any] = queue.Queue()
        self.sender: threading.Thread | None = None
        self.idle = False  # between two runs of a session: nothing submitted yet

    def _send_all(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            with contextlib.suppress(OSError):  # the checker stopped early to report
                self.conn.send(item)
            if item == RUN_END:
                return

    def _post(self, item: Any) -> None:
        self.idle = False
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
            self._post(RUN_END)
        if self.answer is None and (wait or self.conn.poll()):
            try:
                self.answer = self.conn.recv()
            except EOFError:
                raise TokenmillError("tokenize: the engine check process died") from None
        if self.answer:
            raise EngineMismatch(self.answer)

    def reuse(self) -> bool:
        """Ready the checker for another run after this one passed, its sender thread ended (no
        thread of ours lives across the next run's forks); False when it cannot serve again."""
        if self.answer != "" or not self.proc.is_alive():
            return False
        if self.sender is not None:
            self.sender.join()
            self.sender = None
        self.answer = None
        self.idle = True
        return True

    def close(self) -> None:
        """Stop the checker (on an error path at once; idle, it ends when its pipe closes)."""
        if self.answer is None and not self.idle:
            self.proc.terminate()
        if self.sender is not None:
            self.outbox.put(None)
            self.sender.join()
        self.conn.close()
        self.proc.join()


class Background(Generic[T]):
    """Runs an iterator on a daemon thread, at most ``depth`` items ahead of the consumer;
    iterating yields its items and re-raises its exception. ``close`` stops it after the item in
    progress, closing the iterator on its own thread so a nested ``Background`` stops too."""

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
