"""``make bench``: run every benchmark (each prints a table and writes bench/out/*.json)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["bench_tokenize.py", "bench_merge.py", "bench_index.py", "bench_loader.py"]


def main() -> int:
    """Run each benchmark script with its defaults; stop at the first failure."""
    for name in BENCHES:
        print(f"\n=== {name} ===", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / name)])
        if rc:
            print(f"{name} failed with exit code {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
