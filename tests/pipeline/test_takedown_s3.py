"""Provenance and takedowns on an ``s3://`` root (moto_server): a pipeline-built root uploaded to
S3 gives the same ``explain`` and ``find`` answers as its local copy, and ``tokenmill takedown``
on it writes, in commit order, the same merged and blend versions and audit record as on the
local copy; a pointer moved by another writer meanwhile is refused."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from dagster import DagsterInstance
from prod_servers import S3

from pipelines.materialize import materialize_recipe
from tokenmill.cli import main
from tokenmill.errors import ConflictError
from tokenmill.formats.takedown_records import read_ledger
from tokenmill.loader import open_blend
from tokenmill.provenance import explain, find
from tokenmill.recipe import Recipe, load_recipe
from tokenmill.storage import mirror, staging
from tokenmill.storage.publish import commit_rank, publish
from tokenmill.storage.store import S3Store
from tokenmill.takedown import takedown

NOW = 1_790_000_000.0


def _upload(root: Path, store: S3Store) -> None:
    """Every file of ``root`` to the S3 root, in commit order."""
    rels = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    publish(
        [r for r in rels if ".tmp" not in r.split("/")],
        lambda r: store.write(r, (root / r).read_bytes()),
    )


def _tree(store: S3Store) -> dict[str, bytes]:
    return {f.key: store.read(f.key) or b"" for f in store.files("") if not f.key.endswith(".bin")}


def _local_tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and ".tmp" not in p.relative_to(root).parts and p.suffix != ".bin"
    }


def _without_times(record: bytes) -> dict[str, object]:
    data = json.loads(record)
    data["applied"].pop("at")
    return data


def test_explain_find_and_takedown_on_an_s3_root_match_the_local_root(
    make_recipe: Callable[..., Recipe],
    instance: DagsterInstance,
    s3: S3,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recipe = make_recipe()
    assert materialize_recipe(recipe, instance) == 0
    built = Path(recipe.storage.root)
    local = tmp_path / "local"
    shutil.copytree(built, local, ignore=shutil.ignore_patterns(".tmp"))
    uri = f"s3://{s3.bucket}/root"
    store = S3Store(uri, s3.endpoint)
    _upload(built, store)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))

    # explain: the same pieces, source lines and ids from S3 as locally
    lpath, rpath = local / "blends" / "mix" / "manifest.json", f"{uri}/blends/mix/manifest.json"
    n = len(open_blend(lpath, "train"))
    ids = list(range(0, n, max(1, n // 7)))
    ours = explain(rpath, "train", ids)
    theirs = explain(lpath, "train", ids)
    assert [p.pieces for p in ours] == [p.pieces for p in theirs]
    assert all(p.line is not None and p.source for s in ours for p in s.pieces)
    pieces = [p for s in theirs for p in s.pieces]
    chosen = [pieces[0], next(p for p in pieces if p.dataset != pieces[0].dataset)]
    queries = [f"line:{p.source}:{p.line}" for p in chosen]

    # find: the same versions and samples
    def hits(root: str | Path) -> list[tuple[str, str, dict[str, list[int]]]]:
        return sorted((h.document.query, h.version, h.samples) for h in find(root, queries))

    assert hits(uri) == hits(local) != []

    # takedown: the same new versions and record as the local takedown, uploaded in order
    listing = tmp_path / "list.txt"
    listing.write_text("".join(q + "\n" for q in queries))
    written: list[str] = []
    real_upload, real_pointer = staging.upload, staging.put_pointer

    def spy(client: object, path: Path, bucket: str, key: str) -> None:
        written.append(key.removeprefix("root/"))
        real_upload(client, path, bucket, key)

    def spy_pointer(client: object, path: Path, bucket: str, key: str, read: object) -> object:
        written.append(key.removeprefix("root/"))
        return real_pointer(client, path, bucket, key, read)  # type: ignore[arg-type]

    monkeypatch.setattr(staging, "upload", spy)
    monkeypatch.setattr(staging, "put_pointer", spy_pointer)
    remote = takedown(uri, listing, "licence", now=NOW)
    ref = takedown(local, listing, "licence", now=NOW)
    assert remote.merged == ref.merged and remote.blends == ref.blends
    assert set(ref.blends) == {"mix"} and len(ref.merged) == 2
    ranks = [commit_rank(k) for k in written]
    assert ranks == sorted(ranks) and written[-1] == "blends/mix/manifest.json"
    ours_tree, theirs_tree = _tree(store), _local_tree(local)
    assert set(ours_tree) == set(theirs_tree)
    for key, data in theirs_tree.items():
        if key.startswith("takedowns/"):
            assert _without_times(ours_tree[key]) == _without_times(data)
        else:
            assert ours_tree[key] == data, key
    [record] = read_ledger(local)
    assert record["status"] == "applied"

    # the new S3 version holds none of the removed documents; find on S3 agrees
    for split in ("train", "valid"):
        blend = open_blend(rpath, split)
        for prov in explain(rpath, split, range(len(blend))):
            got = {(p.dataset, p.shard, p.document) for p in prov.pieces}
            assert not got & {(p.dataset, p.shard, p.document) for p in chosen}
    assert {h.version for h in find(uri, queries)} == {record["held_by"][0]["version"]}

    # the CLI on S3: the same list again makes nothing new (exit 0)
    before = _tree(store)
    assert main(["takedown", "--root", uri, "--list", str(listing), "--reason", "licence"]) == 0
    after = _tree(store)
    assert {k for k in after if after[k] != before.get(k)} <= {f"takedowns/{record['id']}.json"}


def test_a_pointer_moved_on_s3_meanwhile_is_refused(s3: S3, tmp_path: Path) -> None:
    store = S3Store(f"s3://{s3.bucket}/r", s3.endpoint)
    pointer = {"format_version": 1, "version": "a" * 64, "target": "x"}
    store.write("merged/d/current.json", json.dumps(pointer).encode())
    with (
        pytest.raises(ConflictError, match=r"current\.json"),
        mirror.local_root(store.uri, write=True) as base,
    ):
        moved = {**pointer, "version": "b" * 64}
        store.write("merged/d/current.json", json.dumps(moved).encode())  # another writer
        mine = {**pointer, "version": "c" * 64}
        (base / "merged/d/current.json").write_text(json.dumps(mine))
        (base / "merged/d/v/data.idx").parent.mkdir(parents=True)
        (base / "merged/d/v/data.idx").write_bytes(b"new")
    assert json.loads(store.read("merged/d/current.json") or b"")["version"] == "b" * 64
    assert store.read("merged/d/v/data.idx") == b"new"  # data first; the pointer refused


def test_the_recipe_takedown_list_on_an_s3_root(
    make_recipe: Callable[..., Recipe],
    instance: DagsterInstance,
    documents: dict[str, list[dict[str, str]]],
    s3: S3,
    tmp_path: Path,
) -> None:
    listing = tmp_path / "takedown.txt"
    text = documents["docs"][5]["text"]
    line = max(text.splitlines(), key=len)
    assert sum(line in d["text"] for ds in documents.values() for d in ds) == 1
    listing.write_text(f"text:{line}\n")
    uri = f"s3://{s3.bucket}/root"
    make_recipe()  # writes the sources; docs is read from S3
    s3.upload_tree(tmp_path / "sources" / "docs", "sources/docs")
    docs = {
        "source": f"s3://{s3.bucket}/sources/docs/",
        "on_bad_record": "quarantine",
        "max_quarantine_fraction": 0.25,
    }
    made = make_recipe(
        storage={"root": uri, "s3_endpoint_url": s3.endpoint}, datasets={"docs": docs}
    )
    data = yaml.safe_load(made.path.read_text())
    data["takedown"] = {"list": str(listing), "reason": "eval contamination"}
    made.path.write_text(yaml.safe_dump(data, sort_keys=False))
    recipe = load_recipe(made.path)
    assert materialize_recipe(recipe, instance) == 0
    store = S3Store(uri, s3.endpoint)
    [key] = [f.key for f in store.files("takedowns")]
    record = json.loads(store.read(key) or b"")
    assert record["reason"] == "eval contamination" and len(record["documents"]) == 1
    [doc] = record["documents"]
    assert doc["source"].startswith(f"s3://{s3.bucket}/sources/docs/")
    assert doc["line"] >= 1 and doc["queries"] == [f"text:{line}"]
    pointer = json.loads(store.read("merged/docs/current.json") or b"")
    folder, name = pointer["target"].rsplit("/", 1)
    merged = json.loads(store.read(f"merged/docs/{folder}/manifests/{name}.manifest.json") or b"")
    assert merged["takedown"]["removed"] == 1
    [shard] = [s for s in merged["shards"] if s["key"] == doc["shard"]]
    assert shard["masked"] == [doc["document"]]
    mpath = f"{uri}/blends/mix/manifest.json"
    for split in ("train", "valid", "test"):
        n = len(open_blend(mpath, split))
        for prov in explain(mpath, split, range(n)):
            assert all(
                (p.shard, p.document) != (doc["shard"], doc["document"]) for p in prov.pieces
            )
