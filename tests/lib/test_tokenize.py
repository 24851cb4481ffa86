"""`tokenmill tokenize`: byte parity with a direct tokenizer loop, workers, kills, bad records."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _helpers import corrupt_gigatoken, reference_tokenizer

from tokenmill.atomic import file_sha256
from tokenmill.cli import main
from tokenmill.errors import BadRecordError, ConfigError, TokenmillError
from tokenmill.formats.dataset_manifest import (
    check_dataset_files,
    dataset_manifest_path,
    file_problems,
    input_sha256,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDataset, encode_index
from tokenmill.tokenize import outputs as outputs_module
from tokenmill.tokenize import run as run_module
from tokenmill.tokenize import tokenizer as tokenizer_module
from tokenmill.tokenize.procs import SAMPLE_CHARS
from tokenmill.tokenize.run import TokenizeSession, dataset_prefix, tokenize_files
from tokenmill.tokenize.tokenizer import load_tokenizer
from tokenmill_dev.corpus import stdlib_documents

EDGE_TEXTS = [
    "",
    "Hello world",
    "literal special: <|endoftext|> and </s><s>[INST] inside a document",
    "  leading spaces, CRLF\r\nline\r\n",
    "ﬁ ① ｆｕｌｌ\u00a0\u3000 e\u0301 😀👍🏽 日本語",
    "",
    " ",
]


def expected_pair(path: Path, texts: list[str], eod: bool) -> tuple[list[list[int]], Any]:
    """Megatron's per-document ids: ``tokenizer(text).input_ids`` (+ eos when non-empty)."""
    tok = reference_tokenizer(path)
    docs = [list(tok(t).input_ids) for t in texts]
    if eod:
        docs = [[*d, tok.eos_token_id] if d else d for d in docs]
    return docs, tok


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    data = "".join(
        json.dumps({key: t, "n": i}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)
    )
    raw = data.encode("utf-8")
    path.write_bytes(gzip.compress(raw, mtime=0) if path.name.endswith(".gz") else raw)
    return path


def real_texts(n: int) -> list[str]:
    docs = stdlib_documents()
    return [next(docs)["text"] for _ in range(n)]


def read_docs(prefix: Path) -> list[list[int]]:
    """Token ids per document (empty documents included) from a written pair."""
    ds = IndexedDataset(prefix)
    out = []
    for d in range(ds.num_documents):
        lo, hi = ds.document_indices[d], ds.document_indices[d + 1]
        out.append([t for s in range(lo, hi) for t in ds[s].tolist()])
    return out


def pair_bytes(prefix: Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.fixture(scope="module")
def big_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 10 MB of stdlib sources (three ingest batches), with a few empty documents."""
    texts = [d["text"] for d in stdlib_documents()]
    texts[5:5] = ["", ""]
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    lines, size = [], 0
    for i, t in enumerate(texts):
        lines.append(json.dumps({"text": t, "n": i}, ensure_ascii=False) + "\n")
        size += len(lines[-1])
        if size > 10_000_000:
            break
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.mark.parametrize(("fixture", "dtype_code"), [("gpt2_dir", 8), ("tekken_dir", 4)])
def test_parity_with_direct_tokenizer_loop(
    fixture: str, dtype_code: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    tok_dir = request.getfixturevalue(fixture)
    texts = [*EDGE_TEXTS, *real_texts(30)]
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    res = tokenize_files([src], tmp_path / "out", tok_dir, append_eod=True)
    expected, _ = expected_pair(tok_dir, texts, eod=True)
    prefix = dataset_prefix(tmp_path / "out")
    assert prefix == tmp_path / "out_text_document"
    assert res.prefix == prefix and res.engine == "gigatoken"
    assert read_docs(prefix) == expected
    lengths = [len(d) for d in expected if d]
    doc_index = np.concatenate([[0], np.cumsum([1 if d else 0 for d in expected])])
    idx = Path(f"{prefix}.idx").read_bytes()
    assert idx[17] == dtype_code
    assert idx == encode_index(IndexedDataset(prefix).dtype, lengths, doc_index)
    flat = np.array([t for d in expected for t in d], dtype=IndexedDataset(prefix).dtype)
    assert Path(f"{prefix}.bin").read_bytes() == flat.tobytes()
    assert (res.documents, res.empty_documents, res.sequences) == (len(texts), 2, len(lengths))
    assert res.tokens == flat.size


def test_without_eod_and_custom_text_key(gpt2_dir: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", EDGE_TEXTS, key="content")
    res = tokenize_files([src], tmp_path / "o", gpt2_dir, text_key="content")
    assert res.prefix == tmp_path / "o_content_document"
    assert read_docs(res.prefix) == expected_pair(gpt2_dir, EDGE_TEXTS, eod=False)[0]
    ds = IndexedDataset(res.prefix)
    assert ds.document_indices.tolist() == [0, 0, 1, 2, 3, 4, 4, 5]


def test_workers_give_identical_bytes(gpt2_dir: Path, big_jsonl: Path, tmp_path: Path) -> None:
    results = {
        w: tokenize_files([big_jsonl], tmp_path / f"w{w}", gpt2_dir, append_eod=True, workers=w)
        for w in (1, 2, 3)
    }
    first = pair_bytes(results[1].prefix)
    for w in (2, 3):
        assert pair_bytes(results[w].prefix) == first
        assert results[w].manifest["counts"] == results[1].manifest["counts"]
        assert results[w].manifest["content_hash"] == results[1].manifest["content_hash"]
    assert results[1].empty_documents == 2


def test_manifest_describes_the_run(gpt2_dir: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", EDGE_TEXTS)
    res = tokenize_files([src], tmp_path / "o", gpt2_dir, append_eod=True)
    manifest = read_dataset_manifest(res.prefix)
    assert manifest["kind"] == "tokens"
    config = manifest["config"]
    assert (config["dtype"], config["vocab_size"], config["eod_id"]) == ("uint16", 50257, 50256)
    assert (config["engine"], config["append_eod"], config["text_key"]) == (
        "gigatoken",
        True,
        "text",
    )
    assert len(config["tokenizer_fingerprint"]) == 64
    counts = manifest["counts"]
    assert counts == {
        "documents": 7,
        "sequences": 5,
        "tokens": res.tokens,
        "quarantined": 0,
        "blank": 0,
        "lines": 7,
        "empty_documents": 2,
    }
    (recorded,) = manifest["inputs"]
    assert recorded["uri"] == recorded["stats"]["path"] == str(src.resolve())
    assert (recorded["bytes"], recorded["sha256"]) == (src.stat().st_size, file_sha256(src))
    assert check_dataset_files(res.prefix, full=True) == []


def test_manifest_is_reproducible_and_names_inputs_as_told(gpt2_dir: Path, tmp_path: Path) -> None:
    """Same input bytes and config, another copy with another mtime: the same manifest bytes;
    ``input_uri`` names a local copy by where it came from."""
    manifests = []
    for copy in ("one", "two"):
        (tmp_path / copy).mkdir()
        src = write_jsonl(tmp_path / copy / "shard.jsonl", real_texts(4))
        os.utime(src, ns=(len(manifests) * 10**9, len(manifests) * 10**9))
        res = tokenize_files(
            [src],
            tmp_path / copy / "out",  # its own output: a second run into one would write nothing
            gpt2_dir,
            append_eod=True,
            input_uri=lambda path: f"s3://bucket/raw/{path.name}",
        )
        manifests.append(dataset_manifest_path(res.prefix).read_bytes())
    assert manifests[0] == manifests[1]
    (recorded,) = json.loads(manifests[0])["inputs"]
    assert recorded["uri"] == recorded["stats"]["path"] == "s3://bucket/raw/shard.jsonl"
    assert str(tmp_path) not in manifests[0].decode()


def test_folder_input_hash_covers_names_and_contents(gpt2_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "hf" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"text": real_texts(3)}), folder / "a.parquet")
    pq.write_table(pa.table({"text": real_texts(2)}), folder / "b.parquet")
    res = tokenize_files([folder], tmp_path / "o", gpt2_dir)
    (recorded,) = read_dataset_manifest(res.prefix)["inputs"]
    assert recorded["sha256"] == input_sha256(folder)
    sizes = (folder / "a.parquet").stat().st_size + (folder / "b.parquet").stat().st_size
    assert recorded["bytes"] == sizes
    (folder / "b.parquet").rename(folder / "c.parquet")
    assert input_sha256(folder) != recorded["sha256"]  # a renamed file changes the hash


def test_several_inputs_and_formats_concatenate_in_order(gpt2_dir: Path, tmp_path: Path) -> None:
    a, b = real_texts(5), [*EDGE_TEXTS, *real_texts(3)]
    whole = tokenize_files([write_jsonl(tmp_path / "ab.jsonl", a + b)], tmp_path / "ab", gpt2_dir)
    gz = write_jsonl(tmp_path / "b.jsonl.gz", b)
    pq.write_table(pa.table({"text": a}), tmp_path / "a.parquet")
    parts = tokenize_files([tmp_path / "a.parquet", gz], tmp_path / "parts", gpt2_dir)
    assert pair_bytes(parts.prefix) == pair_bytes(whole.prefix)
    assert parts.documents == len(a) + len(b)


def test_bad_record_fails_and_leaves_nothing(gpt2_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": oops}\n{"text": "later"}\n')
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BadRecordError, match=r"in\.jsonl:3: invalid JSON"):
        tokenize_files([src], out / "p", gpt2_dir, append_eod=True)
    assert [p.relative_to(out).as_posix() for p in out.rglob("*")] == [".tmp"]  # empty: no temp


def test_quarantine_keeps_the_good_documents(gpt2_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\n\n{"text": 5}\n{"text": "later"}\n')
    res = tokenize_files([src], tmp_path / "q", gpt2_dir, on_bad_record="quarantine")
    clean = tokenize_files(
        [write_jsonl(tmp_path / "c.jsonl", ["ok", "later"])], tmp_path / "c", gpt2_dir
    )
    assert pair_bytes(res.prefix) == pair_bytes(clean.prefix)
    assert (res.quarantined, res.blank, res.lines, res.documents) == (1, 1, 4, 2)
    lines = (tmp_path / "q.quarantine.jsonl").read_text().splitlines()
    assert [json.loads(x)["line"] for x in lines] == [3]
    assert json.loads(lines[0])["reason"] == "text is not a string (found int)"


def test_argument_errors(gpt2_dir: Path, tiny_dir: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", ["x"])
    with pytest.raises(ConfigError, match="no input files"):
        tokenize_files([], tmp_path / "o", gpt2_dir)
    with pytest.raises(ConfigError, match="on_bad_record='skip'"):
        tokenize_files([src], tmp_path / "o", gpt2_dir, on_bad_record="skip")
    with pytest.raises(ConfigError, match="workers=0"):
        tokenize_files([src], tmp_path / "o", gpt2_dir, workers=0)


def test_text_key_must_be_one_file_name_part(
    gpt2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The text key names the output files: one that would put them elsewhere is refused by the
    API and the CLI (exit 2) before anything is written; other JSON keys name files as they are."""
    bad = "x/../../evil"
    src = write_jsonl(tmp_path / "in.jsonl", ["x"], key=bad)
    message = (
        f"text_key {bad!r} contains a slash or backslash; it is part of the file names "
        "<prefix>_<text_key>_document.*, so it must be one file-name part"
    )
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError) as err:
        tokenize_files([src], tmp_path / "out" / "o", gpt2_dir, text_key=bad)
    assert str(err.value) == message
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "out" / "o")]
    assert main(["tokenize", *argv, "--tokenizer", str(gpt2_dir), "--text-key", bad]) == 2
    assert capsys.readouterr().err == f"tokenmill tokenize: error: {message}\n"
    assert sorted(tmp_path.rglob("*")) == before
    for key, problem in [("..", "is '..'"), ("a\\b", "contains a slash or backslash"),
                         ("nul\0", "contains a control character"), ("", "is empty")]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(f"text_key {key!r} {problem}; ")):
            dataset_prefix(tmp_path / "o", key)
    fine = "body text.é"
    res = tokenize_files([write_jsonl(tmp_path / "ok.jsonl", ["x"], key=fine)], tmp_path / "o",
                         gpt2_dir, text_key=fine)  # fmt: skip
    assert res.prefix == tmp_path / f"o_{fine}_document" and res.documents == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_engine_mismatch_on_input_falls_back(
    workers: int, gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corrupt_gigatoken(monkeypatch, tmp_path / "cache", lambda t: "MAGIC" in t[:SAMPLE_CHARS])
    texts = ["fine", "a MAGIC word", "after"]
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    res = tokenize_files([src], tmp_path / "o", gpt2_dir, workers=workers)
    assert res.engine == "tiktoken"
    assert res.fallbacks[0].startswith(f"gigatoken: {tmp_path / 'in.jsonl'} document 2: ")
    assert read_docs(res.prefix) == expected_pair(gpt2_dir, texts, eod=False)[0]
    assert res.manifest["config"]["engine"] == "tiktoken"


def test_nfkc_tokenizer_with_bos(tiny_dir: Path, tmp_path: Path) -> None:
    texts = [*EDGE_TEXTS, "ﬁne ｆｕｌｌ width ①"]
    res = tokenize_files(
        [write_jsonl(tmp_path / "in.jsonl", texts)], tmp_path / "o", tiny_dir, append_eod=True
    )
    expected, tok = expected_pair(tiny_dir, texts, eod=True)
    assert res.engine == "gigatoken"  # unicodedata NFKC + the normalizer-free copy
    assert all(d[0] == tok.bos_token_id for d in expected)
    assert read_docs(res.prefix) == expected
    assert res.sequences == len(texts)


@pytest.mark.parametrize(("vocab", "dtype_code"), [(65499, 8), (65500, 4)])
def test_vocab_boundary_picks_megatron_dtype(vocab: int, dtype_code: int, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "wl"
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>"
    ).save_pretrained(str(tok_dir))
    texts = [f"w{vocab - 1} w2 nope", "", "w65498"]
    res = tokenize_files(
        [write_jsonl(tmp_path / "in.jsonl", texts)], tmp_path / "o", tok_dir, append_eod=True
    )
    assert res.manifest["config"]["vocab_size"] == vocab
    assert Path(f"{res.prefix}.idx").read_bytes()[17] == dtype_code
    assert read_docs(res.prefix) == [[vocab - 1, 2, 0, 1], [], [65498, 1]]


def _run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tokenmill.cli", "tokenize", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def test_cli_summary_and_bad_record_exit(gpt2_dir: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", ["a", "b"])
    ok = _run_cli(
        ["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer", str(gpt2_dir)]
    )
    assert ok.returncode == 0, ok.stderr
    assert "2 documents, 2 tokens, 0 quarantined, engine gigatoken" in ok.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"txt": "b"}\n')
    res = _run_cli(
        ["--input", str(bad), "--output-prefix", str(tmp_path / "b"), "--tokenizer", str(gpt2_dir)]
    )
    assert res.returncode == 1
    assert f"{bad}:2: missing text key 'text'" in res.stderr
    assert not list(tmp_path.glob("b_*"))


def test_sigkill_leaves_nothing_final_and_rerun_is_identical(
    gpt2_dir: Path, big_jsonl: Path, tmp_path: Path
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(big_jsonl.read_bytes() * 3)
    args = ["--input", str(src), "--tokenizer", str(gpt2_dir), "--append-eod", "--workers", "2"]
    out = tmp_path / "run"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli",
        "tokenize",
        *args,
        "--output-prefix",
        str(out / "p"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size for p in out.glob(".tmp/*/.tmp/p_text_document.bin.tmp-*")):
        assert proc.poll() is None and time.monotonic() < deadline, "finished before it was killed"
        time.sleep(0.005)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert children
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []
    names = {p.name for p in out.iterdir()}
    assert not names & {
        "p_text_document.bin",
        "p_text_document.idx",
        "p_text_document.manifest.json",
    }
    assert not (out / "manifests" / "p_text_document.manifest.json").exists()
    assert any(".tmp-" in n for n in os.listdir(out / ".tmp"))  # the killed writer's temp
    assert _run_cli([*args, "--output-prefix", str(out / "p")]).returncode == 0
    assert _run_cli([*args, "--output-prefix", str(tmp_path / "clean")]).returncode == 0
    assert pair_bytes(out / "p_text_document") == pair_bytes(tmp_path / "clean_text_document")
    assert not [n for n in os.listdir(out) + os.listdir(out / ".tmp") if ".tmp-" in n]


def _stamps(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every file and folder below ``folder``: (inode, size, mtime in ns); a ``.tmp/`` folder by
    its entries alone (the run's lock file comes and goes there)."""
    return {
        p.relative_to(folder).as_posix(): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.name != ".tmp"
    }


def test_a_rerun_of_an_up_to_date_output_touches_nothing(gpt2_dir: Path, tmp_path: Path) -> None:
    """Same inputs and settings as the manifest records, the pair at its sizes and sha256s: the
    run writes nothing (no inode, size or mtime changes) and reports the recorded counts.
    Another input or setting, or a damaged pair, is written anew."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\n{"text": 5}\n{"text": "later on"}\n')
    out = tmp_path / "out"
    kwargs: dict[str, Any] = {"append_eod": True, "on_bad_record": "quarantine"}
    first = tokenize_files([src], out / "p", gpt2_dir, **kwargs)
    before = _stamps(tmp_path)
    again = tokenize_files([src], out / "p", gpt2_dir, **kwargs)
    assert _stamps(tmp_path) == before
    assert (again.reused, first.reused) == (True, False)
    assert again.manifest == first.manifest and again.quarantine_path == first.quarantine_path
    assert (again.documents, again.tokens, again.quarantined) == (2, first.tokens, 1)
    cli = ["--input", str(src), "--output-prefix", str(out / "p"), "--tokenizer", str(gpt2_dir)]
    done = _run_cli([*cli, "--append-eod", "--on-bad-record", "quarantine"])
    assert done.returncode == 0 and "up to date" in done.stdout and _stamps(tmp_path) == before
    plain = tokenize_files([src], out / "p", gpt2_dir, on_bad_record="quarantine")  # no EOD
    assert not plain.reused and plain.tokens == first.tokens - 2
    src.write_text('{"text": "ok"}\n{"text": "later on"}\n')
    fixed = tokenize_files([src], out / "p", gpt2_dir, append_eod=True)
    assert not fixed.reused and fixed.quarantine_path is None
    assert pair_bytes(fixed.prefix) == pair_bytes(first.prefix)
    assert not (out / "p.quarantine.jsonl").exists()
    data = Path(f"{fixed.prefix}.bin")
    data.write_bytes(bytes([data.read_bytes()[0] ^ 1]) + data.read_bytes()[1:])  # same size
    repaired = tokenize_files([src], out / "p", gpt2_dir, append_eod=True)
    assert not repaired.reused and pair_bytes(repaired.prefix) == pair_bytes(first.prefix)


def test_up_to_date_outputs_need_no_verification(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with a tokenizer not verified in this cache keeps outputs whose manifest names
    the tokenizer's fingerprint and the installed library versions, and verifies nothing; with
    other libraries recorded, or other settings, it verifies first. The settings it takes from
    the manifest are exactly those a verified run compares."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\n{"text": "later on"}\n')
    first = tokenize_files([src], tmp_path / "p", gpt2_dir, append_eod=True)
    info = load_tokenizer(gpt2_dir).info
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "empty-cache"))
    recorded = run_module._recorded_settings(first_outputs(first), gpt2_dir, "text", True)
    assert recorded == outputs_module.byte_settings(info, "text", True)
    verified: list[Path] = []
    monkeypatch.setattr(tokenizer_module, "run_verification", lambda *a: verified.append(a[0]))
    again = tokenize_files([src], tmp_path / "p", gpt2_dir, append_eod=True)
    assert again.reused and again.manifest == first.manifest and verified == []
    with pytest.raises(TokenmillError, match="verification wrote no record"):
        tokenize_files([src], tmp_path / "p", gpt2_dir)  # no EOD: another setting
    assert verified == [gpt2_dir]
    versions = {**tokenizer_module._library_versions(), "transformers": "0.0"}
    monkeypatch.setattr(run_module, "_library_versions", lambda: versions)
    with pytest.raises(TokenmillError, match="verification wrote no record"):
        tokenize_files([src], tmp_path / "p", gpt2_dir, append_eod=True)
    assert verified == [gpt2_dir, gpt2_dir]


def test_a_damaged_pair_is_checked_once_around_a_first_use_verification(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with a tokenizer not verified in this cache checks outputs its manifest's
    settings describe before verifying; found damaged, they are not hashed again with the
    verified settings (the same ones), only by the commit (which looks for another run's
    pair), and the run rewrites the pair."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\n{"text": "later on"}\n')
    first = tokenize_files([src], tmp_path / "p", gpt2_dir, append_eod=True)
    expected = pair_bytes(first.prefix)
    bin_path = Path(f"{first.prefix}.bin")
    damaged = bytearray(bin_path.read_bytes())
    damaged[0] ^= 0xFF
    bin_path.write_bytes(bytes(damaged))
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "empty-cache"))
    checks: list[Path] = []
    real = outputs_module.file_problems

    def counted(prefix: Path, *args: Any, **kwargs: Any) -> Any:
        checks.append(prefix)
        return real(prefix, *args, **kwargs)

    monkeypatch.setattr(outputs_module, "file_problems", counted)
    again = tokenize_files([src], tmp_path / "p", gpt2_dir, append_eod=True)
    assert not again.reused and pair_bytes(again.prefix) == expected
    assert checks.count(first.prefix) == 2  # before the verification, and by the commit


def test_edited_tokenizer_facts_in_a_manifest_are_not_taken_as_up_to_date(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest whose recorded vocab_size, dtype or eod_id was edited is not up to date:
    with the tokenizer's record cached, its facts are compared (the run rewrites the pair and
    a correct manifest); without it, facts that do not hold together send the run to verify."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\n{"text": "later on"}\n')
    first = tokenize_files([src], tmp_path / "p", gpt2_dir, append_eod=True)
    path = dataset_manifest_path(first.prefix)

    def edit(**changes: Any) -> None:
        manifest = json.loads(path.read_bytes())
        manifest["config"].update(changes)
        path.write_text(json.dumps(manifest))

    edit(vocab_size=50258)  # still uint16: only the verified facts tell
    again = tokenize_files([src], tmp_path / "p", gpt2_dir, append_eod=True)
    assert not again.reused and again.manifest == first.manifest
    assert pair_bytes(again.prefix) == pair_bytes(first.prefix)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tokenizer_module, "run_verification", lambda *a: None)
    for changes in ({"dtype": "int32"}, {"vocab_size": "50257"}, {"eod_id": None}):
        path.write_bytes(json.dumps(first.manifest).encode())
        edit(**changes)
        with pytest.raises(TokenmillError, match="verification wrote no record"):
            tokenize_files([src], tmp_path / "p", gpt2_dir, append_eod=True)


def first_outputs(result: Any) -> outputs_module.Outputs:
    """The ``Outputs`` of a run's prefix (its manifest beside the pair)."""
    return outputs_module.Outputs(result.prefix, Path(f"{result.prefix}.quarantine.jsonl"))


@pytest.mark.parametrize("count", ["tokens", "empty_documents"])
def test_a_manifest_missing_a_count_is_rewritten(
    gpt2_dir: Path, tmp_path: Path, count: str
) -> None:
    """A hand-edited manifest whose ``counts`` lacks a key (its pair intact) is not up to date:
    the run tokenizes anew and rewrites a correct pair and manifest, instead of a KeyError."""
    src = write_jsonl(tmp_path / "in.jsonl", real_texts(5))
    first = tokenize_files([src], tmp_path / "p", gpt2_dir, append_eod=True)
    path = dataset_manifest_path(first.prefix)
    edited = json.loads(path.read_bytes())
    del edited["counts"][count]
    path.write_text(json.dumps(edited))
    again = tokenize_files([src], tmp_path / "p", gpt2_dir, append_eod=True)
    assert not again.reused and (again.documents, again.tokens) == (5, first.tokens)
    assert read_dataset_manifest(first.prefix)["counts"] == first.manifest["counts"]
    assert check_dataset_files(first.prefix, full=True) == []
    assert pair_bytes(again.prefix) == pair_bytes(first.prefix)


def test_commit_never_leaves_a_manifest_without_its_pair(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rewriting an output renames each new file over the old one, manifest last. With the same
    content (here: the inputs named by another uri) the old manifest stays until the new one
    replaces it; with other content it goes before the first data file is replaced."""
    src = write_jsonl(tmp_path / "in.jsonl", real_texts(5))
    prefix = tokenize_files([src], tmp_path / "p", gpt2_dir).prefix
    manifest = dataset_manifest_path(prefix)
    seen: list[tuple[str, str | None]] = []
    real = outputs_module.commit

    def watched(tmp: Any, final: Any) -> None:
        found = json.loads(manifest.read_bytes())["content_hash"] if manifest.is_file() else None
        seen.append((Path(final).name, found))
        real(tmp, final)

    monkeypatch.setattr(outputs_module, "commit", watched)
    old = read_dataset_manifest(prefix)["content_hash"]
    tokenize_files([src], tmp_path / "p", gpt2_dir, input_uri=lambda _: "s3://b/in.jsonl")
    names = ["p_text_document.bin", "p_text_document.idx", "p_text_document.manifest.json"]
    assert seen == [(name, old) for name in names]
    seen.clear()
    changed = tokenize_files([write_jsonl(src, real_texts(6))], tmp_path / "p", gpt2_dir)
    assert seen == [(name, None) for name in names]
    assert check_dataset_files(changed.prefix, full=True) == []


def test_a_manifest_removed_before_its_pair_changes_is_fsynced_first(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest lives in ``manifests/``, the pair one folder up: the renames' fsyncs of the
    pair's folder do not make the manifest's removal durable. Its folder is fsynced right after
    the removal, before a pair file is replaced (a rewrite) or removed (a failed run's clear),
    else a crash could leave the old manifest describing other bytes."""
    src = write_jsonl(tmp_path / "in.jsonl", real_texts(5))
    prefix = tokenize_files([src], tmp_path / "p", gpt2_dir).prefix
    manifests = dataset_manifest_path(prefix).parent
    events: list[str] = []
    real_commit, real_unlink = outputs_module.commit, Path.unlink

    def watched_commit(tmp: Any, final: Any) -> None:
        events.append(f"replace {Path(final).name}")
        real_commit(tmp, final)

    def watched_unlink(path: Path, missing_ok: bool = False) -> None:
        if path.parent in (manifests, prefix.parent) and path.name.startswith("p_"):
            events.append(f"unlink {path.name}")
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(outputs_module, "commit", watched_commit)
    monkeypatch.setattr(
        outputs_module, "fsync_dir", lambda d: events.append(f"fsync {d}"), raising=False
    )
    monkeypatch.setattr(Path, "unlink", watched_unlink)
    tokenize_files([write_jsonl(src, real_texts(6))], tmp_path / "p", gpt2_dir)
    assert events[:3] == [
        "unlink p_text_document.manifest.json",
        f"fsync {manifests}",
        "replace p_text_document.bin",
    ]
    events.clear()
    outputs_module.Outputs(prefix, tmp_path / "p.quarantine.jsonl").clear()
    assert events[:3] == [
        "unlink p_text_document.manifest.json",
        f"fsync {manifests}",
        "unlink p_text_document.idx",
    ]


def test_a_failed_run_removes_the_stale_pair_it_found_but_never_anothers(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that fails leaves no pair of other inputs to pass for its own; but a pair another
    run committed while it worked (that run's complete result) stays."""
    old = write_jsonl(tmp_path / "old.jsonl", ["old one", "old two"])
    new = write_jsonl(tmp_path / "new.jsonl", ["new one"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    prefix = tokenize_files([old], tmp_path / "p", gpt2_dir).prefix
    with pytest.raises(BadRecordError):
        tokenize_files([bad], tmp_path / "p", gpt2_dir)
    assert sorted(p.name for p in tmp_path.rglob("p_*")) == []
    tokenize_files([old], tmp_path / "p", gpt2_dir)
    real, other = run_module._attempts, []

    def another_run_commits_meanwhile(*args: Any) -> Any:
        if other:  # the other run's own attempt
            return real(*args)
        other.append(None)
        other[0] = tokenize_files([new], tmp_path / "p", gpt2_dir)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_module, "_attempts", another_run_commits_meanwhile)
    with pytest.raises(OSError, match="No space left"):
        tokenize_files([bad], tmp_path / "p", gpt2_dir)
    assert read_dataset_manifest(prefix) == other[0].manifest
    assert check_dataset_files(prefix, full=True) == [] and read_docs(prefix) == [[3605, 530]]


def test_concurrent_runs_of_one_output_never_take_the_pair_from_a_reader(
    gpt2_dir: Path, big_jsonl: Path, tmp_path: Path
) -> None:
    """Two processes tokenize one output at once (a sensor's run and ``materialize``'s) while a
    reader keeps opening it: the reader always finds a complete pair with the first run's
    content, and the end result is a single run's bytes. (Runs that cleared the output at their
    start left readers a gap: "its token pair is gone".)"""
    copies = []
    for name in ("a", "b", "c"):  # the same bytes at other paths: other uris, so both rewrite
        copies.append(tmp_path / f"{name}.jsonl")
        shutil.copyfile(big_jsonl, copies[-1])
    out = tmp_path / "out"
    first = tokenize_files([copies[0]], out / "p", gpt2_dir, append_eod=True)
    expected, content = pair_bytes(first.prefix), first.manifest["content_hash"]
    cmd = [sys.executable, "-m", "tokenmill.cli", "tokenize", "--tokenizer", str(gpt2_dir)]
    procs = [
        subprocess.Popen(
            [*cmd, "--input", str(src), "--output-prefix", str(out / "p"), "--append-eod"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for src in copies[1:]
    ]
    errors, reads = [], 0
    while any(proc.poll() is None for proc in procs):
        try:
            manifest = read_dataset_manifest(first.prefix)
            if manifest["content_hash"] != content:
                errors.append(f"content changed: {manifest['content_hash']}")
            errors += file_problems(first.prefix, manifest, full=False)
            with open_dataset(first.prefix) as ds:
                reads += len(ds) > 0
        except (OSError, TokenmillError) as exc:
            errors.append(repr(exc))
        time.sleep(0.001)
    assert [proc.wait() for proc in procs] == [0, 0], [p.stderr.read() for p in procs if p.stderr]
    assert errors == [] and reads > 0
    assert pair_bytes(first.prefix) == expected
    assert check_dataset_files(first.prefix, full=True) == []
    assert read_dataset_manifest(first.prefix)["inputs"][0]["uri"] in {
        str(copies[1]), str(copies[2])
    }  # fmt: skip
    assert not [n for n in os.listdir(out) + os.listdir(out / ".tmp") if ".tmp-" in n]
    for proc in procs:
        if proc.stderr is not None:
            proc.stderr.close()


def test_ids_beyond_the_dtype_are_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "big": 70000}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "holes"
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(tok_dir))
    src = write_jsonl(tmp_path / "in.jsonl", ["big"])
    with pytest.raises(TokenmillError, match="id 70000 does not fit uint16"):
        tokenize_files([src], tmp_path / "o", tok_dir)
    assert not list(tmp_path.glob("o*"))


def test_cli_throughput_never_rounds_a_small_input_to_zero() -> None:
    from tokenmill.commands import throughput

    assert throughput(30_000, 0.1) == "0.3 MB/s"
    assert throughput(12_345_678, 1.0) == "12.3 MB/s"
    assert throughput(2_500_000_000, 2.0) == "1250 MB/s"


def _outputs(prefix: Path) -> list[bytes]:
    """A run's ``.bin``, ``.idx`` and manifest bytes."""
    paths = [Path(f"{prefix}.bin"), Path(f"{prefix}.idx"), dataset_manifest_path(prefix)]
    return [p.read_bytes() for p in paths]


def test_session_loads_once_and_writes_what_lone_calls_write(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forks: list[object] = []

    class Counted(run_module.Checker):
        def __init__(self, info: Any) -> None:
            forks.append(info)
            super().__init__(info)

    monkeypatch.setattr(run_module, "Checker", Counted)
    inputs = [write_jsonl(tmp_path / f"in{i}.jsonl", [*EDGE_TEXTS, f"doc {i}"]) for i in range(3)]
    lone = [tokenize_files([p], tmp_path / "lone" / p.stem, gpt2_dir) for p in inputs]
    assert len(forks) == 3
    forks.clear()
    with TokenizeSession() as session:
        shared = [
            tokenize_files([p], tmp_path / "shared" / p.stem, gpt2_dir, session=session)
            for p in inputs
        ]
    assert len(forks) == 1  # one checker process served the three runs
    for a, b in zip(lone, shared, strict=True):
        assert _outputs(a.prefix) == _outputs(b.prefix)  # manifests too: counts are per run
        guard = b.manifest["config"]["verification"]["guard"]
        assert guard["routed_documents"]["special_token"] == 1


def test_a_reused_encoder_counts_each_run_alone(gpt2_dir: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", EDGE_TEXTS)
    encoder = load_tokenizer(gpt2_dir)
    first = tokenize_files([src], tmp_path / "a" / "o", encoder)
    second = tokenize_files([src], tmp_path / "b" / "o", encoder)
    assert _outputs(first.prefix) == _outputs(second.prefix)


def test_session_replaces_its_checker_after_a_mismatch_or_a_failure(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corrupt_gigatoken(monkeypatch, tmp_path / "cache")
    magic = write_jsonl(tmp_path / "magic.jsonl", ["fine", "a MAGIC word"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    good = write_jsonl(tmp_path / "good.jsonl", ["after", "more"])
    with TokenizeSession() as session:
        res = tokenize_files([magic], tmp_path / "m", gpt2_dir, session=session)
        assert res.engine == "tiktoken" and res.fallbacks[0].startswith("gigatoken: ")
        with pytest.raises(BadRecordError):
            tokenize_files([bad], tmp_path / "x", gpt2_dir, session=session)
        after = tokenize_files([good], tmp_path / "g", gpt2_dir, session=session)
    assert read_docs(res.prefix) == expected_pair(gpt2_dir, ["fine", "a MAGIC word"], False)[0]
    assert read_docs(after.prefix) == expected_pair(gpt2_dir, ["after", "more"], eod=False)[0]
