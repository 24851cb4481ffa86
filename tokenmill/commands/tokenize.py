"""``tokenmill tokenize``: JSONL/Parquet -> Megatron .bin/.idx (preprocess_data.py, faster)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tokenmill.commands import BAD_RECORD_HELP, throughput
from tokenmill.errors import ConfigError


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's or a job's
    share), not every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``tokenize`` subcommand."""
    p = sub.add_parser(
        "tokenize",
        help="tokenize JSONL/Parquet into a .bin/.idx pair",
        description="Write {P}_{text_key}_document.{bin,idx} (+ manifests/{P}_{text_key}_"
        "document.manifest.json) as Megatron's "
        "preprocess_data.py --tokenizer-type HuggingFaceTokenizer does (a fast engine only "
        "where verified; risky documents go to the reference; the manifest says what was "
        "verified).",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", type=Path)
    p.add_argument("--output-prefix", required=True, metavar="P")
    p.add_argument("--tokenizer", required=True, metavar="DIR_OR_FILE")
    p.add_argument("--text-key", default="text", help="JSON field (Parquet column) of the text")
    p.add_argument("--append-eod", action="store_true", help="end each document with eos")
    p.add_argument(
        "--workers",
        type=_positive,
        default=usable_cores(),
        help="worker processes (default: the cores this process may use); output is the same "
        "for any N",
    )
    p.add_argument(
        "--on-bad-record", choices=["fail", "quarantine"], default="fail", help=BAD_RECORD_HELP
    )


def run(args: argparse.Namespace) -> int:
    """Tokenize and print a one-line summary."""
    # Tokenizing never calls BLAS: one OpenBLAS thread makes numpy's import ~0.1 CPU-s cheaper.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from tokenmill.tokenize.run import tokenize_files

    if not args.text_key:
        raise ConfigError("--text-key must not be empty")
    res = tokenize_files(
        args.input,
        args.output_prefix,
        args.tokenizer,
        text_key=args.text_key,
        append_eod=args.append_eod,
        workers=args.workers,
        on_bad_record=args.on_bad_record,
    )
    if res.reused:
        print(f"up to date: {res.prefix} already holds these inputs tokenized with these settings")
        return 0
    fallback = f" (after {'; '.join(res.fallbacks)})" if res.fallbacks else ""
    print(
        f"tokenized {len(args.input)} inputs -> {res.prefix}: {res.documents} documents, "
        f"{res.tokens} tokens, {res.quarantined} quarantined, engine {res.engine}{fallback}, "
        f"{res.seconds:.2f}s ({throughput(res.bytes_read, res.seconds)})"
    )
    return 0
