"""One staleness model: Dagster data versions computed from manifest content hashes.

Every asset records, on its materialization in the Dagster instance, the identity of what it
made; the UI, the shard sensors, ``tokenmill materialize`` and automation all read those
records and nothing else (no run tags, no copy of the storage root):

- ``<ds>/hf_dataset`` records per shard the ``source_fingerprint`` (``<size>:<mtime_ns>`` or
  ``<size>:<ETag>``) of the source file it exported, as the step itself looked it up; a shard
  run by a sensor, a backfill, ``materialize`` or the UI is recorded alike;
- ``<ds>/tokens`` records per shard its token manifest's ``content_hash`` and the ``settings``
  that made it (tokenizer fingerprint, ``append_eod``, ``text_key``, ``on_bad_record``), and
  returns a ``DataVersion`` (the content hash; for a range step, one hash over the range,
  since Dagster gives a step's output one data version for all its partitions);
- ``merged``, ``nanoset`` and ``blend/*`` return the ``DataVersion`` of their inputs'
  versions and settings, the library's own version of each (:func:`merged_data_version`,
  :func:`nanoset_data_version`, :func:`blend_data_version`, over the recipe's settings
  values): the asset computes it from the manifests it read, and
  :func:`expected_versions` computes the same value from the shard records, so "stale" is
  "the recorded data version differs from the expected one".

A shard is current (:func:`current_shards`) when its latest ``hf_dataset`` record carries the
source fingerprint listed now, its latest ``tokens`` record is newer and made with the current
settings (when given), and the run that made the tokens succeeded (so its blocking checks
passed), or recorded the shard on its own when another shard of its range failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    DataVersion,
    EventLogRecord,
    RunsFilter,
)

from assets.support.dagster_private import latest_storage_ids
from assets.support.partitions import shard_partitions
from tokenmill.formats.takedown_records import masks_for
from tokenmill.indices.blend_versioning import blend_data_version as library_blend_version
from tokenmill.indices.nanoset import index_version
from tokenmill.recipe import BlendConfig, DatasetConfig, NanosetConfig, Recipe
from tokenmill.storage.versions import version_hash
from tokenmill.tokenize.merged_versions import merged_version

# The tag under which Dagster stores the data version of a materialization (``DataVersion``);
# the public record APIs hand back events, whose tags carry it.
DATA_VERSION_TAG = "dagster/data_version"
DATA_VERSION_USER_TAG = "dagster/data_version_is_user_provided"
CODE_VERSION_TAG = "dagster/code_version"
# Observation metadata of a shard stage's partition whose step failed on it: the source
# fingerprint it read ("unknown" when the file was not found).
FAILED = "failed_source_fingerprint"
# Tag of a shard's materialization recorded on its own by a range step another shard failed
# (``assets.shards.shard_step``): its run failed, but not on it.
RECORDED_ALONE = "tokenmill/recorded_alone"
SOURCE_FINGERPRINT = "source_fingerprint"  # per-shard metadata of <ds>/hf_dataset
CONTENT_HASH = "content_hash"  # per-shard metadata of <ds>/tokens
SETTINGS = "settings"  # per-shard metadata of <ds>/tokens
SOURCE_STAGE = "hf_dataset"  # every dataset has it; it exports exactly the validated file
LAST_SHARD_STAGE = "tokens"
SHARD_STAGES = ("raw_jsonl", "hf_dataset", LAST_SHARD_STAGE)  # an ``hf`` dataset has no raw
QUERY_CHUNK = 500  # storage ids per records query


def tokens_settings(tokenizer_fingerprint: str, append_eod: bool, ds: DatasetConfig) -> str:
    """Hash of every setting a shard's tokens depend on besides the source itself."""
    return version_hash(
        {
            "tokenizer_fingerprint": tokenizer_fingerprint,
            "append_eod": append_eod,
            "text_key": ds.text_key,
            "on_bad_record": ds.on_bad_record,
        }
    )


def merged_data_version(
    ds: DatasetConfig,
    inputs: Sequence[tuple[str, str | None]],
    merge: str,
    masks: Mapping[str, Sequence[int]] | None = None,
) -> str:
    """The merged version of ``(shard, tokens content hash)`` inputs in merge order (a shard
    not tokenized yet counts as None) with the takedown ``masks`` the ledger gives them; the
    library's own (``merged_version``)."""
    return merged_version(ds.text_key, inputs, merge, masks)


def nanoset_data_version(merged_version: str | None, cfg: NanosetConfig) -> str:
    """The indices' version: the library's (``nanoset.index_version``) of the merged version
    they index, with the recipe's settings and each split's requested size."""
    settings = cfg.settings()
    return index_version(merged_version, settings, settings.index_sizes())


def blend_data_version(
    blend: BlendConfig, cfg: NanosetConfig, nanosets: Sequence[tuple[str, str | None]]
) -> str:
    """The blend's version: the library's (``blend_versioning.blend_data_version``) of its
    settings and each member's ``(name, nanoset version)``."""
    return library_blend_version(blend.settings(cfg.settings()), nanosets)


def recipe_code_versions(recipe: Recipe) -> dict[AssetKey, str]:
    """The code version of each asset built from recipe settings beyond its inputs' data: a
    hash of those settings (the merge mode for ``<ds>/merged``; the library's index version of
    no dataset for ``<ds>/nanoset``; its blend version of members of no version for
    ``blend/<name>``). Dagster records it with each materialization, so an edited recipe shows
    as "code version changed" once the code location reloads, and the recipe sensor
    (``pipelines/sensors.py``) compares it with the file as read at each tick."""
    versions = {}
    nanoset = nanoset_data_version(None, recipe.nanoset)
    for ds in recipe.datasets:
        merged = {"kind": "merged", "merge": recipe.merge}
        versions[AssetKey([ds.name, "merged"])] = version_hash(merged)
        versions[AssetKey([ds.name, "nanoset"])] = nanoset
    for blend in recipe.blends:
        members = [(name, None) for name in blend.datasets]
        versions[AssetKey(["blend", blend.name])] = blend_data_version(
            blend, recipe.nanoset, members
        )
    return versions


def recorded_code_version(instance: DagsterInstance, key: AssetKey) -> str | None:
    """The code version an unpartitioned asset's latest materialization was made with."""
    event = instance.get_latest_materialization_event(key)
    materialization = event.asset_materialization if event else None
    return (materialization.tags or {}).get(CODE_VERSION_TAG) if materialization else None


def range_data_version(per_shard: Mapping[str, str]) -> DataVersion:
    """A step's data version: the shard's own for one shard, one hash over a range."""
    if len(per_shard) == 1:
        return DataVersion(next(iter(per_shard.values())))
    return DataVersion(version_hash(sorted(per_shard.items())))


@dataclass(frozen=True)
class ShardRecord:
    """What the instance records about one shard."""

    source_fingerprint: str | None = None
    content_hash: str | None = None
    settings: str | None = None
    tokens_after_source: bool = False
    tokens_ok: bool = False


def latest_records(
    instance: DagsterInstance,
    key: AssetKey,
    partitions: Iterable[str],
    kind: DagsterEventType = DagsterEventType.ASSET_MATERIALIZATION,
) -> dict[str, EventLogRecord]:
    """The latest materialization (or observation) record of each partition: one query for
    the storage ids, then one per ``QUERY_CHUNK`` records."""
    ids = latest_storage_ids(instance, key, kind, partitions)
    chosen = sorted(ids.values())
    fetch = (
        instance.fetch_observations
        if kind == DagsterEventType.ASSET_OBSERVATION
        else instance.fetch_materializations
    )
    found: dict[str, EventLogRecord] = {}
    for start in range(0, len(chosen), QUERY_CHUNK):
        part = chosen[start : start + QUERY_CHUNK]
        query = AssetRecordsFilter(asset_key=key, storage_ids=part)
        records = fetch(query, limit=len(part)).records
        for record in records:
            if record.partition_key is not None:
                found[record.partition_key] = record
    return found


def _metadata(record: EventLogRecord | None, name: str) -> str | None:
    event = (record.asset_materialization or record.asset_observation) if record else None
    value = event.metadata.get(name) if event else None
    return None if value is None else str(value.value)


def _recorded_alone(record: EventLogRecord) -> bool:
    materialization = record.asset_materialization
    return bool(materialization and (materialization.tags or {}).get(RECORDED_ALONE) == "true")


def shard_records(
    instance: DagsterInstance, ds: DatasetConfig, keys: Iterable[str]
) -> dict[str, ShardRecord]:
    """The record of each shard of ``keys`` (an empty record for a shard never exported)."""
    keys = list(keys)
    source = latest_records(instance, AssetKey([ds.name, SOURCE_STAGE]), keys)
    tokens = latest_records(instance, AssetKey([ds.name, LAST_SHARD_STAGE]), keys)
    run_ids = sorted({r.run_id for r in tokens.values() if r.run_id})
    ok = {
        run.dagster_run.run_id
        for start in range(0, len(run_ids), QUERY_CHUNK)
        for run in instance.get_run_records(
            RunsFilter(
                run_ids=run_ids[start : start + QUERY_CHUNK], statuses=[DagsterRunStatus.SUCCESS]
            )
        )
    }
    records = {}
    for key in keys:
        src, tok = source.get(key), tokens.get(key)
        records[key] = ShardRecord(
            source_fingerprint=_metadata(src, SOURCE_FINGERPRINT),
            content_hash=_metadata(tok, CONTENT_HASH),
            settings=_metadata(tok, SETTINGS),
            tokens_after_source=src is not None
            and tok is not None
            and tok.storage_id > src.storage_id,
            tokens_ok=tok is not None and (tok.run_id in ok or _recorded_alone(tok)),
        )
    return records


def current_shards(
    instance: DagsterInstance,
    ds: DatasetConfig,
    fingerprints: Mapping[str, str],
    settings: str | None = None,
) -> set[str]:
    """The shards of ``fingerprints`` (shard -> source fingerprint listed now) whose tokens
    are current: made from that source, after its export, by a successful run, and (when
    ``settings`` is given, see :func:`tokens_settings`) with these settings."""
    records = shard_records(instance, ds, fingerprints)
    return {
        key
        for key, record in records.items()
        if record.source_fingerprint == fingerprints[key]
        and record.tokens_after_source
        and record.tokens_ok
        and (settings is None or record.settings == settings)
    }


@dataclass(frozen=True)
class ShardFailure:
    """A shard's latest failed attempt: the source fingerprint it read ("unknown" if the file
    was not found) and the error."""

    fingerprint: str
    error: str


def failed_shards(
    instance: DagsterInstance, ds: DatasetConfig, keys: Iterable[str], stages: Sequence[str]
) -> dict[str, ShardFailure]:
    """The shards of ``keys`` whose latest event at the shard ``stages`` is a failure
    (recorded by ``assets.shards.shard_step``), newer than their latest tokens."""
    keys = list(keys)
    tokens = latest_records(instance, AssetKey([ds.name, LAST_SHARD_STAGE]), keys)
    latest: dict[str, EventLogRecord] = {}
    for stage in stages:
        observed = latest_records(
            instance, AssetKey([ds.name, stage]), keys, DagsterEventType.ASSET_OBSERVATION
        )
        for key, record in observed.items():
            if key not in latest or record.storage_id > latest[key].storage_id:
                latest[key] = record
    failures = {}
    for key, record in latest.items():
        fingerprint = _metadata(record, FAILED)
        made = tokens.get(key)
        if fingerprint is not None and (made is None or made.storage_id < record.storage_id):
            failures[key] = ShardFailure(fingerprint, _metadata(record, "error") or "")
    return failures


def token_status(
    instance: DagsterInstance, ds: DatasetConfig, keys: Sequence[str]
) -> dict[str, str | None]:
    """Each shard's status at ``<ds>/tokens`` as Dagster tracks it (``MATERIALIZED``,
    ``IN_PROGRESS``, ``FAILED``; None: never attempted), from its partition status cache."""
    status = instance.get_status_by_partition(
        AssetKey([ds.name, LAST_SHARD_STAGE]), keys, shard_partitions(ds.name)
    )
    found = status or {}
    return {key: one.value if (one := found.get(key)) else None for key in keys}


def latest_materialization(instance: DagsterInstance, key: AssetKey) -> EventLogRecord | None:
    """The latest materialization record of an unpartitioned asset (None: never built)."""
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=1)
    return records.records[0] if records.records else None


def recorded_version(instance: DagsterInstance, key: AssetKey) -> str | None:
    """The data version of an unpartitioned asset's latest materialization (None: never)."""
    record = latest_materialization(instance, key)
    materialization = record.asset_materialization if record else None
    tags = materialization.tags if materialization else None
    return tags.get(DATA_VERSION_TAG) if tags else None


def expected_versions(
    instance: DagsterInstance,
    recipe: Recipe,
    keys: Mapping[str, list[str]],
    ledger: Sequence[Mapping[str, Any]] = (),
) -> dict[AssetKey, str]:
    """The data version each merged, nanoset and blend asset would record if rebuilt now, from
    the shard records of ``keys`` (dataset -> current shards in merge order) and the takedown
    ``ledger`` (the audit records on the root) alone: a merge is built from the shards whose
    tokens are recorded by a good run (``assets.support.complete``)."""
    expected: dict[AssetKey, str] = {}
    nanosets: dict[str, str] = {}
    for ds in recipe.datasets:
        records = shard_records(instance, ds, keys[ds.name])
        complete = [k for k in keys[ds.name] if records[k].content_hash and records[k].tokens_ok]
        inputs = [(k, records[k].content_hash) for k in complete]
        masks = masks_for(ledger, ds.name, inputs)
        merged = merged_data_version(ds, inputs, recipe.merge, masks)
        nanosets[ds.name] = nanoset_data_version(merged, recipe.nanoset)
        expected[AssetKey([ds.name, "merged"])] = merged
        expected[AssetKey([ds.name, "nanoset"])] = nanosets[ds.name]
    for blend in recipe.blends:
        members = [(name, nanosets[name]) for name in blend.datasets]
        expected[AssetKey(["blend", blend.name])] = blend_data_version(
            blend, recipe.nanoset, members
        )
    return expected
