"""Takedowns: remove documents from every merged dataset and blend by masking, never by copying.

A takedown list is a file of ``tokenmill find`` queries, one a line. :func:`record_takedown`
resolves it on a storage root (``tokenmill.provenance.resolve_queries``; ``s3://`` through a
local mirror) and writes an audit record ``takedowns/<id>.json``
(``tokenmill.formats.takedown_records``): the documents removed (dataset, shard and its content
hash, ordinal, source file:line, id), the blend versions holding each then, when, why and the
list's sha256. These records are the root's ledger: every later merge, CLI or pipeline, masks
what they name (by shard key *and* content hash), so a refresh never brings a document back.

:func:`apply_takedown` then writes, per dataset whose current merged version holds a listed
document, a new virtual merged version (same shard pairs, ``masked`` ordinals, a ``takedown``
record) and moves its pointer; every blend reading such a dataset is rebuilt from the settings
its manifest records. Nothing is re-tokenized or copied; old versions stay (pinned jobs keep
reading them) until ``tokenmill gc``. The audit record is rewritten last (``status: applied``).
Physical merges are refused: a mask over shard documents cannot describe one copied ``.bin``.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.atomic import read_json
from tokenmill.errors import ConfigError
from tokenmill.formats.blend_manifest import MANIFEST_NAME, read_blend_manifest, resolve
from tokenmill.formats.dataset_manifest import dataset_manifest_path, read_dataset_manifest
from tokenmill.formats.takedown_records import (
    FORMAT_VERSION,
    KIND,
    list_sha256,
    masks_for,
    named,
    read_ledger,
    record_key,
    takedown_summary,
    write_record,
)
from tokenmill.formats.virtual_merge import is_virtual
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.provenance import DocumentRef, find, query_lines, resolve_queries
from tokenmill.storage import layout
from tokenmill.storage.mirror import local_root
from tokenmill.storage.versions import read_pointer, write_pointer
from tokenmill.tokenize.merged_versions import (
    extends,
    merged_version,
    shard_identities,
    write_merged,
)

__all__ = ["TakedownReport", "apply_takedown", "record_takedown", "takedown"]


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _shard_content(root: Path, dataset: str, shard: str) -> str | None:
    """The content hash of a shard's tokens now (None when it was never tokenized)."""
    stats = read_json(root / layout.raw_stats(dataset, shard), "raw stats")
    text_key = str(stats["config"]["text_key"])
    prefix = root / layout.tokens_prefix(dataset, shard, text_key)
    if not dataset_manifest_path(prefix).is_file():
        return None
    return str(read_dataset_manifest(prefix)["content_hash"])


def _documents(root: Path, refs: Sequence[DocumentRef]) -> list[dict[str, Any]]:
    """One entry per distinct document the queries named, with its shard's content hash."""
    found: dict[tuple[str, str, int], dict[str, Any]] = {}
    for ref in refs:
        at = (ref.dataset, ref.shard, ref.document)
        if at not in found:
            found[at] = {
                "dataset": ref.dataset,
                "shard": ref.shard,
                "content_hash": _shard_content(root, ref.dataset, ref.shard),
                "document": ref.document,
                "source": ref.source,
                "line": ref.line,
                "id": ref.doc_id,
                "queries": [],
            }
        found[at]["queries"].append(ref.query)
    return [d for d in found.values() if d["content_hash"] is not None]


def record_takedown(
    root: str | os.PathLike[str],
    list_path: str | os.PathLike[str],
    reason: str,
    *,
    now: float | None = None,
) -> dict[str, Any]:
    """Resolve a takedown list on a storage root and write its audit record, or return the one
    written for the same list and documents. ConfigError (nothing written) for an empty reason
    or list, a bad query, or a document of a physical merge; ``s3://``: through a mirror."""
    if os.fspath(root).startswith("s3://"):
        with local_root(root, write=True) as local:
            return record_takedown(local, list_path, reason, now=now)
    base = Path(root)
    if not reason.strip():
        raise ConfigError("--reason: say why the documents are removed (it goes in the record)")
    queries = query_lines(list_path)
    if not queries:
        raise ConfigError(f"{list_path}: the takedown list holds no query")
    digest = list_sha256(list_path)
    refs = resolve_queries(base, queries)
    documents = _documents(base, refs)
    identity = named(documents)
    for record in read_ledger(base):
        if record["list"]["sha256"] == digest and named(record["documents"]) == identity:
            return record
    for dataset in sorted({d["dataset"] for d in documents}):
        _refuse_physical(base, dataset)  # before anything is written
    moment = time.time() if now is None else now
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(moment))
    record_id = f"{stamp}-{digest[:12]}-{hashlib.sha256(repr(identity).encode()).hexdigest()[:8]}"
    held = [
        {
            "blend": hit.blend,
            "version": hit.version,
            "dataset": hit.document.dataset,
            "shard": hit.document.shard,
            "document": hit.document.document,
            "samples": {split: len(ids) for split, ids in hit.samples.items()},
        }
        for hit in find(base, queries, refs=refs)
    ]
    matched = {r.query for r in refs}
    record = {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "id": record_id,
        "created": _utc(moment),
        "reason": reason,
        "list": {"path": str(list_path), "sha256": digest, "queries": len(queries)},
        "unmatched": [q for q in dict.fromkeys(queries) if q not in matched],
        "documents": documents,
        "held_by": held,
        "status": "recorded",
    }
    write_record(base, record)
    return record


@dataclass
class TakedownReport:
    """What a takedown did: its audit record and, per dataset and blend, the versions made."""

    record: dict[str, Any]
    merged: dict[str, dict[str, Any]] = field(default_factory=dict)
    blends: dict[str, dict[str, Any]] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """One line per removed document count, new version and unmatched query."""
        record = self.record
        out = [
            f"takedown {record['id']}: {len(record['documents'])} documents "
            f"({record['reason']}); audit record {record_key(record['id'])}"
        ]
        for ds, made in self.merged.items():
            out.append(
                f"  merged {ds}: {made['removed']} documents masked in all; version "
                f"{str(made['from'])[:16]} -> {made['to'][:16]}"
            )
        for name, made in self.blends.items():
            out.append(f"  blend {name}: version {made['from'][:16]} -> {made['to'][:16]}")
        out += [f"  {q}: no document" for q in record["unmatched"]]
        return out


def _current_merge(root: Path, dataset: str) -> tuple[dict[str, Any], Path] | None:
    """The merged pointer of ``dataset`` and its version's prefix (None: never merged)."""
    pointer = read_pointer(root / layout.merged_pointer(dataset))
    if pointer is None:
        return None
    return pointer, root / layout.merged_dir(dataset) / str(pointer["target"])


def _refuse_physical(root: Path, dataset: str) -> None:
    """ConfigError when the current merged version of ``dataset`` is a physical merge."""
    found = _current_merge(root, dataset)
    if found is not None and not is_virtual(read_dataset_manifest(found[1])):
        raise ConfigError(
            f"dataset {dataset!r}: its current merged version {found[1]} is a physical merge "
            "(merge: physical): a takedown masks documents of a virtual merge and never "
            "rewrites a copied .bin; set merge: virtual in the recipe, refresh, and run the "
            "takedown again"
        )


def _remask(root: Path, dataset: str, ledger: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A new virtual merged version of ``dataset`` masking what the ledger names, the pointer
    moved to it; None when its current version already masks exactly that."""
    found = _current_merge(root, dataset)
    if found is None:
        return None
    pointer, prefix = found
    manifest = read_dataset_manifest(prefix)
    identities = shard_identities(manifest)
    masks = masks_for(ledger, dataset, identities)
    if not is_virtual(manifest):
        if masks:
            _refuse_physical(root, dataset)
        return None
    text_key = str(manifest["config"]["text_key"])
    version = merged_version(text_key, identities, "virtual", masks)
    if version == pointer["version"]:
        return None
    out = root / layout.merged_prefix(dataset, text_key, version)
    if not dataset_manifest_path(out).is_file():
        shards = [
            (str(s["key"]), Path(os.path.normpath(prefix.parent / str(s["prefix"]))))
            for s in manifest["shards"]
        ]
        base = extends(str(pointer["version"]), manifest, identities, masks)
        summary = takedown_summary(ledger, dataset, identities)
        write_merged(shards, out, merge="virtual", extends=base, masks=masks, takedown=summary)
    target = os.path.relpath(out, root / layout.merged_dir(dataset))
    write_pointer(root / layout.merged_pointer(dataset), version, target, expected=pointer)
    removed = sum(len(v) for v in masks.values())
    return {"from": pointer["version"], "to": version, "removed": removed}


def _blend_settings(manifest: dict[str, Any], mpath: Path) -> tuple[Path, BlendSettings]:
    """The index cache folder and the ``build_blend`` settings a blend manifest records."""
    splits = manifest["splits"]
    sizes: dict[str, Any] = {
        f"{s}_samples": splits[s]["samples_requested"] if s in splits else None
        for s in ("train", "valid", "test")
    }
    entry = next((d for part in splits.values() for d in part["datasets"]), None)
    if entry is None:
        raise ConfigError(f"{mpath}: the blend has no split to take its index cache from")
    cache_dir = resolve(mpath, entry["index"]["files"]["description"]["path"]).parent
    growing = manifest["semantics"] == "growing"
    era = {"era_samples": int(manifest["growing"]["era_samples"])} if growing else {}
    nanoset = NanosetSettings(
        sequence_length=int(manifest["sequence_length"]),
        split_spec=str(manifest["split"]),
        seed=int(manifest["seed"]),
        semantics=str(manifest["semantics"]),
        add_extra_token=bool(manifest["add_extra_token"]),
        drop_last_partial_validation=bool(manifest.get("drop_last_partial_validation", True)),
        **era,
        **sizes,
    )
    weighting = manifest["weighting"]
    weights, temperature = weighting.get("weights"), weighting.get("temperature")
    return cache_dir, BlendSettings(nanoset, weights=weights, temperature=temperature)


def _rebuild_blends(root: Path, moved: Mapping[str, Path]) -> dict[str, dict[str, Any]]:
    """Rebuild every blend whose current version reads a dataset of ``moved`` (dataset -> its
    new merged prefix) over the new prefix, from the settings its manifest records."""
    made = {}
    for mpath in sorted((root / layout.BLENDS).glob(f"*/{MANIFEST_NAME}")):
        manifest = read_blend_manifest(mpath)
        datasets, hit = {}, False
        for entry in manifest["datasets"]:
            prefix = resolve(mpath, entry["prefix"])
            ds = prefix.parent.parent.name
            if prefix.parent.parent == root / layout.merged_dir(ds) and ds in moved:
                prefix, hit = moved[ds], True
            datasets[str(entry["name"])] = prefix
        if not hit:
            continue
        cache_dir, settings = _blend_settings(manifest, mpath)
        name = str(manifest["name"])
        built = build_blend(name, datasets, mpath.parent, cache_dir, settings)
        if built["version"] != manifest["version"]:
            made[name] = {"from": str(manifest["version"]), "to": str(built["version"])}
    return made


def apply_takedown(root: str | os.PathLike[str], record: dict[str, Any]) -> TakedownReport:
    """New merged versions masking what the ledger names for each dataset ``record`` touches,
    new versions of the blends reading them, then the record rewritten; idempotent."""
    base = Path(root)
    ledger = read_ledger(base)
    report = TakedownReport(record)
    moved = {}
    for dataset in sorted({str(d["dataset"]) for d in record["documents"]}):
        made = _remask(base, dataset, ledger)
        if made is not None:
            report.merged[dataset] = made
        current = _current_merge(base, dataset)
        if current is not None:
            moved[dataset] = current[1]
    report.blends = _rebuild_blends(base, moved)
    applied = {"at": _utc(time.time()), "merged": report.merged, "blends": report.blends}
    record = {**record, "status": "applied", "applied": applied}
    write_record(base, record)
    report.record = record
    return report


def takedown(
    root: str | os.PathLike[str],
    list_path: str | os.PathLike[str],
    reason: str,
    *,
    now: float | None = None,
) -> TakedownReport:
    """:func:`record_takedown` then :func:`apply_takedown` (``tokenmill takedown``); an ``s3://``
    root is worked on in a local mirror, uploaded in commit order (a moved pointer:
    ConflictError)."""
    with local_root(root, write=True) as base:
        return apply_takedown(base, record_takedown(base, list_path, reason, now=now))
