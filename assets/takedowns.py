"""``takedowns``: the recipe's takedown list (``takedown: {list, reason}``) recorded in the ledger.

The asset resolves the list on the storage root (local or ``s3://``) and writes its audit record
(``tokenmill.takedown.record_takedown``: ``takedowns/<id>.json``); every ``<ds>/merged`` takes it
as an input, so a changed list makes them stale, and each merge masks what the ledger names
(``assets.support.takedowns``, CLI takedowns included). The takedown sensor
(``pipelines/sensors.py``) requests this asset when the list file changes.
"""

from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetsDefinition,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.metadata import path_value
from assets.support.resources import StorageResource
from assets.support.takedowns import TAKEDOWNS
from tokenmill.recipe import TakedownConfig
from tokenmill.storage import layout
from tokenmill.takedown import record_takedown


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
        if cfg.list is None:
            raise Failure("the recipe's takedown section names no list file")
        # an s3:// root: resolved in a local mirror of its records, the record uploaded
        record = record_takedown(storage.root, cfg.list, cfg.reason)
        for query in record["unmatched"]:
            context.log.warning(f"takedown list {cfg.list}: {query}: no document")
        key = layout.takedown_record(str(record["id"]))
        metadata: dict[str, Any] = {
            "list": MetadataValue.path(str(cfg.list)),
            "list_sha256": record["list"]["sha256"],
            "documents": len(record["documents"]),
            "unmatched": MetadataValue.json(record["unmatched"]),
            "audit_record": MetadataValue.path(f"{storage.root.rstrip('/')}/{key}")
            if storage.is_s3
            else path_value(storage.path(key)),
        }
        return MaterializeResult(metadata=metadata, data_version=DataVersion(str(record["id"])))

    return takedowns
