"""Takedowns on a pipeline-built blend (GPT-2, real text, two datasets of several shards, a gzip
shard, a quarantined shard): after ``tokenmill takedown``, no sample of the new versions holds
any token window unique to a removed document, every other document is still indexed, the
manifests and the audit record say what was removed, and the earlier versions still open pinned
until ``tokenmill gc``; for megatron, nanotron and growing semantics."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from _helpers import Capture
from dagster import AssetKey, DagsterInstance, SensorResult, build_sensor_context
from pipeline_project import Documents, MakeRecipe, write_shard

from pipelines.build import build_definitions
from pipelines.materialize import materialize_recipe
from tokenmill.cli import main
from tokenmill.errors import ConfigError, FormatError
from tokenmill.formats.blend_manifest import (
    read_blend_manifest,
    resolve,
    seal,
    version_manifest_path,
)
from tokenmill.formats.dataset_manifest import read_dataset_manifest
from tokenmill.formats.indexed import IndexedDataset
from tokenmill.formats.takedown_records import list_sha256, read_ledger
from tokenmill.ingest.records import document_lines
from tokenmill.loader import open_blend
from tokenmill.loader._datasets import NanosetDataset
from tokenmill.provenance import explain, find
from tokenmill.recipe import Recipe, load_recipe
from tokenmill.storage.gc import gc
from tokenmill.storage.versions import read_pointer

SPLITS = ("train", "valid", "test")
WINDOW = 6  # tokens: a window of a removed document found nowhere else in the corpus


def _windows(tokens: np.ndarray) -> set[bytes]:
    t = np.ascontiguousarray(tokens, dtype=np.int64)
    return {t[i : i + WINDOW].tobytes() for i in range(len(t) - WINDOW + 1)}


def _documents(root: Path, recipe: Recipe) -> dict[tuple[str, str, int], np.ndarray]:
    """Every document's tokens, by (dataset, shard, ordinal), from the tokenized shard pairs."""
    out = {}
    for ds in recipe.datasets:
        for idx in sorted((root / "tokens" / ds.name).glob("*_text_document.idx")):
            shard = idx.name.removesuffix("_text_document.idx")
            with IndexedDataset(idx.with_suffix("")) as data:
                for n in range(len(data)):
                    out[(ds.name, shard, n)] = np.array(data[n], dtype=np.int64)
    return out


def _samples(mpath: Path, version: str | None = None) -> list[np.ndarray]:
    rows = []
    for split in SPLITS:
        blend = open_blend(mpath, split, version=version)
        rows += list(blend.get_batch(np.arange(len(blend))))
    return rows


def _indexed(mpath: Path) -> set[tuple[str, int]]:
    """(dataset, sequence) of every document in the document indices of a blend version."""
    found = set()
    for split in SPLITS:
        blend = open_blend(mpath, split)
        for name, ds in blend.datasets.items():
            found |= {(name, int(s)) for s in np.unique(ds.document_index)}
    return found


@pytest.mark.parametrize("semantics", ["megatron", "nanotron", "growing"])
def test_takedown_masks_documents_in_new_versions_only(
    make_recipe: MakeRecipe,
    instance: DagsterInstance,
    tmp_path: Path,
    semantics: str,
    capsys: Capture,
) -> None:
    extra: dict[str, Any] = {"semantics": semantics, "train_samples": 600}
    if semantics != "megatron":
        extra["drop_last_partial_validation"] = True
    if semantics == "growing":
        extra |= {"era_samples": 4, "train_samples": None}
    recipe = make_recipe(nanoset=extra)
    assert materialize_recipe(recipe, instance) == 0
    root = Path(recipe.storage.root)
    mpath = root / "blends" / "mix" / "manifest.json"
    old = read_blend_manifest(mpath)
    # three documents the current version's samples hold: from two docs shards and one code
    pieces = [
        p
        for split in SPLITS
        for s in explain(mpath, split, range(len(open_blend(mpath, split))))
        for p in s.pieces
    ]
    chosen: dict[str, Any] = {}
    for p in pieces:
        if p.dataset == "docs" and len(chosen) < 2 and p.shard not in chosen:
            chosen[p.shard] = p
    chosen["code"] = next(p for p in pieces if p.dataset == "code")
    removed_refs = list(chosen.values())
    assert {p.dataset for p in removed_refs} == {"docs", "code"} and len(removed_refs) == 3
    tokens = _documents(root, recipe)
    removed = {(p.dataset, p.shard, p.document) for p in removed_refs}
    kept_windows: set[bytes] = set()
    for key, toks in tokens.items():
        if key not in removed:
            kept_windows |= _windows(toks)
    unique = set().union(*(_windows(tokens[k]) for k in removed)) - kept_windows
    assert unique
    old_samples = _samples(mpath)
    assert any(_windows(row) & unique for row in old_samples)  # the test has teeth

    listing = tmp_path / "takedown.txt"
    listing.write_text(
        "".join(f"line:{p.source}:{p.line}\n" for p in removed_refs) + "text:no such text 42\n"
    )
    argv = ["takedown", "--root", str(root), "--list", str(listing), "--reason", "licence"]
    assert main(argv) == 1  # one query matched nothing: reported, the rest applied
    out = capsys.readouterr().out
    assert "text:no such text 42: no document" in out and "blend mix: version" in out

    # the audit record: what, from which versions, when, why
    [record] = read_ledger(root)
    assert record["status"] == "applied" and record["reason"] == "licence"
    assert record["list"]["sha256"] == list_sha256(listing)
    assert {(d["dataset"], d["shard"], d["document"]) for d in record["documents"]} == removed
    assert {h["version"] for h in record["held_by"]} == {old["version"]}
    assert record["applied"]["blends"]["mix"]["from"] == old["version"]
    new = read_blend_manifest(mpath)
    assert new["version"] == record["applied"]["blends"]["mix"]["to"] != old["version"]
    if semantics == "growing":
        assert new["extends"] is None
    for ds, count in (("docs", 2), ("code", 1)):
        pointer = read_pointer(root / "merged" / ds / "current.json")
        assert pointer is not None
        merged = read_dataset_manifest(root / "merged" / ds / pointer["target"])
        assert merged["extends"] is None
        assert merged["takedown"]["lists"] == [list_sha256(listing)]
        assert merged["takedown"]["removed"] == count
        assert record["applied"]["merged"][ds]["removed"] == count
        [entry] = [e for e in new["datasets"] if e["name"] == ds]
        assert entry["takedown"]["removed"] == count

    # no sample of the new version holds a window unique to a removed document
    for row in _samples(mpath):
        assert not _windows(row) & unique
    # every other document is still indexed (the splits cover the whole dataset)
    sequences = {}
    for ds in ("docs", "code"):
        pointer = read_pointer(root / "merged" / ds / "current.json")
        assert pointer is not None
        merged = read_dataset_manifest(root / "merged" / ds / pointer["target"])
        at = 0
        for shard in merged["shards"]:
            for n in range(shard["documents"]):
                sequences[(ds, shard["key"], n)] = (ds, at + n)
            at += shard["documents"]
    expected = {seq for key, seq in sequences.items() if key not in removed}
    if semantics == "growing":  # a held-back partial era: what is indexed, less what is not
        assert _indexed(mpath) <= expected
    else:
        assert _indexed(mpath) == expected
    assert main(["verify", str(mpath)]) == 0

    # the earlier version still opens, pinned, with the removed documents, until gc
    again = _samples(mpath, version=old["version"])
    assert all(np.array_equal(a, b) for a, b in zip(again, old_samples, strict=True))
    queries = [f"line:{p.source}:{p.line}" for p in removed_refs]
    assert {h.version for h in find(root, queries)} == {old["version"]}
    gc(root, keep=1)
    with pytest.raises(ConfigError, match="not there"):
        open_blend(mpath, "train", version=old["version"])
    assert find(root, queries) == []
    # a second run of the same list makes nothing new
    assert main(argv) == 1
    assert read_blend_manifest(mpath)["version"] == new["version"]


def test_loader_refuses_an_index_that_reads_a_masked_document(
    make_recipe: MakeRecipe, instance: DagsterInstance, tmp_path: Path
) -> None:
    recipe = make_recipe()
    assert materialize_recipe(recipe, instance) == 0
    root = Path(recipe.storage.root)
    mpath = root / "blends" / "mix" / "manifest.json"
    old = open_blend(mpath, "train")
    piece = explain(mpath, "train", [0])[0].pieces[0]
    listing = tmp_path / "list.txt"
    listing.write_text(f"line:{piece.source}:{piece.line}\n")
    assert main(["takedown", "--root", str(root), "--list", str(listing), "--reason", "x"]) == 0
    masked = open_blend(mpath, "train").datasets[piece.dataset].data
    assert piece.sequence in masked.masked.tolist()
    stale = old.datasets[piece.dataset]  # the old indices over the masked merge: refused
    with pytest.raises(FormatError, match="masks"):
        NanosetDataset(
            masked,
            stale.document_index,
            stale.sample_index,
            stale.shuffle_index,
            sequence_length=stale.sequence_length,
        )
    lazy = NanosetDataset(
        masked,
        stale.document_index,
        stale.sample_index,
        stale.shuffle_index,
        sequence_length=stale.sequence_length,
        validate=False,
    )
    k = int(old.dataset_sample_index[0])
    with pytest.raises(FormatError, match="taken down"):
        lazy.get_batch([k])
    records = list((root / "takedowns").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["status"] == "applied"


def _with_takedown_list(recipe: Recipe, listing: Path) -> Recipe:
    """The recipe with ``takedown: {list, reason}`` added to its file, loaded again."""
    data = yaml.safe_load(recipe.path.read_text())
    data["takedown"] = {"list": str(listing), "reason": "eval contamination"}
    recipe.path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_recipe(recipe.path)


def _unique_line(documents: Documents, text: str) -> str:
    """The longest line of ``text`` that no other document of the corpus holds."""
    others = [d["text"] for ds in documents.values() for d in ds if d["text"] != text]
    for line in sorted(text.splitlines(), key=len, reverse=True):
        if line.strip() and not any(line in other for other in others):
            return line
    raise AssertionError("no line of the document is its own")


def _removed(root: Path, ds: str) -> tuple[str, dict[str, Any]]:
    pointer = read_pointer(root / "merged" / ds / "current.json")
    assert pointer is not None
    manifest = read_dataset_manifest(root / "merged" / ds / pointer["target"])
    return str(pointer["version"]), manifest


def test_recipe_takedown_list_is_watched_and_every_refresh_masks_the_ledger(
    make_recipe: MakeRecipe,
    instance: DagsterInstance,
    documents: Documents,
    tmp_path: Path,
    capsys: Capture,
) -> None:
    listing = tmp_path / "takedown.txt"
    docs_text, code_text = documents["docs"][5]["text"], documents["code"][3]["text"]
    listing.write_text(f"text:{_unique_line(documents, docs_text)}\n")
    recipe = _with_takedown_list(make_recipe(), listing)
    assert materialize_recipe(recipe, instance) == 0
    root = Path(recipe.storage.root)
    mpath = root / "blends" / "mix" / "manifest.json"
    [record] = read_ledger(root)
    assert record["reason"] == "eval contamination" and len(record["documents"]) == 1
    assert _removed(root, "docs")[1]["takedown"]["removed"] == 1
    # the blend's page: its takedown count and the audit record
    event = instance.get_latest_materialization_event(AssetKey(["blend", "mix"]))
    assert event is not None and event.asset_materialization is not None
    metadata = event.asset_materialization.metadata
    assert metadata["takedown_removed"].value == 1
    audit = root / "takedowns" / f"{record['id']}.json"
    assert metadata["takedown_record"].value == str(audit)
    assert audit.is_file()
    capsys.readouterr()
    assert materialize_recipe(recipe, instance) == 0  # the ledger is part of the versions
    assert "downstream: everything up to date" in capsys.readouterr().out

    # the sensor: a changed list requests the refresh once; the same list, nothing
    defs = build_definitions(recipe)
    sensor_def = defs.get_sensor_def("takedown_sensor")
    first = sensor_def(build_sensor_context(instance=instance))
    assert isinstance(first, SensorResult) and first.run_requests
    again = sensor_def(build_sensor_context(instance=instance, cursor=first.cursor))
    assert isinstance(again, SensorResult) and not again.run_requests
    lines = [_unique_line(documents, t) for t in (docs_text, code_text)]
    listing.write_text(f"text:{lines[0]}\ntext:{lines[1]}\n")
    changed = sensor_def(build_sensor_context(instance=instance, cursor=first.cursor))
    assert isinstance(changed, SensorResult) and changed.run_requests
    assert materialize_recipe(recipe, instance) == 0
    assert len(read_ledger(root)) == 2
    assert _removed(root, "code")[1]["takedown"]["removed"] == 1

    # a CLI takedown, then a new shard: the refresh keeps every mask and extends the version
    cli_list = tmp_path / "cli.txt"
    cli_list.write_text(f"text:{_unique_line(documents, documents['docs'][12]['text'])}\n")
    argv = ["takedown", "--root", str(root), "--list", str(cli_list), "--reason", "request"]
    assert main(argv) == 0
    masked_version, masked = _removed(root, "docs")
    assert masked["takedown"]["removed"] == 2 and masked["extends"] is None
    write_shard(Path(recipe.dataset("docs").source) / "zz-00009.jsonl", documents["docs"][:4])
    assert materialize_recipe(recipe, instance) == 0
    version, grown = _removed(root, "docs")
    assert version != masked_version and grown["extends"] == masked_version
    assert grown["takedown"]["removed"] == 2
    removed_texts = [docs_text, code_text, documents["docs"][12]["text"]]
    texts = {}
    for split in SPLITS:
        for prov in explain(mpath, split, range(len(open_blend(mpath, split)))):
            for p in prov.pieces:
                if p.source not in texts:
                    texts[p.source] = dict(document_lines(str(p.source)))
                assert texts[p.source][p.line]["text"] not in removed_texts
    assert sum(len(t) for t in texts.values()) > 40


def test_a_physical_merge_is_refused_before_anything_is_written(
    make_recipe: MakeRecipe, instance: DagsterInstance, tmp_path: Path, capsys: Capture
) -> None:
    recipe = make_recipe(merge="physical")
    assert materialize_recipe(recipe, instance) == 0
    root = Path(recipe.storage.root)
    mpath = root / "blends" / "mix" / "manifest.json"
    before = read_blend_manifest(mpath)["version"]
    piece = explain(mpath, "train", [0])[0].pieces[0]
    listing = tmp_path / "list.txt"
    listing.write_text(f"line:{piece.source}:{piece.line}\n")
    capsys.readouterr()
    assert main(["takedown", "--root", str(root), "--list", str(listing), "--reason", "x"]) == 2
    err = capsys.readouterr().err
    assert "is a physical merge" in err and "set merge: virtual" in err
    assert read_ledger(root) == [] and read_blend_manifest(mpath)["version"] == before


def test_verify_names_a_masked_document_a_tampered_index_references(
    make_recipe: MakeRecipe, instance: DagsterInstance, tmp_path: Path, capsys: Capture
) -> None:
    recipe = make_recipe()
    assert materialize_recipe(recipe, instance) == 0
    root = Path(recipe.storage.root)
    mpath = root / "blends" / "mix" / "manifest.json"
    piece = explain(mpath, "train", [0])[0].pieces[0]
    listing = tmp_path / "list.txt"
    listing.write_text(f"line:{piece.source}:{piece.line}\n")
    assert main(["takedown", "--root", str(root), "--list", str(listing), "--reason", "x"]) == 0
    assert main(["verify", str(mpath)]) == 0
    # an index whose every file record is consistent, but that reads the masked document
    manifest = read_blend_manifest(mpath)
    [entry] = [d for d in manifest["splits"]["train"]["datasets"] if d["name"] == piece.dataset]
    record = entry["index"]["files"]["document"]
    path = resolve(mpath, record["path"])
    doc = np.load(path)
    assert piece.sequence not in doc.tolist()
    doc[0] = piece.sequence
    path.chmod(0o644)
    np.save(path, doc, allow_pickle=False)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    description = resolve(mpath, entry["index"]["files"]["description"]["path"])
    info = json.loads(description.read_text())
    info["files"]["document"]["sha256"] = digest
    description.chmod(0o644)
    description.write_text(json.dumps(info))
    desc_digest = hashlib.sha256(description.read_bytes()).hexdigest()
    for target in (mpath, version_manifest_path(mpath, manifest["version"])):
        data = read_blend_manifest(target)
        for split in data["splits"].values():
            for ds in split["datasets"]:
                files = ds["index"]["files"]
                if files["document"]["path"] == record["path"]:
                    files["document"]["sha256"] = digest
                    files["description"]["sha256"] = desc_digest
                    files["description"]["bytes"] = description.stat().st_size
        target.write_text(json.dumps(seal(data)))
    capsys.readouterr()
    assert main(["verify", str(mpath)]) == 1
    out = capsys.readouterr()
    said = out.out + out.err
    assert "masks (taken down)" in said
    assert f"shard {piece.shard} document {piece.document}" in said
