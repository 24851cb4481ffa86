"""Merged versions: the version a merge of shards has, whether it extends the previous one, and
writing it (virtual: a manifest of the shard pairs; physical: Megatron's merged pair).

A version hashes what the merge reads (each shard's key and content hash in merge order, the
text key, the format version, a virtual merge's mode and takedown masks), so an unchanged refresh
finds its version complete. Merge order is the natural order of the shard keys (``part-2`` before
``part-10``); a version *extends* the previous one when the old shards, with the same content and
masks, are its first shards: every old sequence keeps its position (``nanoset.semantics:
growing``). Pure functions over local paths: the Dagster asset stages files and moves the pointer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenmill.formats.dataset_manifest import (
    FORMAT_VERSION,
    dataset_manifest_path,
    read_dataset_manifest,
)
from tokenmill.formats.merge import MergeResult, merge_datasets, virtual_merge
from tokenmill.storage.versions import version_hash

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
