"""The servers tests run against, as the fixtures in ``servers.py`` hand them out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class S3:
    """A fresh bucket on the moto server, with a client for setting up and inspecting it."""

    endpoint: str
    bucket: str
    client: Any

    def upload_tree(self, local: Path, prefix: str) -> None:
        """Upload every file under ``local`` to ``prefix/<relative path>``."""
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(local).as_posix()}".lstrip("/")
            self.client.upload_file(str(path), self.bucket, key)

    def keys(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix``, sorted."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


@dataclass(frozen=True)
class Postgres:
    """A throwaway cluster on 127.0.0.1: connection settings for a ``dagster`` database."""

    host: str
    port: int
    user: str
    db: str

    def env(self) -> dict[str, str]:
        """The variables ``infra/dagster.yaml`` reads its Postgres settings from."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USERNAME": self.user,
            "DAGSTER_PG_PASSWORD": "",
            "DAGSTER_PG_DB": self.db,
        }
