"""Which shards a downstream refresh is built from: those complete when it starts.

Under continuous ingest some shards are always new, being tokenized, or failing; a refresh
(automation, the nightly ``refresh_job``, ``tokenmill materialize``) never waits for them nor
fails on them. It builds from the shards whose tokens are complete (their manifest is there,
written last, and their run passed its checks), and reports every other shard with the reason
from what the instance records: never tokenized, in progress, or failed (with its error).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dagster import AssetExecutionContext, DagsterInstance, Failure, MetadataValue

from assets.support.staleness import SHARD_STAGES, failed_shards, shard_records, token_status
from tokenmill.formats.dataset_manifest import dataset_manifest_path, read_dataset_manifest
from tokenmill.recipe import DatasetConfig

LEFT_OUT = "left_out"  # merged metadata: {shard: reason} of the shards the version left out
REASONS = {None: "not tokenized yet", "IN_PROGRESS": "in progress", "FAILED": "failed"}


def left_out_reasons(
    instance: DagsterInstance, ds: DatasetConfig, keys: list[str]
) -> dict[str, str]:
    """Why each of ``keys`` (shards without tokens) is not in a refresh: its tokens status
    in the instance, with the error of its latest failed attempt when there is one."""
    if not keys:
        return {}
    status = token_status(instance, ds, keys)
    failures = failed_shards(instance, ds, keys, SHARD_STAGES)
    reasons = {}
    for key in keys:
        reason = REASONS.get(status[key], "not tokenized yet")
        if key in failures and status[key] != "IN_PROGRESS":
            reason = f"failed: {failures[key].error}"
        reasons[key] = reason
    return reasons


def complete_shards(
    instance: DagsterInstance,
    ds: DatasetConfig,
    prefixes: Mapping[str, Path],
    held: Mapping[str, str] | None = None,
    parsed: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """``(complete keys, {left-out key: reason})`` of the shards ``prefixes`` (key -> local
    tokens prefix, in merge order): a shard is complete when its token manifest is there and
    the run that recorded its tokens succeeded (its blocking checks passed) or recorded it on
    its own (another shard of its range failed); tokens made outside any recorded run count
    as complete (nothing says they are bad; ``verify`` and the checks read them). A shard the
    current version ``held`` ({key: content hash}) with the content its manifest has now stays
    complete whatever a later run of it is doing: a second run of one shard still in progress
    must not drop it from the next version (the pointer would move back). ``parsed`` receives
    ``{key: manifest}`` of the token manifests read for that, for the caller to reuse."""
    held = held or {}
    parsed = {} if parsed is None else parsed
    present = [key for key, prefix in prefixes.items() if dataset_manifest_path(prefix).is_file()]
    records = shard_records(instance, ds, present)

    def holds(key: str) -> bool:
        parsed[key] = read_dataset_manifest(prefixes[key])
        return bool(parsed[key]["content_hash"] == held[key])

    complete = [
        key
        for key in present
        if records[key].tokens_ok or not records[key].content_hash or (key in held and holds(key))
    ]
    missing = [key for key in prefixes if key not in set(present)]
    reasons = left_out_reasons(instance, ds, missing)
    for key in set(present) - set(complete):
        reasons[key] = "tokens not verified (the run that made them failed its checks)"
    return complete, {key: reasons[key] for key in prefixes if key in reasons}


def report_left_out(
    context: AssetExecutionContext, ds: DatasetConfig, complete: list[str], left_out: dict[str, str]
) -> None:
    """Put the left-out shards on the materialization (``left_out``, read by the WARN check
    ``shards_left_out``) and in the run's log; fail only when no shard is complete at all."""
    if not complete:
        raise Failure(
            f"{ds.name}: no shard is complete yet; left out: "
            + "; ".join(f"{k}: {r}" for k, r in left_out.items()),
            metadata={LEFT_OUT: MetadataValue.json(left_out)},
        )
    context.add_output_metadata(
        {LEFT_OUT: MetadataValue.json(left_out), "shards_left_out": len(left_out)}
    )
    if left_out:
        context.log.warning(
            f"{ds.name}: built from {len(complete)} complete shards; left out "
            + "; ".join(f"{k}: {r}" for k, r in left_out.items())
        )
