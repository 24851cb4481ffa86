"""Deterministic real-text JSONL from the Python standard library sources, for benchmarks.

``python bench/corpus.py OUT.jsonl --mb 20`` writes one ``{"id": ..., "text": ...}`` line per
stdlib ``.py`` file (sorted paths, site-packages excluded, non-UTF-8 files skipped; about 30 MB a
pass), starting over with ids suffixed ``#pass`` until the size is reached. The same interpreter
gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MB = 1_000_000
OUT = Path(__file__).resolve().parent / "out"


def stdlib_texts() -> Iterator[tuple[str, str]]:
    """``(relative path, source text)`` for every UTF-8 stdlib ``.py`` file, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield rel.as_posix(), text


def write_corpus(out: Path, megabytes: float) -> int:
    """Write whole lines until at least ``megabytes`` MB; returns the byte count."""
    target = int(megabytes * MB)
    files = list(stdlib_texts())
    if not files:
        raise RuntimeError(f"no stdlib sources under {sysconfig.get_paths()['stdlib']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    written, pass_no = 0, 0
    with open(tmp, "wb") as fh:
        while written < target:
            for rel, text in files:
                doc_id = rel if pass_no == 0 else f"{rel}#{pass_no}"
                data = (
                    json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n"
                ).encode()
                fh.write(data)
                written += len(data)
                if written >= target:
                    break
            pass_no += 1
    tmp.replace(out)
    return written


def ensure_corpus(megabytes: float) -> Path:
    """``bench/out/corpus-<N>mb.jsonl``, built on first use (deterministic, so reused after)."""
    out = OUT / f"corpus-{megabytes:g}mb.jsonl"
    if not out.is_file():
        write_corpus(out, megabytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--mb", type=float, default=20.0, help="size in MB (default 20)")
    args = parser.parse_args()
    n = write_corpus(args.out, args.mb)
    print(f"{args.out}: {n / MB:.1f} MB")


if __name__ == "__main__":
    main()
