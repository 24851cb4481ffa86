"""Writer-side I/O of ``.bin`` files: early disk writeback and in-kernel copies, with plain
writes where the file system refuses them. Imported lazily by ``IndexedDatasetWriter``, so a
reader (``tokenmill.loader``) never loads ``ctypes`` or a writeback thread."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import queue
import shutil
import sys
import threading
from typing import IO, Any

COPY_BLOCK = 16 << 20


_SYNC_FILE_RANGE: Any = None  # Linux only
if sys.platform.startswith("linux"):
    with contextlib.suppress(AttributeError, OSError):
        _SYNC_FILE_RANGE = ctypes.CDLL(None, use_errno=True).sync_file_range
_SYNC_FILE_RANGE_WRITE = 2


class Writeback:
    """Starts disk writeback of written ranges on a side thread (Linux ``sync_file_range``) from
    the first range to ``close``, so the final fsync has little left; elsewhere a no-op."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._ranges: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while (rng := self._ranges.get()) is not None:
            off, length = rng
            _SYNC_FILE_RANGE(
                self._fd, ctypes.c_longlong(off), ctypes.c_longlong(length), _SYNC_FILE_RANGE_WRITE
            )

    def add(self, offset: int, length: int) -> None:
        if _SYNC_FILE_RANGE is None:
            return
        if self._thread.ident is None:
            self._thread.start()
        self._ranges.put((offset, length))

    def close(self) -> None:
        if self._thread.is_alive():
            self._ranges.put(None)
            self._thread.join()


def append_part(src: IO[bytes], dst: IO[bytes], size: int, hasher: Any) -> None:
    """Append the first ``size`` bytes of ``src`` at the end of ``dst`` (``copy_file_range``, in
    the kernel), feeding them to ``hasher`` (when not None) from a map of ``src``, no copy into
    Python."""
    with mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ) as view:
        if hasher is not None:
            hasher.update(view)
        dst.flush()
        base = dst.seek(0, os.SEEK_END)
        off = 0
        with contextlib.suppress(OSError):  # EXDEV, ENOSYS, EINVAL: the plain write below
            while off < size:
                sent = os.copy_file_range(src.fileno(), dst.fileno(), size - off, off, base + off)
                if sent == 0:
                    break
                off += sent
        if off < size:
            dst.seek(base + off)
            dst.write(view[off:size])
            dst.flush()
        dst.seek(0, os.SEEK_END)


def copy_file(src: IO[bytes], dst: IO[bytes]) -> None:
    """Append ``src`` to ``dst`` in the kernel (``sendfile``) with early writeback; falls back
    to large-block copies where ``sendfile`` is not supported."""
    size = os.fstat(src.fileno()).st_size
    base = dst.seek(0, os.SEEK_END)
    off = 0
    writeback = Writeback(dst.fileno())
    try:
        while off < size:
            sent = os.sendfile(dst.fileno(), src.fileno(), off, min(size - off, COPY_BLOCK * 4))
            if sent == 0:
                break
            writeback.add(base + off, sent)
            off += sent
    except OSError:
        dst.truncate(base + off)
    finally:
        writeback.close()
    dst.seek(0, os.SEEK_END)
    if off < size:
        src.seek(off)
        shutil.copyfileobj(src, dst, COPY_BLOCK)
