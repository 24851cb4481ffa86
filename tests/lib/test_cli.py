"""The ``tokenmill`` command line: --version, help texts with defaults, and the targets that
``verify`` and ``inspect`` take (folders, pointers, manifests, dataset_info.json)."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tokenmill import __version__
from tokenmill.cli import COMMANDS, build_parser, main
from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.storage.versions import write_pointer


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"tokenmill {__version__}"


def test_every_command_has_a_description_and_its_help_shows_each_default() -> None:
    parsers = _subparsers()
    assert sorted(parsers) == sorted(COMMANDS)
    for name, sub in parsers.items():
        assert sub.description, f"tokenmill {name} --help has no description"
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.default in (None, False, [], "==SUPPRESS=="):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert "default" in text, f"tokenmill {name} {action.option_strings[0]}: {text!r}"
    blend_help = parsers["blend"].format_help()
    for shown in ("(default: 949,50,1)", "(default: 1234)", "(default: megatron)"):
        assert shown in " ".join(blend_help.split())


def _merged(root: Path, name: str, seed: int) -> Path:
    """A merged dataset as ``make demo`` leaves it: a version folder and ``current.json``."""
    version = f"{seed}" * 64
    prefix = root / "merged" / name / version[:16] / f"{name}_text_document"
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 30, 150)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:  # ids GPT-2 can decode
        writer.add_documents(rng.integers(0, 50000, int(lengths.sum())), lengths)
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={})
    write_pointer(root / "merged" / name / "current.json", version, f"{version[:16]}/{prefix.name}")
    return prefix


@pytest.fixture
def blend_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    for name, seed in (("docs", 1), ("code", 2)):
        _merged(tmp_path, name, seed)
    argv = ["blend", "--dataset", f"docs={tmp_path / 'merged/docs'}",
            "--dataset", f"code={tmp_path / 'merged/code'}", "--weight", "docs=3",
            "--weight", "code=1", "--output", str(tmp_path / "blends/mix"),
            "--sequence-length", "16", "--train-samples", "40", "--split", "90,5,5"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    return tmp_path


def test_verify_takes_folders_pointers_and_manifests(
    blend_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = next((blend_root / "merged/docs").glob("*/docs_text_document.bin")).with_suffix("")
    for target in (
        blend_root / "blends/mix",  # the folder, as open_blend and pull take it
        blend_root / "blends/mix/manifest.json",
        blend_root / "merged/docs",  # a merged dataset's folder: its current version
        blend_root / "merged/docs/current.json",
        docs.parent / "manifests" / "docs_text_document.manifest.json",
        docs.with_suffix(".idx"),
    ):
        assert main(["verify", str(target)]) == 0, capsys.readouterr()
        assert capsys.readouterr().out == f"OK {target}\n"
    assert main(["verify", str(blend_root / "merged")]) == 2
    assert "a folder without manifest.json (a blend), current.json" in capsys.readouterr().err
    data = bytearray(docs.with_suffix(".bin").read_bytes())
    data[3] ^= 0xFF
    docs.with_suffix(".bin").write_bytes(bytes(data))
    assert main(["verify", str(blend_root / "merged/docs")]) == 1
    assert "docs_text_document.bin: sha256 differs from the manifest" in capsys.readouterr().out


def test_verify_checks_an_hf_export_against_its_dataset_info(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = tmp_path / "part-00000.jsonl"
    shard.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(7)))
    out = tmp_path / "hf" / "docs"
    assert main(["export", "--input", str(shard), "--output-dir", str(out)]) == 0
    capsys.readouterr()
    for target in (out / "dataset_info.json", out):
        assert main(["verify", str(target)]) == 0
        assert capsys.readouterr().out == f"OK {target}\n"
    parquet = out / "data" / "part-00000.parquet"
    parquet.write_bytes(parquet.read_bytes()[:-1] + b"\0")
    assert main(["verify", "--fast", str(out)]) == 0  # sizes only
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    assert f"FAIL {parquet}: sha256 differs from dataset_info.json" in capsys.readouterr().out
    parquet.unlink()
    assert main(["verify", "--fast", str(out)]) == 1
    assert f"FAIL {parquet}: missing" in capsys.readouterr().out


def test_inspect_blend_decodes_samples_of_a_split(
    blend_root: Path, gpt2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenmill.loader import open_blend

    blend = blend_root / "blends/mix"
    argv = ["inspect", str(blend), "--decode", "3", "--tokenizer", str(gpt2_dir)]
    assert main([*argv, "--split", "valid"]) == 0
    out = capsys.readouterr().out
    sample = open_blend(blend, split="valid")[3].tolist()
    text = Tokenizer.from_file(str(gpt2_dir / "tokenizer.json")).decode(sample)
    assert out.startswith("blend 'mix': semantics megatron, sequence length 16")  # the table
    assert f"--- valid sample 3 ({len(sample)} tokens) ---\n{text}\n" in out
    assert main([*argv[:2], "--decode", "40", "--tokenizer", str(gpt2_dir)]) == 2
    assert "--decode 40: the blend's train split has samples 0..39" in capsys.readouterr().err
    assert main(["inspect", str(blend), "--decode", "0"]) == 2
    assert "--decode needs --tokenizer" in capsys.readouterr().err


def test_verify_and_inspect_refuse_an_s3_uri(capsys: pytest.CaptureFixture[str]) -> None:
    """An ``s3://`` target is not turned into the local path ``s3:/bucket/...``."""
    for command in ("verify", "inspect"):
        assert main([command, "s3://bucket/blends/mix"]) == 2
        err = capsys.readouterr().err
        assert "s3://bucket/blends/mix: a URI, but this command reads local files" in err
        assert "`tokenmill pull s3://bucket/blends/mix DIR` first" in err


def test_inspect_decode_cuts_at_max_tokens(
    blend_root: Path, gpt2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenmill.loader import open_blend

    blend = blend_root / "blends/mix"
    sample = open_blend(blend, split="train")[0].tolist()
    text = Tokenizer.from_file(str(gpt2_dir / "tokenizer.json")).decode(sample[:5])
    argv = ["inspect", str(blend), "--decode", "0", "--tokenizer", str(gpt2_dir)]
    assert main([*argv, "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert f"--- train sample 0 ({len(sample)} tokens) ---\n{text}\n" in out
    assert f"[... cut at 5 of {len(sample)} tokens; --max-tokens 0 prints all]" in out
    assert main([*argv, "--max-tokens", "0"]) == 0
    assert "cut at" not in capsys.readouterr().out
    assert main([*argv, "--max-tokens", "-1"]) == 2
    assert "--max-tokens -1: expected >= 0" in capsys.readouterr().err


def test_inspect_into_a_closed_pipe_stops_quietly(blend_root: Path, gpt2_dir: Path) -> None:
    """``tokenmill inspect --decode ... | head -1``: no traceback, no error line (far more
    output than a pipe buffer, so the writes meet the closed pipe)."""
    decodes = " ".join(["--decode 0"] * 5000)
    command = (
        f"{shlex.quote(sys.executable)} -m tokenmill.cli inspect {blend_root / 'blends/mix'} "
        f"{decodes} --tokenizer {gpt2_dir} | head -1"
    )
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command}"], capture_output=True, text=True, timeout=300
    )
    assert done.stdout.startswith("blend 'mix'")
    assert done.stderr == ""
    assert done.returncode == 1  # Python's docs: exit 1 after a broken pipe
