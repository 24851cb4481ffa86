"""Dataset manifests live in a ``manifests/`` sidecar folder, so Megatron's and nanotron's folder
scan (``tools/merge_datasets.py``) pairs every file of a tokenmill folder; ``tokenmill migrate``
moves the manifests tokenmill 0.1.0 wrote beside the pair, which nothing else reads."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from tiny_pairs import random_pair

from tokenmill.atomic import TMP_DIR
from tokenmill.cli import main
from tokenmill.errors import ConfigError
from tokenmill.formats.dataset_manifest import (
    dataset_manifest_path,
    prefix_of_manifest,
    read_dataset_manifest,
    write_dataset_manifest,
)
from tokenmill.formats.merge import merge_datasets
from tokenmill.paths import name_problem
from tokenmill.storage import layout
from tokenmill.storage.layout import check_name
from tokenmill.storage.migrate import migrate
from tokenmill.tokenize.run import tokenize_files
from tokenmill.verify import verify_dataset


def megatron_merge_scan(folder: str) -> list[str]:
    """The listing and pairing of Megatron-LM ``tools/merge_datasets.py`` ``main()`` (the same
    loop in nanotron's copy), restated: every regular file's ``splitext`` stem must have both
    ``.bin`` and ``.idx``; folders are skipped. Returns the sorted prefixes it would merge;
    raises AssertionError with Megatron's message where the tool would fail."""
    prefixes: set[str] = set()
    for basename in os.listdir(folder):
        prefix, ext = os.path.splitext(basename)
        if prefix in prefixes:
            continue
        if not os.path.isfile(os.path.join(folder, basename)):
            continue
        ext_pair = ".bin" if ext == ".idx" else ".idx"
        if not os.path.isfile(os.path.join(folder, prefix) + ext_pair):
            raise AssertionError(
                f"ERROR: {ext_pair} file not provided for {os.path.join(folder, prefix)}"
            )
        prefixes.add(prefix)
    return sorted(prefixes)


def _shards(folder: Path) -> list[Path]:
    folder.mkdir(parents=True)
    paths = []
    for i in range(2):
        path = folder / f"part-{i:05d}.jsonl"
        docs = [{"text": f"document {i}.{j}: the quick brown fox"} for j in range(3 + i)]
        path.write_text("".join(json.dumps(d) + "\n" for d in docs))
        paths.append(path)
    return paths


def test_megatron_scan_pairs_every_file_of_tokens_and_merged_folders(
    tmp_path: Path, gpt2_dir: Path
) -> None:
    root = tmp_path / "root"
    tokens = root / layout.tokens_dir("docs")
    prefixes = []
    for shard in _shards(tmp_path / "raw"):
        out = tokens / shard.name.removesuffix(".jsonl")
        prefixes.append(tokenize_files([shard], out, gpt2_dir, append_eod=True).prefix)
    merged = root / layout.merged_prefix("docs", "text", "ab" * 32)
    merge_datasets(prefixes, merged)
    for folder, expected in (
        (tokens, ["part-00000_text_document", "part-00001_text_document"]),
        (merged.parent, ["docs_text_document"]),
    ):
        assert (folder / TMP_DIR).is_dir()  # the writers' temp folder: the scan skips it
        assert megatron_merge_scan(str(folder)) == expected
        assert sorted(p.name for p in (folder / "manifests").iterdir() if p.is_file()) == [
            f"{name}.manifest.json" for name in expected
        ]
    assert dataset_manifest_path(merged).is_file() and verify_dataset(merged) == []
    assert read_dataset_manifest(merged)["counts"]["documents"] == 7
    # The scan is faithful: a manifest beside the pair (the 0.1.0 layout) makes it fail.
    legacy_path(merged).write_bytes(dataset_manifest_path(merged).read_bytes())
    with pytest.raises(AssertionError, match=r"\.idx file not provided for .*\.manifest$"):
        megatron_merge_scan(str(merged.parent))


def legacy_path(prefix: Path) -> Path:
    """``P.manifest.json``: where tokenmill 0.1.0 wrote the manifest of the pair ``P``."""
    return Path(f"{prefix}.manifest.json")


def old_layout(root: Path) -> dict[str, Path]:
    """A storage root as tokenmill 0.1.0 left it: two shards and a merged pair, each with its
    manifest beside the pair; the merged pair also has a sidecar copy (a migrate killed after
    writing it), byte-equal, which the next run keeps."""
    pairs = {
        "a": root / "tokens/docs/part-00000_text_document",
        "b": root / "tokens/docs/part-00001_text_document",
        "m": root / "merged/docs_text_document",
    }
    for i, prefix in enumerate(pairs.values()):
        random_pair(prefix, 20 + i, seed=i)
        write_dataset_manifest(prefix, kind="tokens", inputs=[], config={}, counts={"n": i})
        legacy_path(prefix).write_bytes(dataset_manifest_path(prefix).read_bytes())
    shutil.rmtree(root / "tokens/docs/manifests")  # 0.1.0 had no sidecar folder
    return pairs


def test_migrate_moves_0_1_0_manifests_into_the_sidecar_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    pairs = old_layout(root)
    recorded = {n: legacy_path(p).read_bytes() for n, p in pairs.items()}
    assert not dataset_manifest_path(pairs["a"]).is_file()  # readers look in manifests/ only
    with pytest.raises(ValueError, match="run tokenmill migrate"):
        prefix_of_manifest(legacy_path(pairs["a"]))
    before = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    planned = migrate(root, dry_run=True)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == before
    assert [(m.old, m.new, m.stale) for m in planned] == [
        ("merged/docs_text_document.manifest.json",
         "merged/manifests/docs_text_document.manifest.json", True),
        ("tokens/docs/part-00000_text_document.manifest.json",
         "tokens/docs/manifests/part-00000_text_document.manifest.json", False),
        ("tokens/docs/part-00001_text_document.manifest.json",
         "tokens/docs/manifests/part-00001_text_document.manifest.json", False),
    ]  # fmt: skip
    assert main(["migrate", str(root)]) == 0
    out = capsys.readouterr().out
    assert "removed merged/docs_text_document.manifest.json (stale" in out
    assert "3 manifest(s) migrated" in out
    for name, prefix in pairs.items():
        assert not legacy_path(prefix).exists()
        assert dataset_manifest_path(prefix).read_bytes() == recorded[name]
        assert verify_dataset(prefix) == []
        assert prefix.name in megatron_merge_scan(str(prefix.parent))  # no stray file
    assert migrate(root) == []  # once is enough: a second run changes nothing


def test_manifest_paths_and_keys_agree(tmp_path: Path) -> None:
    prefix = tmp_path / "manifests" / "x_text_document"  # a pair may itself sit in "manifests"
    assert layout.dataset_manifest("merged/d/0123456789abcdef/d_text_document") == (
        "merged/d/0123456789abcdef/manifests/d_text_document.manifest.json"
    )
    assert prefix_of_manifest(dataset_manifest_path(prefix)) == prefix
    with pytest.raises(ValueError, match="layout: run tokenmill migrate"):
        prefix_of_manifest(legacy_path(tmp_path / "x_text_document"))
    with pytest.raises(ValueError, match="not a dataset manifest"):
        prefix_of_manifest(tmp_path / "manifest.json")
    with pytest.raises(Exception, match="reserved for manifest folders"):
        layout.merged_dir("manifests")


def test_a_shard_name_is_refused_when_a_derived_temp_name_could_be_too_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The longest accepted shard name has every derived file written through a temp whose
    name embeds the longest host tag and pid; one byte more is refused, whatever this host."""
    from tokenmill import atomic

    monkeypatch.setattr(atomic, "host_tag", lambda: "h" * 40)
    monkeypatch.setattr(atomic.os, "getpid", lambda: 4_194_304)  # pid_max: 7 digits

    def longest_ok(text_key: str) -> int:
        n = 1
        while (
            layout.shard_name_problem(f"{'s' * (n + 1)}.jsonl.zst", "s" * (n + 1), text_key) is None
        ):
            n += 1
        return n

    for text_key in ("text", "content_with_a_long_key"):
        n = longest_ok(text_key)
        assert n >= 120
        shard = "s" * n
        names = [
            f"{shard}.jsonl.zst",
            layout.raw_stats("d", shard),
            layout.quarantine("d", shard),
            layout.parquet("d", shard),
            layout.export_record("d", shard),
            layout.dataset_manifest(layout.tokens_prefix("d", shard, text_key)),
            layout.tokens_prefix("d", shard, text_key) + ".bin",
        ]
        for name in names:  # each written through a temp, plus a transfer library's extension
            final = tmp_path / text_key / name
            final.parent.mkdir(parents=True, exist_ok=True)
            temp = atomic.temp_path_for(final)
            temp.with_name(temp.name + ".1a2B3c4D").write_bytes(b"x")
            atomic.write_bytes(final, b"x")
        problem = layout.shard_name_problem(f"{shard}s.jsonl", f"{shard}s", text_key)
        assert problem is not None and "the name is too long" in problem
        assert f"at most {n} bytes" in problem


@pytest.mark.parametrize("name", ["", ".", "a/b", "a\\b", "/abs", "a\x00b", "del\x7f"])
def test_check_name_gives_name_problems_reason(name: str) -> None:
    """One path-safety rule: ``layout.check_name`` refuses what ``paths.name_problem`` refuses,
    for its reason, and adds only the artifact rules (``..``, a leading ``.``, format chars)."""
    reason = name_problem(name)
    assert reason is not None
    with pytest.raises(ConfigError, match=f"rejected: it {re.escape(reason)}$"):
        check_name(name)
    for artifact_only in ("a..b", ".hidden", "zero\u200bwidth"):
        assert name_problem(artifact_only) is None
        with pytest.raises(ConfigError, match="rejected: it "):
            check_name(artifact_only)


def test_one_lowercase_hex_rule_for_versions() -> None:
    from tokenmill.paths import is_lower_hex

    assert is_lower_hex("0123456789abcdef") and not is_lower_hex("")
    assert not is_lower_hex("00FF") and not is_lower_hex("0g")
    with pytest.raises(ConfigError, match="expected >= 16 lowercase hex digits"):
        layout.version_dir_name("0123456789ABCDEF")


def test_migrate_on_an_s3_root(tmp_path: Path, s3: Any) -> None:
    """The same moves on ``s3://bucket/prefix`` (one listing of the whole root)."""
    root = tmp_path / "root"
    pairs = old_layout(root)
    s3.upload_tree(root, "data")
    uri = f"s3://{s3.bucket}/data"
    moves = migrate(uri, endpoint_url=s3.endpoint)
    assert [m.stale for m in moves] == [True, False, False]
    keys = s3.keys("data/")
    for prefix in pairs.values():
        rel = prefix.relative_to(root).as_posix()
        assert f"data/{rel}.manifest.json" not in keys
        assert f"data/{layout.dataset_manifest(rel)}" in keys
    assert migrate(uri, endpoint_url=s3.endpoint) == []
