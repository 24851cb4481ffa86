"""Virtual merges: writer, checks and reader; over 400 lines: one format's parts stay together.

A virtual merge of shard pairs is read as the physical merge (Megatron ``merge_datasets.py``) of
the same pairs in the same order, with nothing copied: sequence ``i`` is sequence
``i - first_sequence[k]`` of shard ``k``. Its only file is the manifest, where a pair's would be
(``<dir>/manifests/<name>.manifest.json``; docs/formats.md has the details)::

    {"format_version": 2, "kind": "virtual_merge", "prefix": "<name>",
     "dtype": "uint16", "config": {...provenance of the shards...}, "extends": "<v>" | null,
     "counts": {"documents", "sequences", "tokens", "quarantined"},
     "shards": [{"key", "prefix" (relative to <dir>), "content_hash",
                 "documents", "sequences", "tokens", "masked": [ordinal, ...] (optional),
                 "files": {"bin": {"bytes", "sha256", "block_bytes", "block_list_sha256"},
                           "idx": {"bytes", "sha256"}}}, ...],
     "takedown": {"lists", "removed", "records"} (optional),
     "files": {}, "content_hash": sha256 over the shards' content hashes (and masks) in order}

Readers open and size-check a shard's pair only when a sample reads it. Version 2 keeps each
shard's per-block sha256 list in the shard's own manifest and records only its digest
(``block_list_digest``), so a merge of thousands of shards opens in milliseconds; version 1
(lists inline) still opens. ``masked`` (takedowns) lists a shard's taken-down document ordinals:
sequence ids do not move, indices leave them out, and the content hash covers them.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import file_sha256, write_json
from tokenmill.errors import FormatError
from tokenmill.formats.indexed import IndexedDataset, data_file_path, index_file_path
from tokenmill.paths import has_control_character, leading_parents

KIND = "virtual_merge"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: block lists inline (read, never written)
SHARD_COUNTS = ("documents", "sequences", "tokens")


def content_hash(shard_hashes: Sequence[str], masks: Sequence[Sequence[int]] = ()) -> str:
    """The content hash of a virtual merge: sha256 over its shards' content hashes in order,
    then each non-empty mask (``masks[k]``: shard k's masked ordinals); without masks the hash
    is the unmasked merge's."""
    h = hashlib.sha256(KIND.encode() + b"\0")
    for value in shard_hashes:
        h.update(value.encode() + b"\0")
    for k, ordinals in enumerate(masks):
        if len(ordinals):
            h.update(f"masked:{k}:".encode() + ",".join(str(int(o)) for o in ordinals).encode())
            h.update(b"\0")
    return h.hexdigest()


def shard_masks(shards: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Each shard record's masked ordinals (empty when it has none)."""
    return [[int(o) for o in s.get("masked") or []] for s in shards]


def masked_sequences(manifest: dict[str, Any]) -> np.ndarray:
    """The global sequence ids a virtual merge masks, ascending (int64; empty for a manifest
    without masks, e.g. a pair's)."""
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not any(s.get("masked") for s in shards):
        return np.zeros(0, dtype=np.int64)
    first = np.cumsum([0] + [int(s["sequences"]) for s in shards])
    parts = [np.asarray(m, dtype=np.int64) + first[k] for k, m in enumerate(shard_masks(shards))]
    return np.concatenate(parts)


def shard_entry(key: str, prefix: Path, base: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """One shard's record from its pair's dataset manifest (no file is read but the manifest)."""
    counts = manifest["counts"]
    files = manifest["files"]
    digests = {}
    for kind, path in (("bin", data_file_path(prefix)), ("idx", index_file_path(prefix))):
        info = files[path.name]
        if "sha256" not in info:
            raise FormatError(prefix, "files", "a virtual merge takes tokenized shards, not merges")
        digests[kind] = _by_reference(info)
    return {
        "key": key,
        "prefix": os.path.relpath(prefix, base),
        "content_hash": str(manifest["content_hash"]),
        **{c: int(counts[c]) for c in SHARD_COUNTS},
        "files": digests,
    }


def block_list_digest(hashes: Sequence[str]) -> str:
    """What a version-2 merge records of a file's per-block sha256 list: sha256 of the hex
    digests joined by newlines (the reader checks a list fetched later against it)."""
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def _by_reference(info: dict[str, Any]) -> dict[str, Any]:
    """A file's record as a version-2 merge keeps it: bytes and sha256, and of its block list
    (inline in ``info``, as a dataset manifest or a version-1 merge has it) only the block
    size and the list's digest."""
    out: dict[str, Any] = {"bytes": int(info["bytes"]), "sha256": str(info["sha256"])}
    if "block_sha256" in info or "block_list_sha256" in info:
        out["block_bytes"] = int(info["block_bytes"])
        inline = [str(h) for h in info.get("block_sha256", ())]
        out["block_list_sha256"] = (
            block_list_digest(inline) if "block_sha256" in info else str(info["block_list_sha256"])
        )
    return out


def write_virtual_manifest(
    path: Path,
    *,
    name: str,
    shards: list[dict[str, Any]],
    dtype: str,
    config: dict[str, Any],
    quarantined: int,
    extends: str | None,
    takedown: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the manifest of a virtual merge atomically (the only file it has); ``takedown``:
    what masked its shards' ``masked`` documents (module docstring)."""
    shards = [  # block lists by reference (a version-1 record given is slimmed)
        {**s, "files": {kind: _by_reference(info) for kind, info in s["files"].items()}}
        for s in shards
    ]
    counts = {c: sum(int(s[c]) for s in shards) for c in SHARD_COUNTS}
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "prefix": name,
        "dtype": dtype,
        "config": config,
        "extends": extends,
        "counts": {**counts, "quarantined": int(quarantined)},
        "shards": shards,
        "files": {},
        "content_hash": content_hash([s["content_hash"] for s in shards], shard_masks(shards)),
    }
    if takedown is not None:
        manifest["takedown"] = takedown
    check_manifest(path, manifest)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, manifest)
    return manifest


def is_virtual(manifest: dict[str, Any]) -> bool:
    """True for the manifest of a virtual merge."""
    return manifest.get("kind") == KIND


def is_count(value: object) -> bool:
    """True for an integer >= 0 (not a bool)."""
    return type(value) is int and value >= 0


def is_digest(info: object) -> bool:
    """True for ``{bytes: int >= 0, sha256: str, ...}``."""
    return (
        isinstance(info, dict)
        and is_count(info.get("bytes"))
        and isinstance(info.get("sha256"), str)
    )


def check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """FormatError for a virtual-merge manifest of the wrong shape: counts that do not add up,
    a shard prefix that is absolute or climbs out after a folder name, a dtype that is no token
    dtype, a content hash that is not the hash of the shards'."""
    version = manifest.get("format_version", 1)
    if version not in READABLE_VERSIONS:
        raise FormatError(
            path, "format_version", f"{version!r}; this reader opens {list(READABLE_VERSIONS)}"
        )
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        raise FormatError(path, "shards", "expected a non-empty list of shard records")
    try:
        dtype = np.dtype(str(manifest.get("dtype")))
    except TypeError as exc:
        raise FormatError(path, "dtype", f"{manifest.get('dtype')!r} is not a dtype") from exc
    if dtype.kind not in "iu":
        raise FormatError(path, "dtype", f"{dtype} is not a token dtype")
    for i, shard in enumerate(shards):
        where = f"shards[{i}]"
        if not isinstance(shard, dict):
            raise FormatError(path, where, f"expected a mapping, found {shard!r:.80}")
        prefix = shard.get("prefix")
        if (
            not isinstance(prefix, str)
            or not prefix
            or prefix.startswith("/")
            or has_control_character(prefix)
            or leading_parents(prefix) is None
        ):
            raise FormatError(path, f"{where}.prefix", f"{prefix!r} is not a relative pair path")
        if not all(is_count(shard.get(c)) for c in SHARD_COUNTS):
            raise FormatError(path, where, f"counts {SHARD_COUNTS} must be integers >= 0")
        files: Any = shard.get("files")
        ok = isinstance(files, dict) and sorted(files) == ["bin", "idx"]
        if not ok or not all(map(is_digest, files.values())):
            raise FormatError(path, f"{where}.files", f"expected bin/idx digests, found {files!r}")
        for kind in ("bin", "idx"):
            _check_blocks(path, f"{where}.files.{kind}", shard["files"][kind], inline=version == 1)
        if not isinstance(shard.get("content_hash"), str) or not isinstance(shard.get("key"), str):
            raise FormatError(path, where, "key and content_hash must be strings")
        _check_mask(path, where, shard)
    counts = manifest.get("counts")
    if not isinstance(counts, dict) or any(
        counts.get(c) != sum(s[c] for s in shards) for c in SHARD_COUNTS
    ):
        raise FormatError(path, "counts", "do not add up to the shards' counts")
    hashes = [s["content_hash"] for s in shards]
    if manifest.get("content_hash") != content_hash(hashes, shard_masks(shards)):
        raise FormatError(path, "content_hash", "is not the hash of the shards' content hashes")
    extends = manifest.get("extends")
    if extends is not None and not isinstance(extends, str):
        raise FormatError(path, "extends", f"expected a version or null, found {extends!r}")


def _check_blocks(path: Path, where: str, info: dict[str, Any], *, inline: bool) -> None:
    """FormatError for a file record whose block fields are malformed: a block list inline in
    a version-2 merge (it holds only references), or a reference without its block size."""
    if "block_sha256" in info and not inline:
        raise FormatError(path, where, "a version-2 merge records no block_sha256 list")
    if "block_list_sha256" in info or "block_sha256" in info:
        size = info.get("block_bytes")
        if not is_count(size) or not size:
            raise FormatError(path, f"{where}.block_bytes", f"{size!r} is not a block size")
    digest = info.get("block_list_sha256")
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64):
        raise FormatError(path, f"{where}.block_list_sha256", f"{digest!r} is not a sha256")


def _check_mask(path: Path, where: str, shard: dict[str, Any]) -> None:
    """FormatError for a ``masked`` list that is not sorted unique ordinals of the shard's
    documents, or one in a shard of more sequences than documents."""
    masked = shard.get("masked")
    if masked is None:
        return
    ok = isinstance(masked, list) and all(is_count(o) for o in masked)
    if not ok or any(b <= a for a, b in itertools.pairwise(masked)):
        raise FormatError(path, f"{where}.masked", "expected ascending unique ordinals")
    if masked and (masked[-1] >= shard["documents"] or shard["sequences"] != shard["documents"]):
        raise FormatError(
            path,
            f"{where}.masked",
            f"ordinals must lie below the shard's {shard['documents']} documents, one sequence "
            "each",
        )


def shard_problems(
    base: Path,
    manifest: dict[str, Any],
    *,
    full: bool,
    shards: range | None = None,
    kinds: tuple[str, ...] = ("bin", "idx"),
) -> list[str]:
    """Shard files (of ``kinds``) that differ from the manifest's records: sizes; ``full``
    also the sha256."""
    problems = []
    records = manifest["shards"]
    for i in shards if shards is not None else range(len(records)):
        shard = records[i]
        prefix = os.path.join(base, shard["prefix"])  # strings, one stat per file: O(shards)
        for kind in kinds:
            path = f"{prefix}.{kind}"
            info = shard["files"][kind]
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                problems.append(f"{path}: missing (shard {shard['key']!r} of the merge)")
                continue
            size = st.st_size
            if size != info["bytes"]:
                problems.append(
                    f"{path}: {size} bytes, the merge recorded {info['bytes']} "
                    f"(shard {shard['key']!r} changed after the merge)"
                )
            elif full and file_sha256(path) != info["sha256"]:
                problems.append(f"{path}: sha256 differs from the merge's record")
    return problems


def _without_block_lists(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest without its shards' per-block sha256 lists (a version-1 merge): what a
    reader keeps (the lists are megabytes of strings for a large merge)."""
    if manifest.get("format_version", 1) != 1:
        return manifest  # holds none
    shards = [
        {
            **shard,
            "files": {
                kind: {k: v for k, v in info.items() if k != "block_sha256"}
                for kind, info in shard["files"].items()
            },
        }
        for shard in manifest["shards"]
    ]
    return {**manifest, "shards": shards}


class VirtualDataset:
    """A virtual merge read as one dataset, with the reading surface of ``IndexedDataset``:
    ``len``, ``dtype``, counts, ``lengths_of``/``locate``/``buffer`` for sample reads, and
    ``sequence_lengths``/``document_indices`` assembled on first use (index builds only).
    Shard pairs are memory-mapped on first read and checked against their records then."""

    def __init__(
        self,
        prefix: str | os.PathLike[str],
        manifest: dict[str, Any],
        manifest_file: Path,
        *,
        index_only: bool = False,
    ) -> None:
        self.prefix = Path(prefix)
        self.idx_path = manifest_file  # what errors name
        self.manifest = _without_block_lists(manifest)  # kept for the life of the dataset
        self.dtype = np.dtype(str(manifest["dtype"]))
        shards = manifest["shards"]
        self.keys = [str(s["key"]) for s in shards]
        self.first_sequence = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum([s["sequences"] for s in shards], out=self.first_sequence[1:])
        self._firsts = self.first_sequence.tolist()
        self.num_tokens = int(manifest["counts"]["tokens"])
        self.num_documents = int(manifest["counts"]["documents"])
        self._index_only = index_only
        self.masked = masked_sequences(manifest)  # global sequence ids taken down
        self._open: dict[int, IndexedDataset] = {}
        self._lengths: np.ndarray | None = None
        self.num_parts = len(shards)

    def shard_prefix(self, k: int) -> Path:
        """The pair prefix of shard ``k``."""
        return Path(
            os.path.normpath(self.prefix.parent / str(self.manifest["shards"][k]["prefix"]))
        )

    def shard(self, k: int) -> IndexedDataset:
        """Shard ``k``'s pair, opened (and size-checked against the merge's record) once."""
        data = self._open.get(k)
        if data is None:
            kinds = ("idx",) if self._index_only else ("bin", "idx")
            base, one = self.prefix.parent, range(k, k + 1)
            problems = shard_problems(base, self.manifest, full=False, shards=one, kinds=kinds)
            if problems:
                raise FormatError(self.idx_path, f"shards[{k}]", "; ".join(problems))
            record = self.manifest["shards"][k]
            data = IndexedDataset(
                self.shard_prefix(k), index_only=self._index_only, num_tokens=record["tokens"]
            )
            if len(data) != record["sequences"] or data.dtype != self.dtype:
                raise FormatError(
                    data.idx_path,
                    "header",
                    f"{len(data)} {data.dtype} sequences, the merge recorded "
                    f"{record['sequences']} {self.dtype}",
                )
            self._open[k] = data
        return data

    def __len__(self) -> int:
        return self._firsts[-1]

    @property
    def sequence_lengths(self) -> np.ndarray:
        """Every sequence's length, shard by shard (reads each ``.idx``; for index builds)."""
        if self._lengths is None:
            parts = [self.shard(k).sequence_lengths for k in range(self.num_parts)]
            self._lengths = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return self._lengths

    @property
    def document_indices(self) -> np.ndarray:
        """Megatron's document index of the merge (each shard's, shifted, joined)."""
        parts = [np.zeros(1, dtype=np.int64)]
        for k in range(self.num_parts):
            docs = np.asarray(self.shard(k).document_indices, dtype=np.int64)
            parts.append(docs[1:] + self._firsts[k])
        return np.concatenate(parts)

    def _split(self, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, local sequence) of global sequences ``seq``."""
        part = np.searchsorted(self.first_sequence, seq, side="right") - 1
        return part, seq - self.first_sequence[part]

    def _each(self, seq: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        """(shard of each sequence, its ``field`` value from that shard's index)."""
        seq = np.asarray(seq, dtype=np.int64)
        part, local = self._split(seq)
        out = np.empty(len(seq), dtype=np.int64)
        for k in np.unique(part).tolist():
            rows = part == k
            out[rows] = getattr(self.shard(k), field)[local[rows]]
        return part, out

    def lengths_of(self, seq: np.ndarray) -> np.ndarray:
        """Lengths of global sequences ``seq`` (int64)."""
        return self._each(seq, "sequence_lengths")[1]

    def locate(self, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(part, byte offset in that part's ``.bin``) of global sequences ``seq``."""
        return self._each(seq, "sequence_pointers")

    def buffer(self, part: int) -> memoryview:
        """The bytes of shard ``part``'s ``.bin``."""
        return self.shard(part).tokens.view(np.uint8).data

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of global sequence ``i`` from ``offset`` for ``length`` tokens."""
        k = bisect.bisect_right(self._firsts, i) - 1
        if not 0 <= i < len(self):
            raise IndexError(f"{self.prefix}: sequence {i} out of range [0, {len(self)})")
        return self.shard(k).get(i - self._firsts[k], offset, length)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def check_pointers(self) -> None:
        """Full check of every shard's pointers (see ``IndexedDataset.check_pointers``)."""
        for k in range(self.num_parts):
            self.shard(k).check_pointers()

    def close(self) -> None:
        """Drop every opened shard's memory maps."""
        for data in self._open.values():
            data.close()
        self._open.clear()

    def __enter__(self) -> VirtualDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
