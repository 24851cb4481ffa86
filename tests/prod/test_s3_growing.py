"""Growing semantics on an S3 root (moto): the refresh after a new shard extends each index
entry (its description on S3 names the previous entry's files as segments, and the step
uploads only the new rows), and the blend read back (pulled, and streamed from ``s3://``) is
complete: a full verify passes and the previous version's samples start every split."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import yaml
from dagster import DagsterInstance
from prod_servers import S3
from test_s3_pipeline import s3_recipe

from pipelines.materialize import materialize_recipe
from tokenmill.loader import open_blend
from tokenmill.recipe import load_recipe
from tokenmill.storage.pull import pull
from tokenmill_dev.corpus import stdlib_documents


def test_growing_refresh_on_s3_extends_its_index_entries(
    s3: S3, gpt2_dir: Path, tmp_path: Path
) -> None:
    recipe = s3_recipe(tmp_path, s3, gpt2_dir, s3.bucket)
    data = yaml.safe_load(recipe.path.read_text())
    data["nanoset"].update(semantics="growing", train_samples=None, era_samples=4)
    recipe.path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    recipe = load_recipe(recipe.path)
    uri = f"s3://{s3.bucket}/root/blends/mix/manifest.json"
    with DagsterInstance.ephemeral() as instance:
        assert materialize_recipe(recipe, instance) == 0
        v1 = pull(uri, tmp_path / "v1").manifest
        late = tmp_path / "late" / "docs"
        docs = itertools.islice(stdlib_documents(kind="docs"), 40, 43)  # small: no compaction
        late.mkdir(parents=True)
        (late / "part-00009.jsonl").write_text(
            "".join(json.dumps({"text": d["text"][:1200]}) + "\n" for d in docs)
        )
        s3.upload_tree(tmp_path / "late", "sources")
        before = set(s3.keys("root/nanoset/"))
        assert materialize_recipe(recipe, instance) == 0
    added = sorted(set(s3.keys("root/nanoset/")) - before)
    descriptions = [k for k in added if k.endswith("-description.json")]
    extended = [
        json.loads(s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read())
        for k in descriptions
    ]
    trains = [d for d in extended if d["key"]["split"] == "train"]
    assert len(trains) == 1  # docs grew; code's entries are unchanged (same keys)
    files = trains[0]["files"]  # the new rows only, the old ones referenced
    assert files["document"]["shape"][0] < files["document.0"]["shape"][0]
    assert f"root/nanoset/{files['document.0']['file']}" in before
    v2 = pull(uri, tmp_path / "v2").manifest
    for split in ("train", "valid", "test"):
        old = open_blend(v1, split, verify="full")
        new = open_blend(v2, split, verify="full")
        streamed = open_blend(uri, split, cache_dir=tmp_path / "cache")
        assert len(new) >= len(old) and len(streamed) == len(new)
        assert split != "train" or len(old) > 0
        ids = np.arange(len(old))
        np.testing.assert_array_equal(new.get_batch(ids), old.get_batch(ids))
        every = np.arange(len(new))
        np.testing.assert_array_equal(streamed.get_batch(every), new.get_batch(every))
