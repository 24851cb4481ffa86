"""SIGKILL of the process pushing a step's work directory to S3, at every kind of upload: no
commit marker (dataset manifest, Nanoset cache description, ``current.json`` pointer, blend
manifest) is ever on S3 without all the files it names, a pointer is never removed while its
replacement is uploaded, and the next push completes the tree.

The tree is the versioned layout (``tokenmill.storage.layout``): version A is on S3, version B (new
merged version folder, new index-cache entries, the same two pointers) is pushed and killed
while its upload waits at the fault proxy."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prod_servers import S3
from s3faults import FaultProxy, files_under, s3_tree, unvouched

from tokenmill.atomic import write_json
from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.storage import layout
from tokenmill.storage import staging as s3_stage
from tokenmill.storage.s3 import shared_client
from tokenmill.storage.versions import read_pointer, version_hash, write_pointer

ROOT = Path(__file__).resolve().parents[2]
UPLOADER = """
import sys
from pathlib import Path
from tokenmill.storage.staging import S3Stage
endpoint, bucket, prefix, local = sys.argv[1:]
S3Stage.open(f"s3://{bucket}/{prefix}", endpoint, Path(local)).push()
"""

POINTERS = ("merged/docs/current.json", "blends/mix/manifest.json")

pytestmark = pytest.mark.usefixtures("fast_retries")


def versioned_tree(root: Path, seed: int) -> str:
    """Version ``seed`` of dataset ``docs`` (merged version folder + ``current.json``) and of
    blend ``mix`` (index-cache entries + ``blends/mix/manifest.json``) under ``root``; returns
    the merged version folder's name."""
    version = version_hash({"docs": seed})
    prefix = root / layout.merged_prefix("docs", "text", version)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 60, 80)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(rng.integers(0, 50000, int(lengths.sum())), lengths)
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={"seed": seed}, counts={})
    write_pointer(
        root / layout.merged_pointer("docs"),
        version,
        f"{layout.version_dir_name(version)}/{prefix.name}",
    )
    blend_version = layout.blend_version_dir("mix", version_hash({"mix": seed}))
    manifest = build_blend(
        "mix",
        {"docs": prefix},
        root / blend_version,
        root / layout.nanoset_dir(),
        BlendSettings(
            NanosetSettings(sequence_length=16, split_spec="90,10,0", train_samples=200),
            weights={"docs": 1.0},
        ),
    )
    # The pointer: the version's manifest with its paths made relative to blends/mix/.
    below = posixpath.relpath(blend_version, layout.blend_dir("mix"))
    for entry in file_entries(manifest):
        entry["path"] = posixpath.normpath(posixpath.join(below, entry["path"]))
    for ds in manifest["datasets"]:
        ds["prefix"] = posixpath.normpath(posixpath.join(below, ds["prefix"]))
    write_json(root / layout.blend_manifest("mix"), manifest)
    return layout.version_dir_name(version)


def file_entries(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ``{path, bytes, sha256}`` entry of a blend manifest."""
    entries = [e for ds in manifest["datasets"] for e in ds["files"].values()]
    for info in manifest["splits"].values():
        entries += info["files"].values()
        for ds in info["datasets"]:
            entries += ds["index"]["files"].values()
    return entries


def lies(objects: dict[str, bytes]) -> list[str]:
    """Commit markers in ``objects`` (an ``s3_tree``) naming files that are not there as
    recorded: dataset manifests, index descriptions, pointers and blend manifests."""
    problems = unvouched(objects)

    def check(owner: str, key: str, size: int, sha256: str) -> None:
        data = objects.get(key)
        if data is None or len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            problems.append(f"{owner}: {key} missing or different")

    for key, raw in objects.items():
        folder = key.rsplit("/", 1)[0]
        if key.endswith("-description.json"):
            for record in json.loads(raw)["files"].values():
                check(key, f"{folder}/{record['file']}", record["bytes"], record["sha256"])
        elif key.endswith("/current.json"):
            target = json.loads(raw)["target"]
            if layout.dataset_manifest(f"{folder}/{target}") not in objects:
                problems.append(f"{key}: points at {target}, whose manifest is not there")
        elif key.endswith("/manifest.json"):
            for e in file_entries(json.loads(raw)):
                path = posixpath.normpath(posixpath.join(folder, e["path"]))
                check(key, path, e["bytes"], e["sha256"])
    return problems


@pytest.fixture
def pushes(s3: S3, tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """Version A pushed to ``s3://bucket/root``; version B built in a local tree to push."""
    old = tmp_path / "a"
    versioned_tree(old, seed=1)
    stage = s3_stage.S3Stage(shared_client(s3.endpoint), s3.bucket, "root", old)
    stage.push()
    new = tmp_path / "b"
    versioned_tree(new, seed=2)
    return new, s3_tree(s3, "root/")


def test_push_uploads_data_then_markers_then_pointers(
    s3: S3, pushes: tuple[Path, dict[str, bytes]]
) -> None:
    new, _ = pushes
    stage = s3_stage.S3Stage(shared_client(s3.endpoint), s3.bucket, "root", new)
    order = stage.push()
    kinds = [
        "pointer"
        if rel.endswith(("current.json", "/manifest.json"))
        else "marker"
        if rel.endswith(("-description.json", ".manifest.json"))
        else "data"
        for rel in order
    ]
    assert kinds == sorted(kinds, key=["data", "marker", "pointer"].index)
    assert order[-2:] == ["merged/docs/current.json", "blends/mix/manifest.json"]
    assert order.index("merged/docs/current.json") > max(
        i for i, rel in enumerate(order) if rel.endswith(".manifest.json")
    )
    after = s3_tree(s3, "root/")
    assert lies(after) == []
    for rel, data in files_under(new).items():
        if not rel.endswith(".lock"):
            assert after[f"root/{rel}"] == data, rel


@pytest.mark.parametrize(
    "kill_at",
    [
        r"merged/docs/[0-9a-f]{16}/docs_text_document\.bin$",
        r"-Nanoset-train-document_index\.npy$",
        r"-Nanoset-train-shuffle_index\.npy$",
        r"-Nanoset-valid-description\.json$",
        r"docs_text_document\.manifest\.json$",
        r"merged/docs/current\.json$",
        r"blends/mix/manifest\.json$",
    ],
    ids=["bin", "index-array", "last-index-array", "description", "manifest", "pointer", "blend"],
)
def test_sigkilled_push_leaves_no_marker_without_its_data(
    s3: S3, pushes: tuple[Path, dict[str, bytes]], proxy: FaultProxy, kill_at: str
) -> None:
    new, old = pushes
    held = proxy.add("PUT", kill_at, "hold")
    args = [proxy.endpoint, s3.bucket, "root", str(new)]
    proc = subprocess.Popen([sys.executable, "-c", UPLOADER, *args], cwd=ROOT)
    try:
        assert held.hit.wait(timeout=60), "the push never reached the held upload"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    after = s3_tree(s3, "root/")
    assert lies(after) == []
    # A pointer is never deleted: it names version A until one PUT makes it name version B.
    for pointer in POINTERS:
        assert after[f"root/{pointer}"] in (old[f"root/{pointer}"], (new / pointer).read_bytes())
    for key, data in old.items():
        assert after.get(key) == data or key[len("root/") :] in POINTERS, key  # A untouched

    proxy.clear()
    s3_stage.S3Stage(shared_client(s3.endpoint), s3.bucket, "root", new).push()
    final = s3_tree(s3, "root/")
    assert lies(final) == []
    for rel, data in files_under(new).items():
        if not rel.endswith(".lock"):
            assert final[f"root/{rel}"] == data, rel
    pointer = read_pointer(new / "merged/docs/current.json")
    assert pointer is not None and f"root/merged/docs/{pointer['target']}.bin" in final
