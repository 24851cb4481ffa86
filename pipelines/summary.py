"""The closing summary of ``tokenmill materialize``: counts from the records the steps left in
the Dagster instance (the same records the staleness model reads; no artifact is opened, so an
S3 root costs nothing here), one line per failure with its cause (the full errors go to a log
file), what was not rebuilt and which version is still current, where the blends are, how to
open a current one (after ``tokenmill pull`` for an S3 root), and how to start the UI."""

import os
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagster import AssetKey, DagsterInstance, EventLogRecord
from dagster_shared.error import SerializableErrorInfo

from assets.support.partitions import shard_keys
from assets.support.staleness import latest_materialization, latest_records, recorded_version
from pipelines.instance import DEFAULT_HOME, REPO_ROOT
from pipelines.jobs import shard_stages
from tokenmill.atomic import write_bytes
from tokenmill.indices.nanoset import SPLITS
from tokenmill.recipe import DEFAULT_RECIPE, RECIPE_ENV, DatasetConfig, NanosetConfig, Recipe

# Exceptions whose own message names the file, line or setting (``tokenmill.errors`` and a
# step's deliberate ``Failure``); for any other the code location is added to the line.
OWN_WORDS = {"TokenmillError", "FormatError", "BadRecordError", "InputError", "ConfigError"}
OWN_WORDS |= {"CacheError", "Failure", "BusyError", "InstanceError"}
CHECK_FAILED = "DagsterAssetCheckFailedError"  # a blocking check's failure, reported by itself
PARTITION_TAG = "dagster/partition"


@dataclass(frozen=True)
class RunFailure:
    """One failure of a run: where (step or check, and the shard when known) and why."""

    where: str
    shard: str | None
    cause: str
    detail: str  # the full error with its traceback, for the log file

    def line(self) -> str:
        """``<shard>: <where>: <cause>`` on one line."""
        cause = " ".join(self.cause.split())
        return f"{self.shard + ': ' if self.shard else ''}{self.where}: {cause}"


@dataclass
class DatasetOutcome:
    """What happened to one dataset's shards."""

    name: str
    shards: list[str]
    processed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    failures: list[RunFailure] = field(default_factory=list)


def _innermost(error: SerializableErrorInfo) -> SerializableErrorInfo:
    """The user's exception inside Dagster's wrappers."""
    while error.cls_name and error.cls_name.startswith("Dagster") and error.cause is not None:
        error = error.cause
    return error


def _cause_text(error: SerializableErrorInfo) -> str:
    """The exception's type and own message; with the code location when it is not one of
    ours (whose messages name the file, line or setting themselves)."""
    inner = _innermost(error)
    message = inner.message.strip()
    named, _, rest = message.partition(": ")
    message = rest if named.rsplit(".", 1)[-1] == inner.cls_name else message
    if inner.cls_name in OWN_WORDS:
        return f"{inner.cls_name}: {message}"
    where = ""
    if inner.stack:
        frame = inner.stack[-1].strip().splitlines()[0]  # '  File "x.py", line N, in f'
        parts = frame.replace('"', "").split(", ")
        if len(parts) >= 2 and parts[0].startswith("File "):
            where = f" (at {Path(parts[0][5:]).name}:{parts[1].removeprefix('line ')})"
    return f"{inner.cls_name}: {message}{where}"


def _metadata_value(metadata: Mapping[str, Any], name: str) -> Any:
    entry = metadata.get(name)
    return getattr(entry, "value", entry)


def run_failures(result: Any) -> list[RunFailure]:
    """Every failed step and failed check of an in-process run, one each, with the shard taken
    from structured data: the step failure's ``shard`` metadata (a range step names the shard
    it failed on), a check's ``failed_shards``, or the run's own partition (one shard)."""
    run_shard = result.dagster_run.tags.get(PARTITION_TAG)
    failures = []
    for event in result.get_step_failure_events():
        data = event.step_failure_data
        if _innermost(data.error).cls_name == CHECK_FAILED:
            continue
        user = data.user_failure_data
        shard = _metadata_value(user.metadata if user else {}, "shard") or run_shard
        cause = user.description if user and user.description else _cause_text(data.error)
        where = (event.step_key or "run").replace("__", "/")
        failures.append(RunFailure(where, shard, cause, data.error.to_string()))
    evaluations = result.get_asset_check_evaluations()
    # A range step's check records each shard's evaluation and one for the range, which names
    # the failed shards: report that one alone.
    ranges = {e.asset_check_key for e in evaluations if e.partition is None}
    for evaluation in evaluations:
        if evaluation.passed or (evaluation.partition and evaluation.asset_check_key in ranges):
            continue
        problems = str(_metadata_value(evaluation.metadata, "problems") or evaluation.description)
        named = _metadata_value(evaluation.metadata, "failed_shards")
        shard = ", ".join(named) if named else (evaluation.partition or run_shard)
        where = f"{evaluation.asset_key.to_user_string()} check {evaluation.check_name}"
        failures.append(RunFailure(where, shard, problems.replace("\n", "; "), problems))
    return failures


def write_failure_log(home: Path, failures: Sequence[RunFailure]) -> Path:
    """The full errors (tracebacks included) in ``<home>/logs/materialize-<time>-<pid>.log``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = home / "logs" / f"materialize-{stamp}-{os.getpid()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(f"== {f.line()}\n{f.detail}" for f in failures)
    write_bytes(path, text.encode())
    return path


def shown(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the caller's directory (``tokenmill materialize`` passes it in
    ``$TOKENMILL_DISPLAY_DIR``; default the current one) when it is below it."""
    base = Path(os.environ.get("TOKENMILL_DISPLAY_DIR") or Path.cwd())
    try:
        return str(Path(path).resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


def _metadata(record: EventLogRecord | None) -> dict[str, Any]:
    materialization = record.asset_materialization if record else None
    return {k: v.value for k, v in materialization.metadata.items()} if materialization else {}


def dataset_line(ds: DatasetConfig, outcome: DatasetOutcome, instance: DagsterInstance) -> str:
    """One line per dataset: shards, documents, quarantined lines and tokens."""
    keys = shard_keys(instance, ds)
    first = AssetKey([ds.name, shard_stages(ds)[0]])
    documents = quarantined = 0
    for record in latest_records(instance, first, keys).values():
        meta = _metadata(record)
        documents += int(meta.get("documents", 0))
        quarantined += int(meta.get("quarantined", 0))
    merged = _metadata(latest_materialization(instance, AssetKey([ds.name, "merged"])))
    tokens = f"{merged['tokens']:,} tokens" if "tokens" in merged else "not merged"
    fresh = len(outcome.shards) - len(outcome.processed) - len(outcome.failed)
    text = (
        f"  {ds.name}: {len(outcome.shards)} shards ({len(outcome.processed)} processed, "
        f"{fresh} up to date, {len(outcome.failed)} failed, {len(outcome.removed)} removed) · "
        f"{documents:,} documents · {tokens} · {quarantined:,} quarantined lines"
    )
    notes = [f"    removed (gone from the source): {outcome.removed}"] if outcome.removed else []
    notes += [f"    failed: {outcome.failed}"] if outcome.failed else []
    notes += [f"    FAILED {f.line()}" for f in outcome.failures]
    notes += [f"    not a shard: {r}" for r in outcome.rejected]
    return "\n".join([text, *notes])


def blend_line(name: str, cfg: NanosetConfig, instance: DagsterInstance) -> tuple[str, str] | None:
    """One line per blend (samples per split, where its manifest is) and that place; None when
    the blend was never built."""
    meta = _metadata(latest_materialization(instance, AssetKey(["blend", name])))
    if "path" not in meta:
        return None
    where = str(meta["path"]) if str(meta["path"]).startswith("s3://") else shown(meta["path"])
    sizes = " · ".join(f"{s} {meta[f'{s}_samples']:,}" for s in SPLITS if f"{s}_samples" in meta)
    extra = " (+1 for the labels)" if cfg.add_extra_token else ""
    line = f"  blend {name}: {sizes} samples, sequence length {cfg.sequence_length}{extra}"
    return f"{line} -> {where}", where


def open_hint(manifest: str, name: str, endpoint_url: str | None = None) -> list[str]:
    """How training code opens a blend: directly, or after pulling it from S3 (through
    ``endpoint_url`` when the recipe's storage names one)."""
    lines = ["", "Open a blend from training code:"]
    if manifest.startswith("s3://"):
        endpoint = f" --endpoint-url {endpoint_url}" if endpoint_url else ""
        lines.append(f"    tokenmill pull {manifest} blend-{name}{endpoint}")
        manifest = f"blend-{name}/blends/{name}/manifest.json"
    lines += [
        "    from tokenmill.loader import open_blend",
        f'    ds = open_blend("{manifest}", split="train")',
    ]
    return lines


def still_current(instance: DagsterInstance, key: AssetKey) -> str:
    """``NOT rebuilt; current version is still <v16> from <time>`` (or that none was built)."""
    record = latest_materialization(instance, key)
    version = recorded_version(instance, key)
    if record is None or version is None:
        return "NOT rebuilt; no version was ever built"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.timestamp))
    return f"NOT rebuilt; current version is still {version[:16]} from {when}"


@dataclass
class RunReport:
    """What the downstream step did: assets rebuilt, stale assets left, failures, the log."""

    rebuilt: Sequence[AssetKey] = ()
    not_rebuilt: Sequence[AssetKey] = ()
    failures: Sequence[RunFailure] = ()
    log: Path | None = None


def dev_hint(recipe: Path, dagster_home: Path) -> str:
    """How to browse this run in the UI: ``make dev``, with ``TOKENMILL_RECIPE`` and
    ``DAGSTER_HOME`` set when either differs from the default (else the UI shows the demo)."""
    env = ""
    if recipe.resolve() != (REPO_ROOT / DEFAULT_RECIPE).resolve() or (
        dagster_home.resolve() != DEFAULT_HOME.resolve()
    ):
        quoted = shlex.quote(str(recipe)), shlex.quote(str(dagster_home))
        env = f"{RECIPE_ENV}={quoted[0]} DAGSTER_HOME={quoted[1]} "
    return f"Browse assets, runs, checks and metadata: {env}make dev  (then http://127.0.0.1:3000)"


def print_summary(
    recipe: Recipe,
    outcomes: Sequence[DatasetOutcome],
    report: RunReport,
    instance: DagsterInstance,
) -> None:
    """Print the summary block: one line per dataset, per failure (with its cause), per stale
    asset not rebuilt, per blend; how to open a blend that is current; where the log is."""
    print("\nSummary")
    for ds, outcome in zip(recipe.datasets, outcomes, strict=True):
        print(dataset_line(ds, outcome, instance))
    names = ", ".join(k.to_user_string() for k in report.rebuilt) or "nothing"
    print(f"  downstream rebuilt: {names}")
    for failure in report.failures:
        print(f"  FAILED {failure.line()}")
    left: dict[str, list[str]] = {}
    for key in report.not_rebuilt:
        if key.path[0] != "blend":
            left.setdefault(still_current(instance, key), []).append(key.to_user_string())
    for status, keys in left.items():
        print(f"  {', '.join(keys)}: {status}")
    built = []
    for blend in recipe.blends:
        key = AssetKey(["blend", blend.name])
        found = blend_line(blend.name, recipe.nanoset, instance)
        stale = key in report.not_rebuilt
        line = found[0] if found else f"  blend {blend.name}: not built"
        print(f"{line}\n    {still_current(instance, key)}" if stale and found else line)
        if found and not stale:
            built.append((blend.name, found[1]))
    if built:
        name, where = built[0]
        print("\n".join(open_hint(where, name, recipe.storage.s3_endpoint_url)))
    if report.log is not None:
        print(f"\nFull errors with tracebacks: {shown(report.log)} (or run with -v)")
    home = Path(os.environ.get("DAGSTER_HOME") or DEFAULT_HOME)
    print("\n" + dev_hint(recipe.path, home))
