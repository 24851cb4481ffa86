"""A job for ``test_s3_run_cache_multiprocess.py``: two assets on the S3 root named by the
environment, run by Dagster's multiprocess executor, each staging the same object. Imported as
``tests.prod.run_cache_job`` so that step processes can import it from the repo root."""

from __future__ import annotations

import os
from pathlib import Path

from dagster import (
    Definitions,
    JobDefinition,
    asset,
    define_asset_job,
    multiprocess_executor,
)

from assets.support.resources import StorageResource


def _stage(storage: StorageResource, name: str) -> None:
    """Stage ``x.txt`` and record this process, the run cache and the staged file's inode."""
    with storage.workspace(["x.txt"], upload=False) as ws:
        assert ws.stage is not None and ws.stage.cache is not None
        staged = ws.stage.local / "x.txt"
        out = Path(os.environ["TM_MP_OUT"]) / name
        out.write_text(f"{os.getpid()} {ws.stage.cache.root} {staged.stat().st_ino}")


@asset
def first(storage: StorageResource) -> None:
    _stage(storage, "first")


@asset(deps=[first])
def second(storage: StorageResource) -> None:
    _stage(storage, "second")


def both_job() -> JobDefinition:
    """``first`` then ``second``, each in its own process, on the S3 root of the environment."""
    defs = Definitions(
        assets=[first, second],
        jobs=[define_asset_job("both", executor_def=multiprocess_executor)],
        resources={
            "storage": StorageResource(
                root=os.environ["TM_MP_ROOT"], work_dir=os.environ["TM_MP_WORK"]
            )
        },
    )
    return defs.resolve_job_def("both")
