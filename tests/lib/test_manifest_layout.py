"""Dataset manifests live in a ``manifests/`` sidecar folder, so Megatron's and nanotron's folder
scan (``tools/merge_datasets.py``) pairs every file of a tokenmill folder; 0.1.0 manifests
beside the pair are still read, and move on the next write."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from tiny_pairs import random_pair

from tokenmill.atomic import TMP_DIR
from tokenmill.cli import main
from tokenmill.errors import ConfigError
from tokenmill.formats.dataset_manifest import (
    dataset_manifest_path,
    legacy_manifest_path,
    prefix_of_manifest,
    read_dataset_manifest,
    sidecar_manifest_path,
    write_dataset_manifest,
)
from tokenmill.formats.merge import merge_datasets
from tokenmill.indices.blend_build import build_blend
from tokenmill.loader import open_blend
from tokenmill.paths import name_problem
from tokenmill.storage import layout
from tokenmill.storage.layout import check_name
from tokenmill.storage.pull import pull
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
    assert sidecar_manifest_path(merged).is_file() and verify_dataset(merged) == []
    assert read_dataset_manifest(merged)["counts"]["documents"] == 7
    # The scan is faithful: a manifest beside the pair (the 0.1.0 layout) makes it fail.
    legacy_manifest_path(merged).write_bytes(sidecar_manifest_path(merged).read_bytes())
    with pytest.raises(AssertionError, match=r"\.idx file not provided for .*\.manifest$"):
        megatron_merge_scan(str(merged.parent))


def test_a_legacy_manifest_is_read_in_place_and_moved_by_the_next_write(tmp_path: Path) -> None:
    prefix = random_pair(tmp_path / "old_text_document", 20, seed=3)
    write_dataset_manifest(prefix, kind="tokens", inputs=[], config={}, counts={"documents": 20})
    sidecar = sidecar_manifest_path(prefix)
    sidecar.rename(legacy_manifest_path(prefix))  # as tokenmill 0.1.0 left it
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert dataset_manifest_path(prefix) == legacy_manifest_path(prefix)
    assert read_dataset_manifest(prefix)["counts"] == {"documents": 20}
    assert verify_dataset(prefix) == []
    assert main(["verify", str(legacy_manifest_path(prefix))]) == 0
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # readers never move it
    write_dataset_manifest(prefix, kind="tokens", inputs=[], config={}, counts={"documents": 20})
    assert sidecar.is_file() and not legacy_manifest_path(prefix).exists()
    assert dataset_manifest_path(prefix) == sidecar
    assert megatron_merge_scan(str(tmp_path)) == ["old_text_document"]


def test_manifest_paths_and_keys_agree(tmp_path: Path) -> None:
    prefix = tmp_path / "manifests" / "x_text_document"  # a pair may itself sit in "manifests"
    assert layout.dataset_manifest("merged/d/0123456789abcdef/d_text_document") == (
        "merged/d/0123456789abcdef/manifests/d_text_document.manifest.json"
    )
    assert layout.dataset_manifests("a/b") == ["a/manifests/b.manifest.json", "a/b.manifest.json"]
    assert prefix_of_manifest(sidecar_manifest_path(prefix)) == prefix
    random_pair(prefix, 3, seed=1)
    assert prefix_of_manifest(legacy_manifest_path(prefix)) == prefix
    with pytest.raises(ValueError, match="not a dataset manifest"):
        prefix_of_manifest(tmp_path / "manifest.json")
    with pytest.raises(Exception, match="reserved for manifest folders"):
        layout.merged_dir("manifests")


def test_pull_from_a_legacy_source_writes_sidecar_manifests(tmp_path: Path) -> None:
    """A blend over 0.1.0-layout datasets is read where it is; its copy has the new layout
    (a stale 0.1.0 manifest in the destination goes) and opens."""
    src = tmp_path / "src"
    sets = {}
    for name, seed in (("docs", 1), ("code", 2)):
        prefix = random_pair(src / "merged" / f"{name}_text_document", 60, seed)
        write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={})
        sidecar_manifest_path(prefix).rename(legacy_manifest_path(prefix))
        sets[name] = prefix
    build_blend("mix", sets, src / "blends/mix", src / "nanoset", weights={"docs": 1, "code": 1},
                sequence_length=8, split_spec="80,10,10", train_samples=20)  # fmt: skip
    dest = tmp_path / "dest"
    (dest / "merged").mkdir(parents=True)
    (dest / "merged/docs_text_document.manifest.json").write_text("{}")  # an earlier copy's
    report = pull(str(src / "blends/mix"), dest, jobs=1)
    assert sorted(p.name for p in (dest / "merged").iterdir()) == [
        TMP_DIR, "code_text_document.bin", "code_text_document.idx",
        "docs_text_document.bin", "docs_text_document.idx", "manifests",
    ]  # fmt: skip
    assert list((dest / "merged" / TMP_DIR).iterdir()) == []
    for name in sets:
        copied = dest / "merged" / "manifests" / f"{name}_text_document.manifest.json"
        assert copied.read_bytes() == legacy_manifest_path(sets[name]).read_bytes()
    assert megatron_merge_scan(str(dest / "merged")) == ["code_text_document", "docs_text_document"]
    assert len(open_blend(report.manifest, split="train")) >= 20


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
