"""``tokenmill export``: JSONL shards -> Parquet in the Hugging Face layout + dataset_info.json."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tokenmill.commands import BAD_RECORD_HELP
from tokenmill.errors import ConfigError
from tokenmill.ingest.dataset_info import export_input, tokenmill_info, write_dataset_info
from tokenmill.ingest.export import export_shard
from tokenmill.ingest.records import ON_BAD_RECORD, shard_name


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``export`` subcommand."""
    p = sub.add_parser(
        "export",
        help="export JSONL shards as Parquet in the Hugging Face layout",
        description="Write DIR/data/<shard>.parquet for every input (all fields kept) and "
        "DIR/dataset_info.json; loads with datasets.load_dataset('parquet', ...). Each shard "
        "is written atomically; dataset_info.json is written last.",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="FILE")
    p.add_argument("--output-dir", required=True, metavar="DIR")
    p.add_argument("--text-key", default="text", help="field holding the text (default: text)")
    p.add_argument(
        "--on-bad-record",
        choices=ON_BAD_RECORD,
        default="fail",
        help=BAD_RECORD_HELP + " (here DIR/<shard>.quarantine.jsonl, written only when a "
        "line was quarantined)",
    )


def _shards(inputs: list[str]) -> dict[str, str]:
    """``{shard: input}``; inputs must exist and have distinct shard names."""
    shards: dict[str, str] = {}
    for path in inputs:
        if not os.path.isfile(path) and not os.path.isdir(path):
            raise ConfigError(f"--input {path}: no such file")
        name = shard_name(path)
        if name in shards:
            raise ConfigError(f"--input {shards[name]} and {path}: both would be shard {name!r}")
        shards[name] = path
    return shards


def run(args: argparse.Namespace) -> int:
    """Export every input, print one summary line per shard, then write dataset_info.json
    (with each input's absolute path, size and sha256 under ``tokenmill``)."""
    inputs = []
    for shard, path in _shards(args.input).items():
        res = export_shard(
            path,
            args.output_dir,
            text_key=args.text_key,
            on_bad_record=args.on_bad_record,
            shard=shard,
        )
        st = res.stats
        inputs.append(export_input(shard, str(Path(path).resolve()), path, st))
        note = f" -> {res.quarantine_path}" if res.quarantine_path else ""
        print(
            f"{path}: {st.lines} lines, {st.documents} documents ({st.empty_documents} empty), "
            f"{st.blank} blank, {st.quarantined} quarantined{note}; "
            f"wrote {res.parquet_path} ({res.rows} rows, {res.bytes} bytes)"
        )
    inputs.sort(key=lambda i: f"{i['shard']}.parquet")  # the order of dataset_info's shards
    extra = tokenmill_info(inputs, text_key=args.text_key, on_bad_record=args.on_bad_record)
    info = write_dataset_info(Path(args.output_dir), extra=extra)
    print(f"wrote {info}")
    return 0
