"""The pipeline on an S3 storage root (moto_server): every stage, then pull + open_blend;
a persistent S3 error fails cleanly; credentials never reach metadata or logs."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from dagster import AssetKey, DagsterInstance, build_sensor_context
from pipeline_project import BAD_LINES, materialize_downstream, materialize_shards, write_shard
from prod_servers import S3

import assets.tokenized as assets_tokenized
from assets.factory import build_assets
from assets.support.resources import StorageResource
from assets.support.sources import diff_listing, list_shards
from pipelines.build import build_definitions, resources_for
from pipelines.materialize import materialize_recipe, stale_downstream
from pipelines.sensors import range_run_key
from tokenmill.loader import open_blend
from tokenmill.recipe import Recipe, load_recipe
from tokenmill.storage import layout
from tokenmill.storage import s3 as storage_s3
from tokenmill.storage import staging as s3_stage
from tokenmill.storage.pull import pull
from tokenmill.storage.s3 import shared_client
from tokenmill_dev.corpus import stdlib_documents, write_jsonl_shards

SECRET = "tm-secret-access-key-4f1c"  # the fake secret key: must never show up in a run


@pytest.fixture
def s3_secret(s3: S3, monkeypatch: pytest.MonkeyPatch) -> S3:
    """The moto bucket, with a recognizable secret key in the environment (moto accepts any)."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    return s3


def s3_recipe(
    tmp_path: Path,
    s3: S3,
    gpt2_dir: Path,
    root_bucket: str,
    root: str | None = None,
    merge: str = "virtual",
) -> Recipe:
    """Two small datasets uploaded to ``s3://<bucket>/sources/<ds>/``; the storage root is
    ``s3://<root_bucket>/root`` unless ``root`` names another (a local directory)."""
    local = tmp_path / "sources"
    docs = [{"text": d["text"][:1200]} for d in itertools.islice(stdlib_documents(kind="docs"), 30)]
    code = [{"text": d["text"][:1200]} for d in itertools.islice(stdlib_documents(kind="code"), 20)]
    write_jsonl_shards(iter(docs), local / "docs", shards=2, max_bytes=1 << 30)
    write_jsonl_shards(iter(code), local / "code", shards=2, max_bytes=1 << 30, gzip_last=True)
    s3.upload_tree(local, "sources")
    data: dict[str, Any] = {
        "storage": {"root": root or f"s3://{root_bucket}/root", "s3_endpoint_url": s3.endpoint},
        "tokenizer": {"path": str(gpt2_dir), "append_eod": True},
        "datasets": {
            "docs": {"source": f"s3://{s3.bucket}/sources/docs/", "max_quarantine_fraction": 0.25},
            "code": {"source": f"s3://{s3.bucket}/sources/code/"},
        },
        "nanoset": {"sequence_length": 32, "split": "80,10,10", "seed": 7, "train_samples": 100},
        "blends": {"mix": {"weights": {"docs": 0.7, "code": 0.3}}},
        "merge": merge,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return load_recipe(path)


def run_everything(recipe: Recipe, instance: DagsterInstance, work: Path) -> list[Any]:
    """Every shard partition through its stages, then everything downstream; the results."""
    graph = build_assets(recipe)
    resources = resources_for(recipe)
    resources["storage"] = StorageResource(
        root=recipe.storage.root, s3_endpoint_url=recipe.storage.s3_endpoint_url, work_dir=str(work)
    )
    results = []
    for ds in recipe.datasets:
        keys = sorted(list_shards(ds).shards)
        results += materialize_shards(
            graph, instance, resources, ds.name, keys, raise_on_error=False
        )
        if not results[-1].success:
            return results
    results.append(materialize_downstream(graph, instance, resources, raise_on_error=False))
    return results


def everything_logged(instance: DagsterInstance) -> str:
    """Every event of every run (messages, metadata, errors) as one string."""
    return "\n".join(
        repr(record) for run in instance.get_runs() for record in instance.all_logs(run.run_id)
    )


@pytest.mark.parametrize("merge", ["virtual", "physical"])
def test_every_stage_on_s3_then_pull_and_open(
    s3_secret: S3, gpt2_dir: Path, tmp_path: Path, merge: str
) -> None:
    s3 = s3_secret
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, s3.bucket, merge=merge)
    work = tmp_path / "work"
    with DagsterInstance.ephemeral() as instance:
        results = run_everything(recipe, instance, work)
        assert all(r.success for r in results)
        evaluations = [e for r in results for e in r.get_asset_check_evaluations()]
        # per shard: 4 checks + not_empty; per dataset: sum_of_shards, quarantine_share,
        # shards_left_out, index_bounds; the blend: proportions
        assert len(evaluations) == 4 * 5 + 2 * 4 + 1 and all(e.passed for e in evaluations)
        logged = everything_logged(instance)
    assert SECRET not in logged
    assert f"s3://{s3.bucket}/root/blends/mix/manifest.json" in logged  # metadata paths: S3 URIs
    assert list(work.iterdir()) == []  # every work directory removed

    keys = s3.keys("root/")
    merged_key = {}
    for ds in ("docs", "code"):
        pointer = json.loads(
            s3.client.get_object(Bucket=s3.bucket, Key=f"root/merged/{ds}/current.json")[
                "Body"
            ].read()
        )
        merged_key[ds] = f"root/merged/{ds}/{pointer['target']}"
        for suffix in (".bin", ".idx"):  # a virtual merge has only its manifest
            assert (f"{merged_key[ds]}{suffix}" in keys) == (merge == "physical")
        assert layout.dataset_manifest(merged_key[ds]) in keys
        assert f"root/hf/{ds}/dataset_info.json" in keys
        for shard in ("part-00000", "part-00001"):
            assert f"root/tokens/{ds}/manifests/{shard}_text_document.manifest.json" in keys
            assert f"root/tokens/{ds}/{shard}_text_document.manifest.json" not in keys
            assert f"root/raw/{ds}/{shard}.stats.json" in keys
    assert not [k for k in keys if ".tmp-" in k or k.endswith(".lock")]
    info = json.loads(
        s3.client.get_object(Bucket=s3.bucket, Key="root/hf/docs/dataset_info.json")["Body"].read()
    )
    assert len(info["shards"]) == 2
    # Manifests name their inputs where they live (S3), never a removed work directory.
    for key in (
        "root/tokens/docs/manifests/part-00000_text_document.manifest.json",
        layout.dataset_manifest(merged_key["docs"]),
    ):
        text = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read().decode()
        assert str(work) not in text and "tokenmill-work-" not in text
    tokens = json.loads(
        s3.client.get_object(
            Bucket=s3.bucket,
            Key="root/tokens/docs/manifests/part-00000_text_document.manifest.json",
        )["Body"].read()
    )
    assert tokens["inputs"][0]["uri"] == f"s3://{s3.bucket}/root/hf/docs/data/part-00000.parquet"
    merged = json.loads(
        s3.client.get_object(Bucket=s3.bucket, Key=layout.dataset_manifest(merged_key["docs"]))[
            "Body"
        ].read()
    )
    if merge == "physical":
        assert [i["prefix"] for i in merged["inputs"]] == [
            f"s3://{s3.bucket}/root/tokens/docs/{shard}_text_document"
            for shard in ("part-00000", "part-00001")
        ]
    assert [s["key"] for s in merged["shards"]] == ["part-00000", "part-00001"]
    if merge == "virtual":  # shard pairs named relative to the version, read in place
        assert [s["prefix"] for s in merged["shards"]] == [
            f"../../../tokens/docs/{shard}_text_document" for shard in ("part-00000", "part-00001")
        ]

    report = pull(f"s3://{s3.bucket}/root/blends/mix/manifest.json", tmp_path / "pulled")
    for split in ("train", "valid"):
        blend = open_blend(report.manifest, split, verify="full")
        assert len(blend) > 0
        batch = blend.get_batch(np.arange(len(blend)))
        assert batch.shape == (len(blend), 33) and int(batch.max()) < 50257


def test_persistent_s3_error_fails_cleanly(s3_secret: S3, gpt2_dir: Path, tmp_path: Path) -> None:
    s3 = s3_secret
    missing = f"{s3.bucket}-gone"  # a root bucket that does not exist: every upload fails
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, missing)
    work = tmp_path / "work"
    with DagsterInstance.ephemeral() as instance:
        results = run_everything(recipe, instance, work)
        assert len(results) == 1 and not results[0].success
        failure = next(e for e in results[0].all_events if e.is_step_failure)
        message = failure.event_specific_data.error.to_string()
        logged = everything_logged(instance)
    assert (
        # the push first reads the stored marker it would replace (a rerun of the same result
        # uploads nothing): the bucket's absence surfaces there, naming the object
        f"InputError: reading s3://{missing}/root/raw/docs/part-00000.stats.json: NoSuchBucket"
        in message
    )
    assert SECRET not in logged
    assert list(work.iterdir()) == []
    assert s3.keys("root/") == []
    assert not any(b["Name"] == missing for b in s3.client.list_buckets()["Buckets"])


def test_s3_listing_by_etag_and_size(s3: S3, gpt2_dir: Path, tmp_path: Path) -> None:
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, s3.bucket)
    ds = recipe.dataset("docs")
    put = s3.client.put_object
    put(Bucket=s3.bucket, Key="sources/docs/notes.txt", Body=b"not a shard")
    put(Bucket=s3.bucket, Key="sources/docs/part-9.jsonl.tmp-1", Body=b"{}\n")
    put(Bucket=s3.bucket, Key="sources/docs/nested/part-7.jsonl", Body=b"{}\n")
    before = list_shards(ds)
    assert sorted(before.shards) == ["part-00000", "part-00001"] and before.rejected == []
    head = s3.client.head_object(Bucket=s3.bucket, Key="sources/docs/part-00001.jsonl")
    shard = before.shards["part-00001"]
    assert shard.fingerprint == f"{head['ContentLength']}:{head['ETag'].strip(chr(34))}"
    assert shard.path is None and shard.uri == f"s3://{s3.bucket}/sources/docs/part-00001.jsonl"

    put(Bucket=s3.bucket, Key="sources/docs/part-00001.jsonl", Body=b'{"text": "changed"}\n')
    put(Bucket=s3.bucket, Key="sources/docs/part-00002.jsonl", Body=b'{"text": "new"}\n')
    s3.client.delete_object(Bucket=s3.bucket, Key="sources/docs/part-00000.jsonl")
    diff = diff_listing(before.fingerprints(), list_shards(ds).fingerprints())
    assert (diff.new, diff.changed, diff.vanished) == (
        ["part-00002"],
        ["part-00001"],
        ["part-00000"],
    )


def test_stage_uploads_multipart_manifests_last_and_propagates_deletions(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage_s3, "MULTIPART_BYTES", 5 << 20)  # S3's smallest part size
    for key, body in [
        ("root/merged/a_text_document.bin", b"old"),
        ("root/merged/a_text_document.manifest.json", b"{}"),
        ("root/tokens/x.bin", b"gone soon"),
    ]:
        s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body)
    local = tmp_path / "root"
    stage = s3_stage.S3Stage(shared_client(s3.endpoint), s3.bucket, "root", local)
    stage.fetch(["merged/a_text_document", "tokens/"])
    assert sorted(stage.fetched) == [
        "merged/a_text_document.bin",
        "merged/a_text_document.manifest.json",
        "tokens/x.bin",
    ]
    big = np.random.default_rng(0).bytes(11 << 20)
    (local / "merged/a_text_document.bin").write_bytes(big)
    (local / "merged/a_text_document.manifest.json").write_text('{"new": 1}')
    (local / "tokens/x.bin").unlink()
    (local / "nanoset").mkdir()
    (local / "nanoset/h-Nanoset-train.lock").write_bytes(b"")
    (local / "nanoset/h-Nanoset-train-doc.npy.tmp-123").write_bytes(b"partial")  # legacy
    (local / "nanoset/.tmp/v.tmp-h-1-ab").mkdir(parents=True)  # a staging folder in flight
    (local / "nanoset/.tmp/v.tmp-h-1-ab/train-doc.npy").write_bytes(b"partial")
    (local / "nanoset/h-Nanoset-train-doc.npy").write_bytes(b"index")

    assert stage.push() == [
        "merged/a_text_document.bin",
        "nanoset/h-Nanoset-train-doc.npy",
        "merged/a_text_document.manifest.json",
    ]
    assert s3.keys("root/") == [
        "root/merged/a_text_document.bin",
        "root/merged/a_text_document.manifest.json",
        "root/nanoset/h-Nanoset-train-doc.npy",
    ]
    head = s3.client.head_object(Bucket=s3.bucket, Key="root/merged/a_text_document.bin")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: a multipart upload
    body = s3.client.get_object(Bucket=s3.bucket, Key="root/merged/a_text_document.bin")["Body"]
    assert body.read() == big


def test_shard_sensor_on_an_s3_source(s3: S3, gpt2_dir: Path, tmp_path: Path) -> None:
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, s3.bucket)
    sensor = build_definitions(recipe).resolve_sensor_def("code_shard_sensor")
    listing = list_shards(recipe.dataset("code"))
    with DagsterInstance.ephemeral() as instance:
        result = sensor(build_sensor_context(instance=instance))
    assert sorted(listing.shards) == ["part-00000", "part-00001"]
    # both new shards in one range run, keyed by the range and their fingerprints
    assert [r.run_key for r in result.run_requests] == [
        range_run_key({k: s.fingerprint for k, s in sorted(listing.shards.items())})
    ]
    assert json.loads(result.cursor) == listing.fingerprints()


def test_materialize_a_local_root_from_s3_sources(s3: S3, gpt2_dir: Path, tmp_path: Path) -> None:
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, s3.bucket, root=str(tmp_path / "data"))
    with DagsterInstance.ephemeral() as instance:
        assert materialize_recipe(recipe, instance) == 0
    stats = json.loads((tmp_path / "data/raw/docs/part-00001.stats.json").read_text())
    assert stats["input"]["uri"] == f"s3://{s3.bucket}/sources/docs/part-00001.jsonl"
    blend = open_blend(tmp_path / "data/blends/mix/manifest.json", "train", verify="full")
    assert len(blend) == 100


def test_materialize_rebuilds_a_pointer_and_blend_removed_from_an_s3_root(
    s3: S3, gpt2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A merged pointer and a blend manifest removed from an ``s3://`` root (the instance keeps
    its records) are rebuilt by the next materialize, not reported up to date; finding that
    costs one HEAD per merged dataset and per blend."""
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, s3.bucket)
    removed = [f"root/{layout.merged_pointer('docs')}", f"root/{layout.blend_manifest('mix')}"]
    heads: list[str] = []

    def head(params: dict[str, Any], **_: Any) -> None:
        heads.append(params["Key"])

    events = shared_client(recipe.storage.s3_endpoint_url).meta.events
    with DagsterInstance.ephemeral() as instance:
        assert materialize_recipe(recipe, instance) == 0
        for key in removed:
            s3.client.delete_object(Bucket=s3.bucket, Key=key)
        storage = StorageResource(
            root=recipe.storage.root, s3_endpoint_url=recipe.storage.s3_endpoint_url
        )
        events.register("before-parameter-build.s3.HeadObject", head)
        try:
            stale = stale_downstream(instance, recipe, set(), storage)
        finally:
            events.unregister("before-parameter-build.s3.HeadObject", head)
        rebuilt = "docs/dataset_info, docs/merged, docs/pruned, docs/nanoset, blend/mix"
        assert ", ".join(k.to_user_string() for k in stale) == rebuilt
        assert sorted(heads) == sorted(
            [f"root/{layout.merged_pointer(ds)}" for ds in ("docs", "code")] + removed[1:]
        )
        capsys.readouterr()
        assert materialize_recipe(recipe, instance) == 0
        assert f"downstream rebuilt: {rebuilt}" in capsys.readouterr().out
        assert stale_downstream(instance, recipe, set(), storage) == []
    assert set(removed) <= set(s3.keys("root/"))


def test_raw_and_hf_artifacts_on_s3_name_s3_and_repeat_byte_identical(
    s3: S3, gpt2_dir: Path, tmp_path: Path
) -> None:
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, s3.bucket)
    local = write_shard(
        tmp_path / "extra.jsonl", [{"text": f"doc {i}"} for i in range(5)], BAD_LINES
    )
    data = local.read_bytes()
    s3.client.put_object(Bucket=s3.bucket, Key="sources/docs/extra-00000.jsonl", Body=data)
    uri = f"s3://{s3.bucket}/sources/docs/extra-00000.jsonl"
    work = tmp_path / "work"
    graph = build_assets(recipe)
    resources = resources_for(recipe)
    resources["storage"] = StorageResource(
        root=recipe.storage.root, s3_endpoint_url=s3.endpoint, work_dir=str(work)
    )
    names = [
        "raw/docs/extra-00000.stats.json",
        "raw/docs/extra-00000.quarantine.jsonl",
        "hf/docs/shards/extra-00000.json",
    ]

    def get(name: str) -> bytes:
        return s3.client.get_object(Bucket=s3.bucket, Key=f"root/{name}")["Body"].read()

    def run(*stages: str) -> None:
        [result] = materialize_shards(
            graph, instance, resources, "docs", ["extra-00000"], stages=stages
        )
        assert result.success and all(e.passed for e in result.get_asset_check_evaluations())

    with DagsterInstance.ephemeral() as instance:
        run("raw_jsonl", "hf_dataset")
        first = {name: get(name) for name in names}
        # The hf step is no writer of the quarantine: deleted, it stays deleted.
        s3.client.delete_object(Bucket=s3.bucket, Key=f"root/{names[1]}")
        run("hf_dataset")
        assert f"root/{names[1]}" not in s3.keys("root/raw/")
        run("raw_jsonl", "hf_dataset")
        assert {name: get(name) for name in names} == first
    stats, quarantine, export = (first[name] for name in names)
    for body in first.values():
        assert b"tokenmill-work-" not in body and str(work).encode() not in body
    sha256 = hashlib.sha256
    record = json.loads(stats)
    assert record["input"] == {"uri": uri, "bytes": len(data), "sha256": sha256(data).hexdigest()}
    assert record["quarantine"] == {
        "file": "extra-00000.quarantine.jsonl",
        "bytes": len(quarantine),
        "sha256": sha256(quarantine).hexdigest(),
    }
    bad = [json.loads(line) for line in quarantine.splitlines()]
    assert [(b["line"], b["source"]) for b in bad] == [(n, uri) for n in (2, 3, 4)]
    assert json.loads(export)["input"] == record["input"]  # the export record names S3 too
    assert list(work.iterdir()) == []


def test_hf_format_source_on_s3(s3: S3, gpt2_dir: Path, tmp_path: Path) -> None:
    """A Parquet shard under an ``s3://`` source with ``format: hf``: its stats and quarantine
    name the shard's URI (not the downloaded copy) and land in the S3 root with the tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    local = tmp_path / "sources" / "wiki"
    local.mkdir(parents=True)
    table = pa.table({"text": ["first", None, "third"], "n": [1, 2, 3]})
    pq.write_table(table, local / "w.parquet")
    s3.upload_tree(tmp_path / "sources", "sources")
    data = {
        "storage": {"root": f"s3://{s3.bucket}/root", "s3_endpoint_url": s3.endpoint},
        "tokenizer": {"path": str(gpt2_dir)},
        "datasets": {"wiki": {"source": f"s3://{s3.bucket}/sources/wiki/", "format": "hf"}},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    recipe = load_recipe(tmp_path / "recipe.yaml")
    graph = build_assets(recipe)
    with DagsterInstance.ephemeral() as instance:
        [result] = materialize_shards(
            graph, instance, resources_for(recipe), "wiki", ["w"], stages=("hf_dataset", "tokens")
        )
        assert all(e.passed for e in result.get_asset_check_evaluations())
    uri = f"s3://{s3.bucket}/sources/wiki/w.parquet"
    body = s3.client.get_object(Bucket=s3.bucket, Key="root/raw/wiki/w.stats.json")["Body"]
    stats = json.loads(body.read())
    assert (stats["input"]["uri"], stats["documents"], stats["quarantined"]) == (uri, 2, 1)
    body = s3.client.get_object(Bucket=s3.bucket, Key="root/raw/wiki/w.quarantine.jsonl")["Body"]
    [bad] = [json.loads(line) for line in body.read().splitlines()]
    assert (bad["source"], bad["line"]) == (uri, 2)
    assert "root/tokens/wiki/manifests/w_text_document.manifest.json" in s3.keys("root/")


def test_a_range_uploads_its_good_shards_before_failing_on_s3(
    s3: S3, gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One shard of a range fails at ``tokens``: its neighbour's pair reaches the bucket and is
    recorded on its own; nothing of the failed shard's tokens is uploaded."""
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, s3.bucket)
    graph = build_assets(recipe)
    real = assets_tokenized.tokenize_files

    def failing(inputs: list[Path], *args: Any, **kwargs: Any) -> Any:
        if "part-00001" in str(inputs[0]):
            raise OSError("disk full")
        return real(inputs, *args, **kwargs)

    monkeypatch.setattr(assets_tokenized, "tokenize_files", failing)
    keys = sorted(list_shards(recipe.dataset("docs")).shards)
    assert keys == ["part-00000", "part-00001"]
    with DagsterInstance.ephemeral() as instance:
        [result] = materialize_shards(
            graph, instance, resources_for(recipe), "docs", keys, ranged=True, raise_on_error=False
        )
        assert not result.success
        [tokens] = instance.fetch_materializations(AssetKey(["docs", "tokens"]), limit=5).records
        assert tokens.partition_key == "part-00000"
    uploaded = s3.keys("root/tokens/docs/")
    assert any(k.endswith("part-00000_text_document.bin") for k in uploaded)
    assert not any("part-00001" in k for k in uploaded)
