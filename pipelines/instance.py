"""The embedded Dagster instance: SQLite storage under a repo-local ``DAGSTER_HOME``.

``python -m pipelines.instance [DIR]`` creates the directory and, when it has none, a
``dagster.yaml`` that keeps Dagster's default SQLite storage, turns telemetry and the UI's
first-visit dialog (``nux``, which covers headless screenshots) off and lets at most two runs
execute at once (a burst of new shards queues instead of overloading the machine). An existing
``dagster.yaml`` (e.g. production Postgres settings) is never touched. It then sets the
single-writer pools of the unpartitioned assets to one slot in the instance's database
(:func:`ensure_pool_limits`; ``dagster.yaml`` cannot name per-pool limits), as ``tokenmill
materialize`` does before each call: run it once against a production ``DAGSTER_HOME`` too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.atomic import write_bytes

if TYPE_CHECKING:
    from dagster import DagsterInstance

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_HOME = REPO_ROOT / ".dagster_home"
MAX_CONCURRENT_RUNS = 2
EMBEDDED_CONFIG = f"""# Written by pipelines/instance.py: Dagster's default SQLite storage here.
telemetry:
  enabled: false
nux:
  enabled: false
concurrency:
  runs:
    max_concurrent_runs: {MAX_CONCURRENT_RUNS}
"""


def ensure_dagster_home(path: str | os.PathLike[str] | None = None) -> Path:
    """Create ``path`` (default ``$DAGSTER_HOME`` or ``<repo>/.dagster_home``) with a config."""
    home = Path(path or os.environ.get("DAGSTER_HOME") or DEFAULT_HOME).resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        write_bytes(config, EMBEDDED_CONFIG.encode())
    return home


def ensure_pool_limits(instance: DagsterInstance) -> list[str]:
    """Give each single-writer pool (``assets.support.pointers.SINGLE_WRITER_POOLS``) one slot,
    so two runs never build the same unpartitioned asset at once; returns the pools changed.
    Slots still claimed by runs that ended (or are gone) are freed on the way: a slot held by
    a finished run would hold every later build of its asset."""
    from dagster import DagsterRunStatus

    from assets.support.dagster_private import free_pool_slots, pool_slots, set_pool_slots
    from assets.support.pointers import SINGLE_WRITER_POOLS

    ended = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
    changed = []
    for pool in SINGLE_WRITER_POOLS:
        slots, default, holders = pool_slots(instance, pool)
        if slots != 1 or default:
            set_pool_slots(instance, pool, 1)
            changed.append(pool)
        for run_id in holders:
            run = instance.get_run_by_id(run_id)
            if run is None or run.status in ended:
                free_pool_slots(instance, run_id)
    return changed


if __name__ == "__main__":
    from dagster import DagsterInstance

    home = ensure_dagster_home(sys.argv[1] if len(sys.argv) > 1 else None)
    os.environ["DAGSTER_HOME"] = str(home)
    with DagsterInstance.get() as dagster_instance:
        ensure_pool_limits(dagster_instance)
    print(home)
