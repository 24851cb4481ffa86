"""Asset checks. Blocking ones stop a run before a bad artifact reaches the stage after it.

- ``<ds>/raw_jsonl``  ``documents_accounted``: lines = documents + quarantined + blank, the
  quarantine file holds exactly the quarantined lines, and not all of them (the likely cause,
  e.g. a wrong ``text_key`` against the keys the records have, is named); ``not_empty`` (WARN,
  non-blocking): an empty shard (0 bytes or 0 documents) is counted and shown.
- ``<ds>/hf_dataset`` ``rows_match_raw``: Parquet rows = the shard's good documents, so
  documents in = documents out + quarantined (an ``hf``-format dataset, which has no raw stage:
  and its quarantine file complete, and ``not_empty`` as above).
- ``<ds>/tokens``     ``idx_bin_consistent`` (header, pointers, sizes, sha256 vs manifest) and
  ``documents_match_export`` (tokenized documents = Parquet rows).
- ``<ds>/merged``     ``sum_of_shards``: documents, sequences and tokens of the current version =
  Σ over the inputs its manifest records (not the live partition set, which moves);
  ``quarantine_share``: the quarantined share of the dataset's records (from the shards'
  validation records) at most the dataset's ``max_quarantine_fraction``;
  ``shards_left_out`` (WARN, non-blocking): the registered shards the current version left out
  (not tokenized yet, in progress, failed), each with its reason.
- ``<ds>/nanoset``    ``index_bounds``: every split's cached index present (never built here),
  hashes intact, every value inside its array/split.
- ``blend/<name>``    ``proportions``: files match the manifest; realized shares within
  tolerance of the requested weights (non-blocking: nothing is built from a blend).

Checks only read: a missing artifact fails its check, nothing is built or repaired.
"""

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetKey,
    DagsterInstance,
    MetadataValue,
    PreviewWarning,
    asset_check,
)

from assets.hf_export import read_export_record
from assets.raw import empty_reason
from assets.shards import each_shard
from assets.support.complete import LEFT_OUT
from assets.support.partitions import shard_keys, shard_partitions
from assets.support.resources import StorageResource, Workspace, display_path
from assets.support.staleness import latest_records
from tokenmill.errors import TokenmillError
from tokenmill.formats.dataset_manifest import (
    dataset_manifest_path,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDataset, index_file_path
from tokenmill.formats.shard_records import read_record
from tokenmill.formats.virtual_merge import is_virtual
from tokenmill.indices.nanoset import (
    SPLITS,
    NanosetIndex,
    build_or_load,
    masked_of,
    split_ranges,
    verify_index,
)
from tokenmill.ingest.quarantine import quarantine_cause
from tokenmill.recipe import BlendConfig, DatasetConfig, NanosetConfig
from tokenmill.storage import layout
from tokenmill.verify import realized_shares, verify_blend, verify_dataset

# A shard's checks must run per partition; Dagster 1.13 supports that (``partitions_def`` on a
# check) but labels it preview. We rely on it deliberately, so its warning is not news.
warnings.filterwarnings(
    "ignore", message=".*partitions_def on an AssetCheckSpec.*", category=PreviewWarning
)

# Realized share may differ from the requested weight by this much plus two samples' worth.
PROPORTION_TOLERANCE = 0.01
COUNTS = ("documents", "sequences", "tokens")


def _result(
    problems: list[str], *, severity: AssetCheckSeverity = AssetCheckSeverity.ERROR, **metadata: Any
) -> AssetCheckResult:
    return AssetCheckResult(
        passed=not problems,
        severity=severity,
        metadata={**metadata, "problems": "\n".join(problems) or "none"},
    )


def shard_check(
    ds: DatasetConfig,
    stage: str,
    check: Callable[[StorageResource, str], AssetCheckResult],
    *,
    blocking: bool = True,
) -> AssetChecksDefinition:
    """A check of ``<ds>/<stage>`` run per shard partition, ``check(storage, key)`` on each
    shard of the step (``each_shard``), named and described by ``check``'s name and docstring."""

    @asset_check(
        name=check.__name__,
        asset=AssetKey([ds.name, stage]),
        blocking=blocking,
        partitions_def=shard_partitions(ds.name),
        description=check.__doc__,
    )
    def per_shard(
        context: AssetCheckExecutionContext, storage: StorageResource
    ) -> AssetCheckResult:
        return each_shard(context, lambda key: check(storage, key))

    return per_shard


def raw_stats(ws: Workspace, ds: DatasetConfig, key: str) -> dict[str, Any]:
    """The shard's raw stats record (both validation stages write it), staged in ``ws``."""
    path = ws.storage.raw_stats_path(ds.name, key)
    return read_record(path, shown=display_path(path))


def raw_checks(ds: DatasetConfig) -> list[AssetChecksDefinition]:
    """Checks of ``<ds>/raw_jsonl``."""

    def documents_accounted(storage: StorageResource, key: str) -> AssetCheckResult:
        """lines = documents + quarantined + blank; quarantine file complete"""
        inputs = [layout.raw_stats(ds.name, key), layout.quarantine(ds.name, key)]
        with storage.workspace(inputs, upload=False) as ws:
            stats = raw_stats(ws, ds, key)
            problems = []
            total = stats["documents"] + stats["quarantined"] + stats["blank"]
            if total != stats["lines"]:
                problems.append(f"{stats['lines']} lines but {total} documents+quarantined+blank")
            problems += quarantine_problems(ws.storage, ds, key, stats)
            return _result(problems, lines=stats["lines"], quarantined=stats["quarantined"])

    return [shard_check(ds, "raw_jsonl", documents_accounted), not_empty_check(ds, "raw_jsonl")]


def not_empty_check(ds: DatasetConfig, stage: str) -> AssetChecksDefinition:
    """``not_empty`` (WARN) on the dataset's validation stage (``raw_jsonl``, or ``hf_dataset``
    for an ``hf``-format dataset): an empty shard is counted and shown, never silent. Both
    stages write the same raw stats record, which is all it reads."""

    def not_empty(storage: StorageResource, key: str) -> AssetCheckResult:
        """the shard has documents (WARN for an empty one: 0 bytes or 0 documents)"""
        with storage.workspace([layout.raw_stats(ds.name, key)], upload=False) as ws:
            stats = raw_stats(ws, ds, key)
            problems = [] if stats["documents"] else [f"empty shard: {empty_reason(stats)}"]
            return _result(problems, severity=AssetCheckSeverity.WARN, documents=stats["documents"])

    return shard_check(ds, stage, not_empty, blocking=False)


def quarantine_problems(
    storage: StorageResource, ds: DatasetConfig, key: str, stats: dict[str, Any]
) -> list[str]:
    """The quarantine file (if the stats name one) must hold exactly the quarantined records,
    and not every record: a shard with no document left is a systematic problem, named."""
    if stats["quarantine"] is None:
        return []
    path = storage.quarantine_path(ds.name, key)
    with open(path, "rb") as fh:
        held = sum(1 for _ in fh)
    if held != stats["quarantined"]:
        return [f"quarantine file holds {held} lines, {stats['quarantined']} counted"]
    if stats["documents"] == 0:
        return [
            f"{key}: all {held} records were quarantined: {quarantine_cause(path, ds.text_key)} "
            f"(fix datasets.{ds.name}.text_key or the data)"
        ]
    return []


def export_checks(ds: DatasetConfig) -> list[AssetChecksDefinition]:
    """Checks of ``<ds>/hf_dataset`` (with ``not_empty`` for an ``hf``-format dataset, which
    has no raw stage)."""

    def rows_match_raw(storage: StorageResource, key: str) -> AssetCheckResult:
        """documents in = Parquet rows + quarantined"""
        inputs = [layout.raw_stats(ds.name, key), layout.quarantine(ds.name, key)]
        inputs.append(layout.parquet(ds.name, key))
        with storage.workspace(inputs, upload=False) as ws:
            stats = raw_stats(ws, ds, key)
            rows = pq.read_metadata(ws.storage.parquet_path(ds.name, key)).num_rows
            documents_in = stats["lines"] - stats["blank"]
            problems = []
            if documents_in != rows + stats["quarantined"]:
                problems.append(
                    f"{documents_in} documents in, {rows} rows + "
                    f"{stats['quarantined']} quarantined out"
                )
            if not ds.has_raw_stage:  # no raw_jsonl check: this step wrote the quarantine
                problems += quarantine_problems(ws.storage, ds, key, stats)
            return _result(problems, documents_in=documents_in, rows=rows)

    if ds.has_raw_stage:
        return [shard_check(ds, "hf_dataset", rows_match_raw)]
    return [shard_check(ds, "hf_dataset", rows_match_raw), not_empty_check(ds, "hf_dataset")]


def token_checks(ds: DatasetConfig) -> list[AssetChecksDefinition]:
    """Checks of ``<ds>/tokens``."""

    def idx_bin_consistent(storage: StorageResource, key: str) -> AssetCheckResult:
        """.idx header/pointers agree with the .bin; sizes and sha256 match the manifest."""
        rel = layout.tokens_prefix(ds.name, key, ds.text_key)
        with storage.workspace(layout.dataset_files(rel), upload=False) as ws:
            prefix = ws.storage.tokens_prefix(ds.name, key, ds.text_key)
            return _result(verify_dataset(prefix, full=True), prefix=str(prefix))

    def documents_match_export(storage: StorageResource, shard: str) -> AssetCheckResult:
        """Tokenized documents = Parquet rows of the shard (as its export record states them)."""
        tokens = layout.tokens_prefix(ds.name, shard, ds.text_key)
        inputs = [f"{tokens}.idx", layout.export_record(ds.name, shard)]
        with storage.workspace(inputs, upload=False) as ws:
            rows = int(read_export_record(ws.storage, ds, shard)["num_rows"])
            with IndexedDataset(ws.storage.path(tokens), index_only=True) as data:
                documents = data.num_documents
            problems = (
                [] if documents == rows else [f"{documents} documents tokenized, {rows} rows"]
            )
            return _result(problems, documents=documents, rows=rows)

    checks = (idx_bin_consistent, documents_match_export)
    return [shard_check(ds, "tokens", check) for check in checks]


def merged_checks(ds: DatasetConfig) -> list[AssetChecksDefinition]:
    """Checks of ``<ds>/merged``."""

    @asset_check(asset=AssetKey([ds.name, "merged"]), blocking=True)
    def sum_of_shards(storage: StorageResource) -> AssetCheckResult:
        """Merged documents, sequences and tokens (from the current version's .idx) = the sums
        over the inputs its manifest records; sizes match the manifest."""
        pointer = layout.merged_pointer(ds.name)
        with storage.workspace([pointer], upload=False) as ws:
            rel = ws.storage.merged_key(ds.name, ds.text_key)
            prefix = ws.storage.path(rel)
            ws.fetch([layout.dataset_manifest(rel)])
            manifest = read_dataset_manifest(prefix)
            if is_virtual(manifest):
                return _virtual_sum_of_shards(ws, ds, prefix, manifest)
            ws.fetch([f"{rel}.idx"])
            expected = dict.fromkeys(COUNTS, 0)
            for entry in manifest["inputs"]:
                for name in COUNTS:
                    expected[name] += int(entry["counts"][name])
            problems = []
            idx = index_file_path(prefix)
            if idx.stat().st_size != manifest["files"][idx.name]["bytes"]:
                problems.append(f"{idx}: size differs from the manifest")
            with IndexedDataset(prefix, index_only=True) as data:
                found = {
                    "documents": data.num_documents,
                    "sequences": len(data),
                    "tokens": data.num_tokens,
                }
            problems += [
                f"{n}: merged {found[n]}, its {len(manifest['inputs'])} inputs sum to {expected[n]}"
                for n in COUNTS
                if found[n] != expected[n]
            ]
            totals: dict[str, Any] = {f"expected_{n}": v for n, v in expected.items()}
            return _result(problems, inputs=len(manifest["inputs"]), **totals)

    @asset_check(
        asset=AssetKey([ds.name, "merged"]),
        blocking=True,
        description="quarantined records / all records <= max_quarantine_fraction",
    )
    def quarantine_share(context: AssetCheckExecutionContext) -> AssetCheckResult:
        """From the shards' validation records in the instance (no file is read)."""
        counts = recorded_counts(context.instance, ds)
        metadata: dict[str, Any] = dict(counts)
        return _result(quarantine_share_problems(ds, counts), **metadata)

    @asset_check(
        asset=AssetKey([ds.name, "merged"]),
        blocking=False,
        description="every registered shard is in the current version (WARN names those left "
        "out: not tokenized yet, in progress, or failed)",
    )
    def shards_left_out(context: AssetCheckExecutionContext) -> AssetCheckResult:
        event = context.instance.get_latest_materialization_event(AssetKey([ds.name, "merged"]))
        found = event.asset_materialization if event else None
        value = found.metadata.get(LEFT_OUT) if found else None
        left_out: dict[str, str] = dict(value.value) if value is not None else {}  # type: ignore[arg-type]
        problems = [f"{key}: {reason}" for key, reason in left_out.items()]
        listed = MetadataValue.json(sorted(left_out))
        return _result(problems, severity=AssetCheckSeverity.WARN, left_out=listed)

    return [sum_of_shards, quarantine_share, shards_left_out]


def recorded_counts(instance: DagsterInstance, ds: DatasetConfig) -> dict[str, int]:
    """Documents and quarantined records over the dataset's current shards, as their
    validation step (``raw_jsonl``, or ``hf_dataset`` without one) recorded them."""
    stage = "raw_jsonl" if ds.has_raw_stage else "hf_dataset"
    records = latest_records(instance, AssetKey([ds.name, stage]), shard_keys(instance, ds))
    counts = {"documents": 0, "quarantined": 0}
    for record in records.values():
        metadata = record.asset_materialization.metadata if record.asset_materialization else {}
        for name in counts:
            entry = metadata.get(name)
            counts[name] += int(entry.value) if entry is not None else 0  # type: ignore[arg-type]
    return counts


def quarantine_share_problems(ds: DatasetConfig, counts: dict[str, int]) -> list[str]:
    """The dataset's quarantined share of its records must not pass the recipe's
    ``max_quarantine_fraction``: past it the cause is systematic (a wrong text_key, a broken
    export), not a few bad lines."""
    quarantined = counts["quarantined"]
    total = quarantined + counts["documents"]
    if not total or quarantined / total <= ds.max_quarantine_fraction:
        return []
    return [
        f"{ds.name}: {quarantined:,} of {total:,} records quarantined "
        f"({quarantined / total:.1%}), more than datasets.{ds.name}.max_quarantine_fraction "
        f"{ds.max_quarantine_fraction:g}; look at the quarantine files under raw/{ds.name}/, "
        "fix the data or the recipe, or raise the setting"
    ]


def _virtual_sum_of_shards(
    ws: Any, ds: DatasetConfig, prefix: Path, manifest: dict[str, Any]
) -> AssetCheckResult:
    """A virtual merge: its counts add up to its shards' records (checked on read), and every
    shard pair it names still has the content hash it recorded (the token manifests, staged)."""
    shards = manifest["shards"]
    keys = [str(s["key"]) for s in shards]
    tokens = [layout.tokens_prefix(ds.name, k, ds.text_key) for k in keys]
    ws.fetch([layout.dataset_manifest(t) for t in tokens])
    problems = []
    for shard, key in zip(shards, tokens, strict=True):
        pair = Path(os.path.normpath(prefix.parent / str(shard["prefix"])))
        if pair != ws.storage.path(key):
            problems.append(f"shard {shard['key']!r}: names {pair}, not the dataset's tokens")
        elif not dataset_manifest_path(pair).is_file():
            problems.append(f"shard {shard['key']!r}: its token pair is gone ({key})")
        elif read_dataset_manifest(pair)["content_hash"] != shard["content_hash"]:
            problems.append(f"shard {shard['key']!r}: re-tokenized since the merge")
    counts = manifest["counts"]
    return _result(problems, inputs=len(shards), **{f"expected_{n}": counts[n] for n in COUNTS})


def index_problems(
    index: NanosetIndex, lengths: np.ndarray, split_range: tuple[int, int] | None
) -> list[str]:
    """Out-of-range values in one split's document/sample/shuffle index (``split_range``
    None: growing semantics, any document of the dataset)."""
    doc, sample, shuffle = index.document_index, index.sample_index, index.shuffle_index
    lo, hi = split_range or (0, len(lengths))
    problems = []
    if doc.size and (int(doc.min()) < lo or int(doc.max()) >= hi):
        problems.append(f"{index.split}: document_index outside the split's documents [{lo}, {hi})")
    if sample.ndim != 2 or sample.shape[1] != 2:
        return [*problems, f"{index.split}: sample_index has shape {sample.shape}"]
    rows, offsets = sample[:, 0].astype(np.int64), sample[:, 1].astype(np.int64)
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= len(doc)):
        problems.append(f"{index.split}: sample_index points outside document_index")
    elif offsets.size and (
        int(offsets.min()) < 0 or np.any(offsets > lengths[doc[rows].astype(np.int64)])
    ):
        problems.append(f"{index.split}: sample_index offset outside its document")
    if shuffle.size and (int(shuffle.min()) < 0 or int(shuffle.max()) >= len(sample) - 1):
        problems.append(f"{index.split}: shuffle_index outside [0, {len(sample) - 1})")
    return problems


def nanoset_checks(ds: DatasetConfig, cfg: NanosetConfig) -> list[AssetChecksDefinition]:
    """Checks of ``<ds>/nanoset``."""

    @asset_check(asset=AssetKey([ds.name, "nanoset"]), blocking=True)
    def index_bounds(storage: StorageResource) -> AssetCheckResult:
        """Every split's cached index exists (a missing one fails: checks never build), its
        files match their hashes, and every value lies within its array and split."""
        with storage.workspace([layout.merged_pointer(ds.name)], upload=False) as ws:
            rel = ws.storage.merged_key(ds.name, ds.text_key)
            prefix = ws.storage.path(rel)
            ws.fetch_index(rel)
            with open_dataset(prefix, index_only=True) as data:
                lengths = np.asarray(data.sequence_lengths, dtype=np.int64).copy()
            growing = cfg.semantics == "growing"  # no ranges: splits by document identity
            # nor over a masked merge (ranges count its unmasked documents; the loader's full
            # check refuses an index that reads a masked one)
            unranged = growing or bool(len(masked_of(prefix)))
            ranges = (
                [None] * 3 if unranged else split_ranges(cfg.split, len(lengths), cfg.semantics)
            )
            settings = cfg.settings()
            requested = settings.index_sizes()  # what the nanoset asset requests
            problems: list[str] = []
            for position, split in enumerate(SPLITS):
                try:
                    index = build_or_load(
                        prefix,
                        ws.storage.nanoset_dir(),
                        split,
                        settings,
                        requested[split],
                        build=False,
                        fetch=ws.fetch_index_entry,
                    )
                    if index is None:
                        continue
                    verify_index(index)
                except TokenmillError as exc:
                    problems.append(str(exc))
                    continue
                problems += index_problems(index, lengths, ranges[position])
            return _result(problems, splits=", ".join(SPLITS))

    return [index_bounds]


def blend_checks(blend: BlendConfig) -> list[AssetChecksDefinition]:
    """Checks of ``blend/<name>``."""

    @asset_check(asset=AssetKey(["blend", blend.name]), blocking=False)
    def proportions(storage: StorageResource) -> AssetCheckResult:
        """Manifest matches its files; realized shares within tolerance of the weights."""
        with storage.workspace(upload=False) as ws:
            mpath = ws.blend_manifest(blend.name)
            problems = verify_blend(mpath)
            if problems:
                return _result(problems)
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
            worst = 0.0
            for s in realized_shares(manifest, mpath):
                allowed = PROPORTION_TOLERANCE + 2 / max(s.size, 1)
                worst = max(worst, abs(s.realized - s.requested) if s.weighted else 0.0)
                if s.weighted and abs(s.realized - s.requested) > allowed:
                    problems.append(
                        f"{s.split}/{s.dataset}: realized {s.realized:.4f}, requested "
                        f"{s.requested:.4f} (allowed ±{allowed:.4f})"
                    )
            return _result(problems, worst_difference=round(worst, 6))

    return [proportions]
