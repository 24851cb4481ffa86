"""``takedowns``: the recipe's takedown list (``takedown: {list, reason}``) recorded in the ledger.

The asset resolves the list on the storage root and writes its audit record
(``tokenmill.takedown.record_takedown``: ``takedowns/<id>.json``); every ``<ds>/merged`` takes it
as an input, so a changed list makes them stale, and each merge masks what the ledger names
(:func:`read_storage_ledger`, CLI takedowns included). The takedown sensor
(``pipelines/sensors.py``) requests this asset when the list file changes.
"""

from pathlib import Path
from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.metadata import path_value
from assets.support.resources import StorageResource
from tokenmill.recipe import TakedownConfig
from tokenmill.storage import layout
from tokenmill.takedown import list_sha256, read_ledger, record_takedown

TAKEDOWNS = AssetKey(["takedowns"])


def read_storage_ledger(storage: StorageResource) -> list[dict[str, Any]]:
    """Every audit record on the storage root (staged from S3 first; a few small files)."""
    keys = [k for k in storage.list_keys([f"{layout.TAKEDOWNS}/"]) if k.endswith(".json")]
    if not keys:
        return []
    with storage.workspace(keys, upload=False) as ws:
        return read_ledger(ws.storage.local_root())


def list_recorded(ledger: list[dict[str, Any]], path: str) -> bool:
    """True when the ledger holds a record of the list file at ``path`` as it is now (its
    sha256); False for a new or changed list, or one not there (the asset then says why)."""
    if not Path(path).is_file():
        return False
    digest = list_sha256(path)
    return any(record["list"]["sha256"] == digest for record in ledger)


def build_takedowns(cfg: TakedownConfig) -> AssetsDefinition:
    """The ``takedowns`` asset of a recipe with a takedown list."""

    @asset(
        key=TAKEDOWNS,
        group_name="takedowns",
        kinds={"json"},
        description=f"The takedown list {cfg.list} resolved to documents and recorded in the "
        "ledger (takedowns/<id>.json); every merged dataset masks them.",
    )
    def takedowns(context: AssetExecutionContext, storage: StorageResource) -> MaterializeResult:
        if storage.is_s3 or cfg.list is None:
            raise Failure(
                f"takedown list {cfg.list}: resolved on a local storage root only (it reads the "
                f"shards' sources); run `tokenmill takedown` against a local copy of {storage.root}"
            )
        record = record_takedown(storage.local_root(), cfg.list, cfg.reason)
        for query in record["unmatched"]:
            context.log.warning(f"takedown list {cfg.list}: {query}: no document")
        key = layout.takedown_record(str(record["id"]))
        metadata: dict[str, Any] = {
            "list": MetadataValue.path(str(cfg.list)),
            "list_sha256": record["list"]["sha256"],
            "documents": len(record["documents"]),
            "unmatched": MetadataValue.json(record["unmatched"]),
            "audit_record": path_value(storage.path(key)),
        }
        return MaterializeResult(metadata=metadata, data_version=DataVersion(str(record["id"])))

    return takedowns
