"""``tokenmill explain``: which documents, from which source lines, a blend's samples hold."""

from __future__ import annotations

import argparse

import numpy as np

from tokenmill.commands.inspect import _decoder
from tokenmill.errors import ConfigError
from tokenmill.formats.blend_manifest import SPLITS
from tokenmill.ingest.records import TABLE_SUFFIXES
from tokenmill.provenance import Piece, explain

EXCERPT_CHARS = 160


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``explain`` subcommand."""
    p = sub.add_parser(
        "explain",
        help="map blend samples back to documents and source lines",
        description="For each sample of a blend's --split (by --sample, or every sample of "
        "global batch --step with --global-batch-size, as BatchSampler orders them): one line "
        "per document piece: dataset, shard, source file:line (a Parquet/Arrow source: its row), "
        "the record's id, the piece's token range in the sample and in its document. --text "
        "adds a decoded excerpt.",
    )
    p.add_argument("blend", metavar="BLEND", help="blends/<name>/manifest.json or its folder")
    p.add_argument("--split", choices=SPLITS, default="train", help="blend split")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--sample", type=int, nargs="+", metavar="I", help="sample indices")
    which.add_argument("--step", type=int, metavar="K", help="global batch K (needs -G)")
    p.add_argument("--global-batch-size", "-G", type=int, metavar="G", help="samples per step")
    p.add_argument("--version", metavar="V", help="a blend version (default: the current one)")
    p.add_argument("--text", action="store_true", help="print a decoded excerpt of each piece")
    p.add_argument("--tokenizer", metavar="DIR_OR_FILE", help="tokenizer for --text")


def _line(piece: Piece) -> str:
    where = "source line unknown"
    if piece.line is not None:
        table = str(piece.source).endswith(TABLE_SUFFIXES)
        where = f"{piece.source} row {piece.line}" if table else f"{piece.source}:{piece.line}"
    shard = f"{piece.dataset}/{piece.shard}" if piece.shard else piece.dataset
    doc_id = f" id={piece.doc_id}" if piece.doc_id is not None else ""
    (a, b), (c, d) = piece.sample_range, piece.document_range
    return f"  [{a}, {b}) {shard} document {piece.document} {where}{doc_id} tokens [{c}, {d})"


def run(args: argparse.Namespace) -> int:
    """Print each sample's pieces (and, with --text, their decoded excerpts)."""
    if args.step is not None:
        if not args.global_batch_size or args.global_batch_size < 1 or args.step < 0:
            raise ConfigError("--step K needs --global-batch-size G >= 1 and K >= 0")
        first = args.step * args.global_batch_size
        ids = list(range(first, first + args.global_batch_size))
    else:
        ids = list(args.sample)
    if args.text and not args.tokenizer:
        raise ConfigError("--text needs --tokenizer DIR_OR_FILE to decode the pieces")
    found = explain(args.blend, args.split, ids, version=args.version)
    tok = _decoder(args.tokenizer) if args.text else None
    blend = None
    if tok is not None:
        from tokenmill.loader import open_blend

        blend = open_blend(args.blend, args.split, version=args.version)
    for prov in found:
        print(
            f"{prov.split} sample {prov.sample} (version {prov.version[:16]}, dataset "
            f"{prov.dataset} sample {prov.dataset_sample}): {len(prov.pieces)} "
            f"piece{'' if len(prov.pieces) == 1 else 's'}"
        )
        tokens = blend.get_batch(np.array([prov.sample]))[0] if blend is not None else None
        for piece in prov.pieces:
            print(_line(piece))
            if tok is not None and tokens is not None:
                a, b = piece.sample_range
                text = tok.decode(tokens[a:b].tolist(), skip_special_tokens=False)
                cut = text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."
                print(f"      {cut!r}")
    return 0
