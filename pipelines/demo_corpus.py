"""The demo corpus: real text from the Python standard library, as JSONL shards.

``python -m pipelines.demo_corpus [--recipe recipes/demo.yaml]`` fills the sources of the
recipe's ``docs`` dataset (module docstrings and comments: prose, 3 shards plus one shard with
bad lines to show the quarantine) and ``code`` dataset (whole source files, 3 shards, the last
gzipped). A source that already holds files is left alone, so a second ``make demo`` finds
everything up to date.
"""

import argparse
import json
import sys
from pathlib import Path

from tokenmill.atomic import remove_temp_dir, write_bytes
from tokenmill.recipe import load_recipe, recipe_path
from tokenmill_dev.corpus import stdlib_documents, write_jsonl_shards

CODE_BYTES = 4 << 20
SHARDS = 3
HELD_BACK = 40  # docs documents that go into the shard with bad lines
BAD_LINES = [
    b'{"text": "an unterminated string}',
    b'{"title": "a record without the text field"}',
    b'{"text": 42}',
    b'["not", "an", "object"]',
    b'{"text": "invalid UTF-8 \xff\xfe"}',
]


def write_docs(source: Path) -> list[Path]:
    """Prose shards, plus ``extra-00000.jsonl`` with good records and a few bad lines."""
    docs = list(stdlib_documents(kind="docs"))
    paths = write_jsonl_shards(
        iter(docs[:-HELD_BACK]), source, shards=SHARDS, max_bytes=1 << 40, stem="part"
    )
    lines = [json.dumps(d, ensure_ascii=False).encode() for d in docs[-HELD_BACK:]]
    for i, bad in enumerate(BAD_LINES):
        lines.insert(1 + i * (len(lines) // len(BAD_LINES)), bad)
    extra = source / "extra-00000.jsonl"
    write_bytes(extra, b"\n".join(lines) + b"\n")
    remove_temp_dir(source)  # shards only, as in a real source
    return [*paths, extra]


def write_code(source: Path) -> list[Path]:
    """Whole source files, round-robin into shards up to ``CODE_BYTES``; the last gzipped."""
    return write_jsonl_shards(
        stdlib_documents(kind="code"), source, shards=SHARDS, max_bytes=CODE_BYTES, gzip_last=True
    )


def main(argv: list[str] | None = None) -> int:
    """Write the corpus into empty sources; print what was written or kept."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.demo_corpus", description=__doc__)
    parser.add_argument("--recipe", help="recipe whose docs/code sources to fill")
    recipe = load_recipe(recipe_path(parser.parse_args(argv).recipe))
    for name, writer in (("docs", write_docs), ("code", write_code)):
        source = Path(recipe.dataset(name).source)
        if source.is_dir() and any(source.iterdir()):
            print(f"demo corpus: {source} already has shards; kept as they are")
            continue
        paths = writer(source)
        size = sum(p.stat().st_size for p in paths)
        print(f"demo corpus: wrote {len(paths)} {name} shards ({size / 1e6:.1f} MB) to {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
