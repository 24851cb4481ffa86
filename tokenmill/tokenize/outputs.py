"""Where a tokenize run's files go: kept when up to date, else staged and renamed into place.

A run whose manifest records its inputs and byte settings, beside files of the recorded sizes
and sha256s, writes nothing. Else it writes into a staging folder of its own in ``<dir>/.tmp/``
(a killed run's is removed by the next) and :meth:`Outputs.commit` renames the files over the
old ones, manifest last: a reader meets the old complete pair or the new one. Check and renames
hold the output's ``flock`` (``<dir>/.tmp/<name>.lock``, released by the kernel when the holder
dies): two runs of one shard never interleave, and the later one finding the same files touches
nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import (
    commit,
    create_temp,
    fsync_dir,
    read_if_exists,
    remove_stale_temps,
    temp_dir,
)
from tokenmill.errors import FormatError
from tokenmill.formats.dataset_manifest import (
    dataset_manifest_path,
    file_problems,
    input_files,
    input_sha256,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import data_file_path, index_file_path, optimal_dtype
from tokenmill.formats.nanoset_cache import exclusive_lock
from tokenmill.tokenize.tokenizer_info import TokenizerInfo

log = logging.getLogger(__name__)
LOCK_SUFFIX = ".lock"
# the counts a tokens manifest records, every one an int (a run reusing the pair reports them)
COUNTS = ("documents", "sequences", "tokens", "quarantined", "blank", "lines", "empty_documents")


def byte_settings(info: TokenizerInfo, text_key: str, append_eod: bool) -> dict[str, Any]:
    """The manifest's config entries the output bytes depend on (the engine does not: every
    engine gives the reference's ids)."""
    return facts_settings(info.fingerprint, info.vocab_size, info.eod_id, text_key, append_eod)


def facts_settings(
    fingerprint: str, vocab_size: int, eod_id: int | None, text_key: str, append_eod: bool
) -> dict[str, Any]:
    """``byte_settings`` from the tokenizer's facts (a manifest's, before any verification)."""
    return {
        "tokenizer_fingerprint": fingerprint,
        "dtype": np.dtype(optimal_dtype(vocab_size)).name,
        "text_key": text_key,
        "append_eod": append_eod,
        "vocab_size": vocab_size,
        "eod_id": eod_id,
    }


def input_bytes(path: Path) -> int:
    """Stored bytes of an input file or dataset folder (0 for one that is missing)."""
    return sum(p.stat().st_size for p in input_files(path) if p.exists())


@dataclass(frozen=True)
class Outputs:
    """One run's outputs: the pair at ``prefix`` with its manifest, and the quarantine file."""

    prefix: Path
    qpath: Path

    @property
    def manifest_path(self) -> Path:
        """The pair's manifest (``manifests/<name>.manifest.json``)."""
        return dataset_manifest_path(self.prefix)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the output's exclusive lock, ``<dir>/.tmp/<name>.lock``."""
        with exclusive_lock(temp_dir(self.prefix.parent) / f"{self.prefix.name}{LOCK_SUFFIX}"):
            yield

    def manifest_bytes(self) -> bytes | None:
        """The manifest as it is now; None when there is none."""
        return read_if_exists(self.manifest_path)

    def up_to_date(
        self, inputs: list[Path], uris: list[str], settings: dict[str, Any], on_bad_record: str
    ) -> dict[str, Any] | None:
        """The manifest when it records exactly these inputs (uri, size, sha256), ``settings`` and
        int counts, beside a pair of the recorded sizes and sha256s and the quarantine file its
        bad lines need; None when the run must write. Files are hashed last."""
        if not self.manifest_path.is_file():
            return None
        try:
            manifest = read_dataset_manifest(self.prefix)
        except FormatError as exc:
            log.warning("%s; tokenizing anew to replace it", exc)
            return None
        config, recorded = manifest.get("config"), manifest.get("inputs")
        if manifest.get("kind") != "tokens" or not isinstance(config, dict):
            return None
        if any(config.get(key) != value for key, value in settings.items()):
            return None
        if not isinstance(recorded, list) or len(recorded) != len(inputs):
            return None
        if any(
            not isinstance(entry, dict)
            or entry.get("uri") != uri
            or entry.get("bytes") != input_bytes(path)
            for entry, uri, path in zip(recorded, uris, inputs, strict=True)
        ):
            return None
        counts = manifest["counts"]  # a mapping (read_dataset_manifest checked)
        if any(type(counts.get(key)) is not int for key in COUNTS):  # hand-edited: rewrite
            return None
        quarantined = counts["quarantined"]
        if quarantined and (on_bad_record != "quarantine" or not self.qpath.is_file()):
            return None
        if file_problems(self.prefix, manifest, full=True):  # a damaged pair is rewritten
            return None
        if any(
            entry.get("sha256") != input_sha256(path)
            for entry, path in zip(recorded, inputs, strict=True)
        ):
            return None
        return manifest

    def stage(self) -> Outputs:
        """A new staging folder of this run's own in ``<dir>/.tmp/`` (the folders of killed
        runs removed first), as the outputs to write there under the same names."""
        remove_stale_temps(self.prefix)
        folder, _ = create_temp(self.prefix, Path.mkdir)
        return Outputs(folder / self.prefix.name, folder / self.qpath.name)

    def commit(self, staged: Outputs, manifest: dict[str, Any]) -> bool:
        """Rename the finished ``staged`` files over these, the manifest last (an old one that
        vouches for other content goes first: no manifest names bytes it does not describe);
        False, touching nothing, when another run already put these very files here. Call
        under :meth:`locked`."""
        new = staged.manifest_path.read_bytes()
        if (
            self.manifest_bytes() == new
            and staged.qpath.is_file() == self.qpath.is_file()
            and not file_problems(self.prefix, manifest, full=True)
        ):
            return False
        try:
            same = read_dataset_manifest(self.prefix)["content_hash"] == manifest["content_hash"]
        except FormatError:  # no old manifest, or a damaged one: it vouches for nothing
            same = False
        if not same:
            self._drop_manifest()
        commit(data_file_path(staged.prefix), data_file_path(self.prefix))
        commit(index_file_path(staged.prefix), index_file_path(self.prefix))
        if staged.qpath.is_file():
            commit(staged.qpath, self.qpath)
        else:
            self.qpath.unlink(missing_ok=True)  # no file means no bad lines
        self.manifest_path.parent.mkdir(exist_ok=True)
        commit(staged.manifest_path, self.manifest_path)
        return True

    def clear(self) -> None:
        """Remove the pair and quarantine file, manifest first, so nothing looks complete."""
        self._drop_manifest()
        for path in (index_file_path(self.prefix), data_file_path(self.prefix), self.qpath):
            path.unlink(missing_ok=True)

    def _drop_manifest(self) -> None:
        """Remove the manifest and fsync ``manifests/`` before any pair file changes: a crash
        never leaves it describing other bytes."""
        try:
            self.manifest_path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.manifest_path.parent)
