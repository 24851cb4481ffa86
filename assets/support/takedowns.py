"""The takedown ledger as the pipeline reads it: the audit records on the storage root
(``tokenmill.takedown``), and whether the recipe's list is recorded there yet."""

from pathlib import Path
from typing import Any

from dagster import AssetKey

from assets.support.resources import StorageResource
from tokenmill.formats.takedown_records import list_sha256, read_ledger
from tokenmill.storage import layout

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
