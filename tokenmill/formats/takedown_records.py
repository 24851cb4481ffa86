"""Takedown audit records (``takedowns/<id>.json``): layout, writer, reader, and what a merge
masks by them (``tokenmill.takedown`` makes and applies them; docs/formats.md has the schema).

A record names each removed document by dataset, shard key, the shard's content hash and
ordinal; a merge masks only documents whose shard still has that content (:func:`masks_for`), so
a re-tokenized shard is not masked by a stale ordinal. Records are written whole, atomically.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenmill.atomic import read_json, write_json
from tokenmill.errors import ConfigError, FormatError

__all__ = [
    "FORMAT_VERSION",
    "KIND",
    "TAKEDOWNS",
    "blend_takedowns",
    "list_sha256",
    "masks_for",
    "merge_masks",
    "named",
    "read_ledger",
    "record_key",
    "takedown_summary",
    "write_record",
]

KIND = "takedown"
FORMAT_VERSION = 1
TAKEDOWNS = "takedowns"  # the ledger's folder under the storage root
RECORD_ID = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{12}-[0-9a-f]{8}$")
Identities = Sequence[tuple[str, str | None]]


def record_key(record_id: str) -> str:
    """``takedowns/<id>.json``, the key of one record under the root; ConfigError for an id
    that is not ``<UTC time>-<list sha256[:12]>-<documents sha256[:8]>``."""
    if not RECORD_ID.match(record_id):
        raise ConfigError(f"takedown id {record_id!r} rejected: not <time>-<hex12>-<hex8>")
    return f"{TAKEDOWNS}/{record_id}.json"


def list_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a takedown list file's bytes: its identity in audit records and manifests."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_ledger(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every audit record under ``root/takedowns/`` (oldest first by id); FormatError naming a
    file that is not one."""
    folder = Path(root) / TAKEDOWNS
    records = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        record = read_json(path, "takedown record")
        if not isinstance(record, dict) or record.get("kind") != KIND:
            raise FormatError(path, "kind", f"expected a {KIND!r} record")
        records.append(record)
    return records


def masks_for(
    records: Iterable[Mapping[str, Any]], dataset: str, identities: Identities
) -> dict[str, list[int]]:
    """``{shard key: ordinals}`` the ledger masks in a merge of ``identities`` (``(key, content
    hash)`` in merge order) of ``dataset``: documents of a shard with that same content."""
    current = {k: h for k, h in identities if h is not None}
    masks: dict[str, set[int]] = {}
    for record in records:
        for doc in record.get("documents", []):
            key = str(doc["shard"])
            if doc["dataset"] == dataset and current.get(key) == doc["content_hash"]:
                masks.setdefault(key, set()).add(int(doc["document"]))
    return {k: sorted(v) for k, v in masks.items()}


def takedown_summary(
    records: Iterable[Mapping[str, Any]], dataset: str, identities: Identities
) -> dict[str, Any] | None:
    """The ``takedown`` record of a merged manifest (None when nothing is masked): the lists'
    sha256, the documents masked in all, and the audit records (keys under the root)."""
    used = [r for r in records if masks_for([r], dataset, identities)]
    if not used:
        return None
    return {
        "lists": sorted({str(r["list"]["sha256"]) for r in used}),
        "removed": sum(len(v) for v in masks_for(used, dataset, identities).values()),
        "records": [record_key(str(r["id"])) for r in used],
    }


def merge_masks(
    records: Sequence[Mapping[str, Any]], dataset: str, identities: Identities, merge: str
) -> tuple[dict[str, list[int]], dict[str, Any] | None]:
    """What a merge of ``identities`` of ``dataset`` masks by the ledger, and its ``takedown``
    record; ConfigError when it masks any document of a physical merge (``merge``)."""
    masks = masks_for(records, dataset, identities)
    if masks and merge != "virtual":
        raise ConfigError(
            f"{dataset}: the takedown ledger ({TAKEDOWNS}/) masks documents of shards "
            f"{sorted(masks)}, but merge: {merge} copies them into one .bin; set merge: "
            "virtual in the recipe (takedowns mask, never rewrite)"
        )
    return masks, takedown_summary(records, dataset, identities)


def blend_takedowns(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What a blend version's datasets mask, from the ``takedown`` records copied into its
    manifest: ``{"removed": {dataset: count}, "total", "lists", "records"}``."""
    removed, lists, records = {}, set(), []
    for entry in manifest["datasets"]:
        record = entry.get("takedown") or {}
        removed[str(entry["name"])] = int(record.get("removed", 0))
        lists.update(record.get("lists", []))
        records += [r for r in record.get("records", []) if r not in records]
    return {
        "removed": removed,
        "total": sum(removed.values()),
        "lists": sorted(lists),
        "records": sorted(records),
    }


def named(documents: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, str, int]]:
    """The identities of documents (dataset, shard, content hash, ordinal), sorted."""
    return sorted(
        (str(d["dataset"]), str(d["shard"]), str(d["content_hash"]), int(d["document"]))
        for d in documents
    )


def write_record(root: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Write (or rewrite) a record at its key under ``root``, atomically."""
    path = Path(root) / record_key(str(record["id"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, record)
