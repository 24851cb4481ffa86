"""``tokenmill.provenance`` on a pipeline-built blend (GPT-2, real text, several shards, two
datasets, a quarantined shard and a gzip shard): every sample of every split maps back to source
lines whose re-encoded tokens are the sample's, EOD and document boundaries in place, for the
three semantics, and the training inputs of every ``get_training_batch`` flag follow the
document boundaries it gives; ``find`` finds every planted document and nothing else."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import FLAG_COMBOS, Capture
from dagster import DagsterInstance
from pipeline_project import Documents, MakeRecipe, write_shard

from pipelines.materialize import materialize_recipe
from tokenmill.cli import main
from tokenmill.formats.shard_records import read_dochash, text_digest
from tokenmill.ingest.records import document_lines
from tokenmill.loader import open_blend
from tokenmill.provenance import Piece, explain, find, resolve_queries, text_hash
from tokenmill.tokenize.tokenizer import load_tokenizer

SPLITS = ("train", "valid", "test")
EOD = 50256


def _training_inputs(
    row: np.ndarray, pieces: list[Piece], doc_sizes: list[int], seq: int, flags: dict[str, bool]
) -> dict[str, np.ndarray]:
    """One sample's megatron training dict (FORMATS §11) from the sample and the document
    boundaries ``explain`` gives (not from scanning for EOD): each piece that ends its document
    ends with its EOD; with inter-document masking each piece is its own sequence."""
    tokens, labels = row[:seq].copy(), row[1 : seq + 1].copy()
    eods = [
        p.sample_range[1] - 1
        for p, size in zip(pieces, doc_sizes, strict=True)
        if p.document_range[1] == size and p.sample_range[1] - 1 < seq
    ]
    loss = np.ones(seq, dtype=np.float32)
    if flags["eod_mask_loss"]:
        loss[eods] = 0.0
    starts = np.zeros(seq, dtype=np.int64)  # where the document run of each position starts
    for e in eods:
        starts[e + 1 :] = e + 1
    positions = np.arange(seq) - starts if flags["reset_position_ids"] else np.arange(seq)
    out: dict[str, np.ndarray] = {}
    if flags["inter_document_masking"]:
        lengths = [p.sample_range[1] - p.sample_range[0] for p in pieces]
        lengths[-1] -= 1  # the extra token
        lengths = [n for n in lengths if n] or [0]
        lengths[-1] += seq - sum(lengths)  # padding joins the last piece
        bounds = np.cumsum([0, *lengths])
        cu = np.full(seq + 1, seq, dtype=np.int32)
        cu[: len(bounds)] = bounds
        out |= {"cu_seqlens": cu, "max_seqlen": np.int32(max(lengths))}
        positions = np.arange(seq) - bounds[np.searchsorted(bounds, np.arange(seq), "right") - 1]
    elif flags["create_attention_mask"]:
        run = starts if flags["reset_attention_mask"] else np.zeros(seq, dtype=np.int64)
        columns = np.arange(seq)
        mask = (columns[None, :] > columns[:, None]) | (columns[None, :] < run[:, None])
        out["attention_mask"] = mask[None]
    loss[labels == -1] = 0.0
    tokens[tokens == -1] = 0
    labels[labels == -1] = 0
    return out | {"tokens": tokens, "labels": labels, "loss_mask": loss, "position_ids": positions}


def _source_line(path: str, line: int) -> dict[str, Any]:
    """The record on 1-based ``line`` of a JSONL source (gzip too), read independently."""
    for n, record in document_lines(path):
        if n == line:
            return record
    raise AssertionError(f"{path}:{line} is no document line")


@pytest.mark.parametrize(
    ("semantics", "merge"),
    [
        ("megatron", "virtual"),
        ("megatron", "physical"),
        ("nanotron", "virtual"),
        ("growing", "virtual"),
    ],
)
def test_explain_maps_every_sample_to_its_source_lines(
    make_recipe: MakeRecipe, instance: DagsterInstance, gpt2_dir: Path, semantics: str, merge: str
) -> None:
    extra: dict[str, Any] = {"semantics": semantics}
    if semantics != "megatron":
        extra["drop_last_partial_validation"] = True
    if semantics == "growing":
        extra |= {"era_samples": 8, "train_samples": None}
    recipe = make_recipe(nanoset=extra, merge=merge)
    assert materialize_recipe(recipe, instance) == 0
    mpath = Path(recipe.storage.root) / "blends" / "mix" / "manifest.json"
    encoder = load_tokenizer(gpt2_dir)
    cache: dict[tuple[str, int], np.ndarray] = {}
    seen_lines: set[tuple[str, int]] = set()
    for split in SPLITS:
        blend = open_blend(mpath, split)
        batch = blend.get_batch(np.arange(len(blend)))
        found = explain(mpath, split, range(len(blend)))
        assert [p.sample for p in found] == list(range(len(blend)))
        for row, prov in zip(batch, found, strict=True):
            assert prov.dataset == blend.names[int(blend.dataset_index[prov.sample])]
            parts = []
            for piece in prov.pieces:
                assert piece.source is not None and piece.line is not None and piece.shard
                key = (piece.source, piece.line)
                if key not in cache:
                    text = _source_line(piece.source, piece.line)["text"]
                    cache[key] = encoder.pack([text], eod=EOD, dtype=np.uint16)[0]
                tokens = cache[key]
                start, stop = piece.document_range
                assert piece.sample_range[1] - piece.sample_range[0] == stop - start
                parts.append(tokens[start:stop].astype(np.int64))
                seen_lines.add(key)
            got = np.concatenate(parts)
            np.testing.assert_array_equal(row[: len(got)], got)
            assert (row[len(got) :] == -1).all()  # only a partial sample's padding is left
            # each piece but the last ends its document: EOD there, the next document after it
            for piece in prov.pieces[:-1]:
                assert piece.document_range[1] == len(cache[(piece.source, piece.line)])
                assert row[piece.sample_range[1] - 1] == EOD
        # the training inputs agree with the boundaries explain gives, under every flag
        ids = np.arange(len(blend))
        for flags in FLAG_COMBOS:
            got = blend.get_training_batch(ids, **flags)
            for i, prov in enumerate(found):
                ends = [len(cache[(p.source, p.line)]) for p in prov.pieces]
                want = _training_inputs(batch[i], prov.pieces, ends, blend.sequence_length, flags)
                assert set(got) == set(want), flags
                for name, value in want.items():
                    np.testing.assert_array_equal(got[name][i], value, err_msg=f"{name} {flags}")
    # the gzip shard and the quarantined shard (bad lines after its first) are both explained
    assert any(src.endswith(".jsonl.gz") for src, _ in seen_lines)
    assert any(src.endswith("extra-00000.jsonl") and line > 2 for src, line in seen_lines)


def test_find_every_planted_document_and_nothing_else(
    make_recipe: MakeRecipe, instance: DagsterInstance, documents: Documents
) -> None:
    recipe = make_recipe(nanoset={"train_samples": 2000})  # several epochs: every train doc
    planted = [
        {
            "id": f"planted-{i}",
            "text": f"Canary {i} zebra quokka caf\u00e9 {i * 7919} " + d["text"][:400],
        }
        for i, d in enumerate(documents["docs"][:3])
    ]
    others = [
        {"id": f"other-{i}", "text": d["text"][:600]} for i, d in enumerate(documents["docs"][3:12])
    ]
    shard = Path(recipe.dataset("docs").source) / "ids-00000.jsonl"
    rows = [others[0], planted[0], *others[1:5], planted[1], *others[5:], planted[2]]
    write_shard(shard, rows, [b"", b"{not json"])  # a blank and a bad line shift the lines
    assert materialize_recipe(recipe, instance) == 0
    root = Path(recipe.storage.root)
    lines = {
        json.loads(raw)["id"]: n
        for n, raw in enumerate(shard.read_bytes().split(b"\n"), 1)
        if raw.startswith(b'{"')
    }
    # the same text in another Unicode form (NFD): the hash is of the NFC form
    spaced = unicodedata.normalize("NFD", planted[0]["text"])
    queries = [
        f"id:{planted[0]['id']}",
        f"line:{shard}:{lines[planted[1]['id']]}",
        "text:Canary 2 zebra quokka",
        f"sha256:{text_hash(spaced)}",
        *["id:absent", f"line:{shard}:2", "text:no such text anywhere 123"],  # line 2: blank
    ]
    # the raw step's document hashes: one per document, in order (what sha256: queries read)
    index = read_dochash(root / "raw/docs/ids-00000.dochash.npy", 12)
    texts = [r["text"] for _, r in document_lines(shard)]
    assert [bytes(row) for row in index] == [text_digest(t) for t in texts]
    refs = resolve_queries(root, queries)
    assert {r.query for r in refs} == set(queries[:4]) and len(refs) == 4
    for ref in refs:
        assert ref.doc_id is not None and ref.doc_id.startswith("planted-"), ref
        assert ref.line == lines[ref.doc_id] and ref.source == str(shard)
    # the samples listed are exactly those whose pieces hold the document (explain agrees)
    hits = find(root, queries)
    mpath = root / "blends" / "mix" / "manifest.json"
    assert {h.document for h in hits} == set(refs)  # every planted document is in a sample
    for hit in hits:
        assert hit.blend == "mix"
        for split in SPLITS:
            every = explain(mpath, split, range(len(open_blend(mpath, split))), version=hit.version)
            holders = [
                s.sample for s in every if any(p.doc_id == hit.document.doc_id for p in s.pieces)
            ]
            assert hit.samples.get(split, []) == holders
    # without the document hash index, sha256: queries read the sources and find the same
    for index in root.glob("raw/*/*.dochash.npy"):
        index.unlink()
    again = resolve_queries(root, queries)
    assert len(again) == len(refs) and set(again) == set(refs)


def test_explain_and_find_commands(
    make_recipe: MakeRecipe,
    instance: DagsterInstance,
    gpt2_dir: Path,
    tmp_path: Path,
    capsys: Capture,
) -> None:
    recipe = make_recipe()
    assert materialize_recipe(recipe, instance) == 0
    root = Path(recipe.storage.root)
    blend = root / "blends" / "mix"
    capsys.readouterr()
    argv = ["explain", str(blend), "--split", "valid", "--sample", "3", "5"]
    assert main([*argv, "--text", "--tokenizer", str(gpt2_dir)]) == 0
    out = capsys.readouterr().out
    [first, second] = explain(blend / "manifest.json", "valid", [3, 5])
    assert out.startswith(f"valid sample 3 (version {first.version[:16]}, dataset")
    piece = first.pieces[0]
    a, b = piece.document_range
    assert f"{piece.source}:{piece.line}" in out and f"tokens [{a}, {b})" in out
    assert "valid sample 5 (" in out and len(out.splitlines()) == 2 + 2 * (
        len(first.pieces) + len(second.pieces)
    )
    assert main(["explain", str(blend), "--step", "2", "-G", "4"]) == 0
    out = capsys.readouterr().out
    assert [line.split(" (")[0] for line in out.splitlines() if not line.startswith(" ")] == [
        f"train sample {i}" for i in range(8, 12)
    ]
    assert main(["explain", str(blend), "--sample", "0", "--text"]) == 2
    assert "--text needs --tokenizer" in capsys.readouterr().err
    # find: a file of queries, one a line; a query matching nothing -> exit 1
    doc = explain(blend / "manifest.json", "train", [0])[0].pieces[0]
    queries = tmp_path / "queries.txt"
    queries.write_text(f"line:{doc.source}:{doc.line}\n\ntext:no such text 42\n")
    assert main(["find", str(root), "--queries", str(queries)]) == 1
    out = capsys.readouterr().out
    assert f"line:{doc.source}:{doc.line}: {doc.dataset}/{doc.shard} document {doc.document}" in out
    assert "  blend mix version " in out and "train [0" in out
    assert out.endswith("text:no such text 42: no document\n")
    assert main(["find", str(root), f"line:{doc.source}:{doc.line}"]) == 0
