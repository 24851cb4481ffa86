"""Real text every machine has: the Python standard library's sources, as JSONL shards.

Used by ``make demo``, the benchmarks and tests. Deterministic: the same interpreter gives the
same documents in the same order.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenmill.atomic import atomic_open, remove_temp_dir

MIN_CHARS = 200  # shorter prose or sources (stubs, one-line comments) are skipped


def stdlib_documents(*, kind: str = "all") -> Iterator[dict[str, str]]:
    """One document per stdlib ``.py`` file, sorted by path.

    ``kind="docs"`` yields only module docstrings and comments (prose); ``"code"`` the whole
    source; ``"all"`` both interleaved by file.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "/test" in f"/{rel}":
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if kind in ("docs", "all"):
            prose = _prose(source)
            if len(prose) >= MIN_CHARS:
                yield {"text": prose, "source": rel, "kind": "docs"}
        if kind in ("code", "all") and len(source) >= MIN_CHARS:
            yield {"text": source, "source": rel, "kind": "code"}


# Triple quotes with any string prefix (r, b, u, f, rb, ...): the prefix is code, not prose.
_TRIPLE_QUOTE = re.compile(r"""(?:(?<!\w)[rRbBuUfF]{1,2})?(?:\"\"\"|''')""")


def _prose(source: str) -> str:
    """Comment lines and triple-quoted blocks of a Python file: its English prose."""
    out: list[str] = []
    in_doc = False
    for line in source.splitlines():
        s = line.strip()
        quotes = s.count('"""') + s.count("'''")
        if in_doc or quotes:
            out.append(_TRIPLE_QUOTE.sub("", s))
            if quotes % 2:
                in_doc = not in_doc
        elif s.startswith("#"):
            out.append(s.lstrip("#").strip())
    return "\n".join(x for x in out if x)


def write_jsonl_shards(
    docs: Iterator[dict[str, str]],
    out_dir: str | os.PathLike[str],
    *,
    shards: int,
    max_bytes: int,
    stem: str = "part",
    gzip_last: bool = False,
) -> list[Path]:
    """Write documents round-robin into ``shards`` JSONL files until ``max_bytes`` in total."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[list[bytes]] = [[] for _ in range(shards)]
    total = 0
    for i, doc in enumerate(docs):
        line = (json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8")
        if total + len(line) > max_bytes:
            break
        lines[i % shards].append(line)
        total += len(line)
    paths = []
    for s in range(shards):
        gz = gzip_last and s == shards - 1
        path = out / f"{stem}-{s:05d}.jsonl{'.gz' if gz else ''}"
        data = b"".join(lines[s])
        with atomic_open(path) as fh:
            fh.write(gzip.compress(data, mtime=0) if gz else data)
        paths.append(path)
    remove_temp_dir(out)  # a source folder of shards only, as a sensor lists it
    return paths
