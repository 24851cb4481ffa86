"""Merging follows Megatron add_index (FORMATS §3) with explicit input ordering."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.cli import main
from tokenmill.errors import ConfigError, FormatError, InputError
from tokenmill.formats.dataset_manifest import read_dataset_manifest, write_dataset_manifest
from tokenmill.formats.indexed import IndexedDataset, IndexedDatasetWriter
from tokenmill.formats.merge import merge_datasets, natural_key, resolve_inputs
from tokenmill.verify import verify_dataset


def _make(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(np.asarray(d, dtype=dtype))


def test_merge_vector(tmp_path):
    _make(tmp_path / "A", [[1, 2, 3], [4, 5]])
    _make(tmp_path / "B", [[6, 7, 8, 9]])
    res = merge_datasets([tmp_path / "A", tmp_path / "B"], tmp_path / "out" / "M")
    ds = IndexedDataset(res.prefix)
    assert ds.sequence_lengths.tolist() == [3, 2, 4]
    assert ds.document_indices.tolist() == [0, 1, 2, 3]
    assert ds.sequence_pointers.tolist() == [0, 6, 10]
    assert ds.tokens.tolist() == list(range(1, 10))
    assert res.documents == 3 and res.tokens == 9
    assert read_dataset_manifest(res.prefix)["counts"] == {
        "documents": 3,
        "sequences": 3,
        "tokens": 9,
        "quarantined": 0,
    }
    assert verify_dataset(res.prefix) == []


def test_a_merge_over_an_old_one_fsyncs_its_manifest_removal_first(tmp_path, monkeypatch):
    """The old manifest (in ``manifests/``) is removed and its folder fsynced before the new
    pair is renamed over the old one: a crash never leaves it vouching for the new bytes."""
    from tokenmill.formats import indexed
    from tokenmill.formats import merge as merge_module

    _make(tmp_path / "A", [[1, 2, 3], [4, 5]])
    _make(tmp_path / "B", [[6, 7, 8, 9]])
    merge_datasets([tmp_path / "A"], tmp_path / "M")
    events = []
    real_commit = indexed.commit

    def watched(tmp, final):
        events.append(f"commit {final.name}")
        real_commit(tmp, final)

    monkeypatch.setattr(indexed, "commit", watched)
    monkeypatch.setattr(
        merge_module, "fsync_dir", lambda d: events.append(f"fsync {d}"), raising=False
    )
    merge_datasets([tmp_path / "A", tmp_path / "B"], tmp_path / "M")
    assert events[:2] == [f"fsync {tmp_path / 'manifests'}", "commit M.bin"]
    assert verify_dataset(tmp_path / "M") == []


def _tokens_manifest(prefix, fingerprint, quarantined, text_key="text"):
    config = {"tokenizer_fingerprint": fingerprint, "text_key": text_key, "append_eod": True}
    write_dataset_manifest(
        prefix, kind="tokens", inputs=[], config=config, counts={"quarantined": quarantined}
    )


def test_merged_manifest_carries_the_inputs_provenance(tmp_path):
    for name, docs, quarantined in (("a", [[1, 2]], 2), ("b", [[3]], 5)):
        _make(tmp_path / name, docs)
        _tokens_manifest(tmp_path / name, "f" * 64, quarantined)
    _make(tmp_path / "hand", [[4]])  # a Megatron dataset without a manifest adds nothing
    merge_datasets([tmp_path / "a", tmp_path / "hand", tmp_path / "b"], tmp_path / "m")
    manifest = read_dataset_manifest(tmp_path / "m")
    assert manifest["config"] == {
        "order": "given",
        "dtype": "uint16",
        "tokenizer_fingerprint": "f" * 64,
        "text_key": "text",
        "append_eod": True,
        "eod_id": None,
    }
    assert manifest["counts"]["quarantined"] == 7
    merge_datasets([tmp_path / "m", tmp_path / "a"], tmp_path / "mm")  # merged inputs carry it
    assert read_dataset_manifest(tmp_path / "mm")["config"]["tokenizer_fingerprint"] == "f" * 64
    _make(tmp_path / "hand2", [[5]])
    merge_datasets([tmp_path / "hand", tmp_path / "hand2"], tmp_path / "h")
    config = read_dataset_manifest(tmp_path / "h")["config"]
    assert (config["tokenizer_fingerprint"], config["text_key"]) == (None, None)


def test_merge_refuses_inputs_of_different_tokenizers(tmp_path):
    _make(tmp_path / "a", [[1, 2]])
    _tokens_manifest(tmp_path / "a", "a" * 64, 0)
    _make(tmp_path / "b", [[3]])
    _tokens_manifest(tmp_path / "b", "b" * 64, 0)
    with pytest.raises(InputError, match=r"tokenizer_fingerprint 'b+', but .*a has 'a+'"):
        merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert not list(tmp_path.glob("m.*"))


def test_merge_equals_single_write_with_empty_documents(tmp_path):
    parts = [[[1], [], [2, 3]], [[], []], [[4, 5, 6], []]]
    for i, docs in enumerate(parts):
        _make(tmp_path / f"p{i}", docs)
    _make(tmp_path / "whole", [d for docs in parts for d in docs])
    merge_datasets([tmp_path / f"p{i}" for i in range(3)], tmp_path / "m")
    for ext in ("bin", "idx"):
        assert (tmp_path / f"m.{ext}").read_bytes() == (tmp_path / f"whole.{ext}").read_bytes()
    ds = IndexedDataset(tmp_path / "m")
    assert ds.num_documents == 7
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 2, 2, 3, 3]


def test_orders(tmp_path):
    src = tmp_path / "src"
    for n in (1, 2, 10):
        _make(src / f"part_{n}", [[n]])
    (src / "README.txt").write_text("not a dataset")
    given = resolve_inputs([src / "part_10", src / "part_2"], "given")
    assert [p.name for p in given] == ["part_10", "part_2"]
    lex = resolve_inputs([src], "lexicographic")
    assert [p.name for p in lex] == ["part_1", "part_10", "part_2"]
    nat = resolve_inputs([src], "natural")
    assert [p.name for p in nat] == ["part_1", "part_2", "part_10"]
    merge_datasets([src], tmp_path / "n", order="natural")
    assert IndexedDataset(tmp_path / "n").tokens.tolist() == [1, 2, 10]
    assert natural_key("a10b2") == ["a", 10, "b", 2, ""]


def test_dtype_mismatch_names_file(tmp_path):
    _make(tmp_path / "u16", [[1]])
    _make(tmp_path / "i32", [[1]], dtype=np.int32)
    with pytest.raises(FormatError, match=r"i32\.idx: dtype: int32 does not match"):
        merge_datasets([tmp_path / "u16", tmp_path / "i32"], tmp_path / "out")
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == []


def test_missing_partner_in_dir(tmp_path):
    src = tmp_path / "src"
    _make(src / "a", [[1]])
    (src / "a.bin").unlink()
    with pytest.raises(InputError, match=r"a\.bin: missing partner file"):
        resolve_inputs([src])
    with pytest.raises(InputError, match=r"a\.bin: missing"):
        resolve_inputs([src / "a"])


def test_bad_usage(tmp_path):
    _make(tmp_path / "a", [[1]])
    with pytest.raises(ConfigError, match="given twice"):
        resolve_inputs([tmp_path / "a", tmp_path / "a.idx"])
    with pytest.raises(ConfigError, match="--order"):
        resolve_inputs([tmp_path / "a"], "random")


def test_cli_merge_and_verify(tmp_path, capsys):
    _make(tmp_path / "a", [[1, 2]])
    _make(tmp_path / "b", [[3]])
    assert (
        main(
            [
                "merge",
                "--input",
                str(tmp_path / "a"),
                str(tmp_path / "b"),
                "--output-prefix",
                str(tmp_path / "m"),
            ]
        )
        == 0
    )
    assert "2 documents" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "m")]) == 0
    raw = bytearray((tmp_path / "m.bin").read_bytes())
    raw[0] ^= 1
    (tmp_path / "m.bin").write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "manifests" / "m.manifest.json")]) == 1
    assert "differs from the manifest" in capsys.readouterr().out
    assert main(["merge", "--input", str(tmp_path / "nope"), "--output-prefix", "x"]) == 1
    assert main(["inspect", str(tmp_path / "a")]) == 0
    assert "tokens" in capsys.readouterr().out


def test_merge_manifest_records_parts_and_detects_corruption(tmp_path):
    for name, docs in (("a", [[1, 2]]), ("b", [[3, 4, 5]]), ("c", [[6]])):
        _make(tmp_path / name, docs)
    merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    merge_datasets([tmp_path / "ab", tmp_path / "c"], tmp_path / "abc")
    info = read_dataset_manifest(tmp_path / "abc")["files"]["abc.bin"]
    assert [p["bytes"] for p in info["parts"]] == [4, 6, 2]
    assert verify_dataset(tmp_path / "abc") == []
    raw = bytearray((tmp_path / "abc.bin").read_bytes())
    raw[5] ^= 0xFF
    (tmp_path / "abc.bin").write_bytes(bytes(raw))
    assert verify_dataset(tmp_path / "abc", full=False) == []
    (problem,) = verify_dataset(tmp_path / "abc")
    assert "sha256 of part 1 (bytes 4..) differs" in problem


def test_merge_manifest_names_inputs_absolute_or_as_told(tmp_path, monkeypatch):
    for name, docs in (("a", [[1, 2]]), ("b", [[3]])):
        _make(tmp_path / name, docs)
    monkeypatch.chdir(tmp_path)
    merge_datasets(["a", "b"], tmp_path / "ab")
    inputs = read_dataset_manifest(tmp_path / "ab")["inputs"]
    assert [i["prefix"] for i in inputs] == [str(tmp_path / "a"), str(tmp_path / "b")]
    merge_datasets(["a", "b"], tmp_path / "ab", input_uri=lambda q: f"s3://bucket/{q.name}")
    inputs = read_dataset_manifest(tmp_path / "ab")["inputs"]
    assert [i["prefix"] for i in inputs] == ["s3://bucket/a", "s3://bucket/b"]


def test_inspect_decode_with_tokenizer(tmp_path, capsys, gpt2_dir):
    _make(tmp_path / "d", [[15496, 995, 50256]])
    assert (
        main(["inspect", str(tmp_path / "d"), "--decode", "0", "--tokenizer", str(gpt2_dir)]) == 0
    )
    assert "Hello world<|endoftext|>" in capsys.readouterr().out
    assert (
        main(["inspect", str(tmp_path / "d"), "--decode", "3", "--tokenizer", str(gpt2_dir)]) == 2
    )
    assert main(["inspect", str(tmp_path / "d"), "--decode", "0"]) == 2
