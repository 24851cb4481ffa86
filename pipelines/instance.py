"""The embedded Dagster instance: SQLite storage under a repo-local ``DAGSTER_HOME``.

``python -m pipelines.instance [DIR]`` creates the directory and, when it has none, a
``dagster.yaml`` that keeps Dagster's default SQLite storage, turns telemetry and the UI's
first-visit dialog (``nux``, which covers headless screenshots) off and lets at most two runs
execute at once (a burst of new shards queues instead of overloading the machine).
An existing ``dagster.yaml`` (e.g. production Postgres settings) is never touched.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tokenmill.atomic import write_bytes

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


if __name__ == "__main__":
    print(ensure_dagster_home(sys.argv[1] if len(sys.argv) > 1 else None))
