"""A local mirror of an ``s3://`` storage root's records, for the commands that read a whole root
(``tokenmill find``, ``tokenmill takedown``) and write versions back to it.

:func:`local_root` yields the root itself when it is local; for ``s3://`` a temporary folder
holding every object except what no record reader needs (token ``.bin`` files, the HF export,
quarantine files, temps). It is an :class:`~tokenmill.storage.staging.S3Stage` of the whole
root, so local code runs unchanged on it and, with ``write=True``, what it wrote goes back as a
step's work does (pointers by compare-and-swap: ConflictError when another writer moved one
meanwhile; the immutable files already uploaded stay for ``tokenmill gc``). The mirror is
removed at the end, whatever happens.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tokenmill.atomic import is_temp
from tokenmill.paths import relative_path_problem
from tokenmill.storage import layout
from tokenmill.storage.staging import S3Stage

__all__ = ["SKIPPED_SUFFIXES", "local_root", "mirrored", "root_of_blend"]

# What no provenance or takedown step reads: token data, the HF export, quarantined lines.
SKIPPED_SUFFIXES = (".bin", ".quarantine.jsonl", ".lock")
SKIPPED_TOPS = ("hf",)


def mirrored(key: str) -> bool:
    """True for a key of the root that the mirror copies (see the module docstring)."""
    return not (
        is_temp(key)
        or key.endswith(SKIPPED_SUFFIXES)
        or key.split("/", 1)[0] in SKIPPED_TOPS
        or relative_path_problem(key) is not None
    )


@contextmanager
def local_root(root: str | os.PathLike[str], *, write: bool = False) -> Iterator[Path]:
    """The storage ``root`` as a local folder: itself when local; for ``s3://`` a mirror of its
    records (module docstring), pushed back on success when ``write`` and always removed."""
    uri = os.fspath(root)
    if not uri.startswith("s3://"):
        yield Path(uri)
        return
    local = Path(tempfile.mkdtemp(prefix="tokenmill-mirror-"))
    try:
        stage = S3Stage.open(uri, None, local)  # endpoint: the AWS environment's
        stage.mirror(mirrored)
        yield local
        if write:
            stage.push()
    finally:
        shutil.rmtree(local, ignore_errors=True)


def root_of_blend(uri: str) -> str | None:
    """The storage root of an ``s3://…/blends/<name>[/manifest.json]`` URI (None otherwise)."""
    if not uri.startswith("s3://"):
        return None
    parts = uri.rstrip("/").split("/")
    if parts[-1] == layout.BLEND_MANIFEST:
        parts = parts[:-1]
    if len(parts) < 5 or parts[-2] != layout.BLENDS:
        return None
    return "/".join(parts[:-2])
