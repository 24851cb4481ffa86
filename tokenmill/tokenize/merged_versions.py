"""Merged versions: the version a merge of shards has, whether it extends the previous one, and
writing it (virtual: a manifest of the shard pairs; physical: Megatron's merged pair).

A version hashes what the merge reads (each shard's key and content hash in merge order, the
text key, the format version, a virtual merge's mode and takedown masks), so an unchanged refresh
finds its version complete. Merge order is the natural order of the shard keys (``part-2`` before
``part-10``); a version *extends* the previous one when the old shards, with the same content and
masks, are its first shards: every old sequence keeps its position (``nanoset.semantics:
growing``). :func:`merge_version` makes one under a folder laid out as ``merged/<ds>/`` (the
``<ds>/merged`` asset and ``tokenmill merge --versions`` both call it); over local paths, with a
``fetch`` hook that stages from S3 what it is about to read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.formats.dataset_manifest import (
    FORMAT_VERSION,
    check_dataset_files,
    dataset_manifest_path,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import data_file_path, index_file_path
from tokenmill.formats.merge import MergeResult, merge_datasets, virtual_merge
from tokenmill.storage.layout import POINTER_NAME, document_name, version_dir_name
from tokenmill.storage.versions import (
    READ_AT_START,
    Expected,
    read_pointer,
    version_hash,
    write_pointer,
)

MERGE_MODES = ("virtual", "physical")
Masks = Mapping[str, Sequence[int]]


def merged_version(
    text_key: str,
    inputs: Sequence[tuple[str, str | None]],
    merge: str,
    masks: Masks | None = None,
) -> str:
    """The merged version of ``(shard, tokens content hash)`` inputs in merge order (a shard
    not tokenized yet counts as None), also its folder's name. Only a virtual version hashes its
    mode (physical hashes stay as before: an upgrade re-merges nothing) and its ``masks`` (shard
    key -> masked ordinals) when any is non-empty."""
    if merge not in MERGE_MODES:
        raise ValueError(f"merge must be one of {MERGE_MODES}, got {merge!r}")
    found = {k: sorted(int(o) for o in v) for k, v in (masks or {}).items() if len(v)}
    if found and merge != "virtual":
        raise ValueError("masks (takedowns) apply to virtual merges only")
    description: dict[str, Any] = {
        "kind": "merged",
        "format_version": FORMAT_VERSION,
        "text_key": text_key,
        "inputs": [list(i) for i in inputs],
    }
    if merge == "virtual":
        description["merge"] = merge
    if found:
        description["masked"] = [[k, found[k]] for k, _ in inputs if k in found]
    return version_hash(description)


def shard_masks(manifest: dict[str, Any]) -> dict[str, list[int]]:
    """``{shard key: masked ordinals}`` of a merged manifest's shards that mask any."""
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        return {}
    return {str(s["key"]): [int(o) for o in s["masked"]] for s in shards if s.get("masked")}


def shard_identities(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """``(key, content hash)`` of the shards a merged manifest records, in merge order (empty
    for a manifest that records none, as ``tokenmill merge`` writes)."""
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        return []
    return [(str(s["key"]), str(s["content_hash"])) for s in shards if isinstance(s, dict)]


def extends(
    previous_version: str | None,
    previous_manifest: dict[str, Any] | None,
    shards: Sequence[tuple[str, str]],
    masks: Masks | None = None,
) -> str | None:
    """``previous_version`` when its shards are a strict prefix of ``shards`` (same keys, same
    content, same order) with the same masks, and no new shard is masked, else None: an edit,
    a removal (a shard's, or a document's by takedown) or an insertion breaks extension."""
    if previous_version is None or previous_manifest is None:
        return None
    old = shard_identities(previous_manifest)
    if not old or len(old) >= len(shards) or list(shards[: len(old)]) != old:
        return None
    new = {k: sorted(int(o) for o in v) for k, v in (masks or {}).items() if len(v)}
    return previous_version if new == shard_masks(previous_manifest) else None


def write_merged(
    shards: list[tuple[str, Path]],
    out: Path,
    *,
    merge: str,
    extends: str | None,
    input_uri: Callable[[Path], str] | None = None,
    masks: Masks | None = None,
    takedown: dict[str, Any] | None = None,
) -> MergeResult:
    """Write the merged version at ``out`` from ``(key, pair prefix)`` shards in merge order
    (``masks`` and their ``takedown`` record: virtual merges only)."""
    if merge == "virtual":
        return virtual_merge(shards, out, extends=extends, masks=masks, takedown=takedown)
    if masks:
        raise ValueError("masks (takedowns) apply to virtual merges only")
    return merge_datasets(
        [prefix for _, prefix in shards],
        out,
        order="given",
        input_uri=input_uri,
        keys=[key for key, _ in shards],
        extends=extends,
    )


def previous_manifest(prefix: Path | None) -> dict[str, Any] | None:
    """The manifest of the merged version at ``prefix`` (None when there is none)."""
    if prefix is None or not dataset_manifest_path(prefix).is_file():
        return None
    return read_dataset_manifest(prefix)


Fetch = Callable[[list[Path]], None]  # stage these local paths (an S3 root's) before reading them


@dataclass(frozen=True)
class MergedVersion:
    """What :func:`merge_version` made or found: the version, its pair prefix, whether an
    existing complete version was kept (nothing written), the version it extends, and the
    write's seconds (None when kept)."""

    version: str
    prefix: Path
    reused: bool
    extends: str | None
    seconds: float | None


def merge_version(
    folder: str | os.PathLike[str],
    name: str,
    text_key: str,
    shards: Sequence[tuple[str, Path]],
    *,
    merge: str = "virtual",
    identities: Sequence[tuple[str, str | None]] | None = None,
    previous: Expected = READ_AT_START,
    old_manifest: dict[str, Any] | str | None = READ_AT_START,
    masks: Masks | None = None,
    takedown: dict[str, Any] | None = None,
    input_uri: Callable[[Path], str] | None = None,
    fetch: Fetch | None = None,
) -> MergedVersion:
    """Merge ``(shard key, token pair prefix)`` shards, in merge order, as a version under
    ``folder``: ``<folder>/<version>/<name>_<text_key>_document``, then ``<folder>/current.json``
    moved to it, compare-and-swap against ``previous`` (the pointer record as read before the
    shards were, None for none; ``READ_AT_START``: read here, first). An existing version whose
    files check out is kept; a version whose shards only append to the pointer's version
    ``extends`` it. ``identities`` and ``old_manifest`` (the manifest of the version ``previous``
    names): when the caller has read them already (else read here, as needed)."""
    folder = Path(folder)
    stage = fetch or (lambda paths: None)
    pointer = folder / POINTER_NAME
    if previous == READ_AT_START:
        stage([pointer])
        previous = read_pointer(pointer)
    if identities is None:
        identities = [(k, str(read_dataset_manifest(p)["content_hash"])) for k, p in shards]
    version = merged_version(text_key, identities, merge, masks)
    target = f"{version_dir_name(version)}/{document_name(name, text_key)}"
    out = folder / target
    stage([dataset_manifest_path(out)])
    reused = dataset_manifest_path(out).is_file()
    if reused and merge == "physical":
        stage([index_file_path(out)])
    if reused and fetch is None:  # a staged copy was checked when it was stored
        reused = not check_dataset_files(out)
    made = MergedVersion(version, out, True, None, None)
    if not reused:
        old = previous if isinstance(previous, Mapping) else None
        if old is None:
            old_manifest = None
        elif old_manifest == READ_AT_START:
            old_prefix = folder / str(old["target"])
            stage([dataset_manifest_path(old_prefix)])
            old_manifest = previous_manifest(old_prefix)
        held = [(k, str(h)) for k, h in identities]
        manifest = old_manifest if isinstance(old_manifest, dict) else None
        base = extends(str(old["version"]) if old else None, manifest, held, masks)
        if merge == "physical":
            stage([f(p) for _, p in shards for f in (data_file_path, index_file_path)])
        result = write_merged(
            list(shards), out, merge=merge, extends=base, input_uri=input_uri, masks=masks,
            takedown=takedown,
        )  # fmt: skip
        made = MergedVersion(version, out, False, base, result.seconds)
    write_pointer(pointer, version, target, expected=previous)
    return made
