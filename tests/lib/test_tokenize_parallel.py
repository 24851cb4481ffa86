"""Process-parallel `tokenmill tokenize`: the same bytes for any worker count, split and engine;
quarantine keeps the inputs' real line numbers; a killed worker leaves nothing final."""

from __future__ import annotations

import base64
import gzip
import itertools
import json
import os
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
from _helpers import corrupt_gigatoken
from pipeline_project import tokenizer_dir
from test_tokenize import expected_pair, pair_bytes, read_docs, real_texts
from test_tokenizer_normalized import ORDINARY, TRICKY, megatron_tokens

from tokenmill.errors import BadRecordError
from tokenmill.formats.dataset_manifest import dataset_manifest_path
from tokenmill.tokenize import parallel
from tokenmill.tokenize.run import tokenize_files
from tokenmill.tokenize.tokenizer import load_tokenizer
from tokenmill_dev.bundled import build_bundled_tokenizer

WORKERS = (1, 2, 3, 5)
RANGE = 3000  # bytes per range in these tests: many ranges per file


@pytest.fixture
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "MIN_RANGE_BYTES", RANGE)
    monkeypatch.setattr(parallel, "MAX_RANGE_BYTES", RANGE)


def _line(text: str, n: int) -> bytes:
    return (json.dumps({"text": text, "n": n}, ensure_ascii=False) + "\n").encode()


def _inputs(folder: Path) -> tuple[list[Path], dict[int, str]]:
    """A multi-range file with bad, blank and CRLF lines (and the real line number of each bad
    line), a .gz input, an empty one, one with a BOM and no final newline, and a Parquet file."""
    texts = real_texts(12)
    lines: list[bytes] = []
    bad: dict[int, str] = {}
    for i in range(60):
        text = texts[i % len(texts)][: 200 + 37 * i]
        lines.append(_line(text, i))
        if i % 9 == 4:
            lines.append(b'{"txt": "no text key"}\n')
            bad[len(lines)] = "missing text key 'text'"
        if i % 11 == 6:
            lines.append(b"   \n")
        if i % 13 == 7:
            lines.append(_line("crlf line", i)[:-1] + b"\r\n")
        if i % 17 == 3:
            lines.append(b'{"text": 5}\n')
            bad[len(lines)] = "text is not a string (found int)"
    lines.append(_line("", 99))
    big = folder / "big.jsonl"
    big.write_bytes(b"".join(lines))
    gz = folder / "mid.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(_line(t[:500], n) for n, t in enumerate(texts)), mtime=0))
    empty = folder / "empty.jsonl"
    empty.write_bytes(b"")
    tail = folder / "tail.jsonl"
    tail.write_bytes(
        b"\xef\xbb\xbf" + _line("bom first", 0) + _line("no newline at the end", 1)[:-1]
    )
    table = folder / "last.parquet"
    pq.write_table(pa.table({"text": [t[:300] for t in texts[:5]]}), table)
    return [big, gz, empty, tail, table], bad


def _run(inputs: list[Path], out: Path, tokenizer: Any, workers: int, **kw: Any) -> Any:
    return tokenize_files(inputs, out / "p", tokenizer, append_eod=True, workers=workers, **kw)


def _outputs(result: Any) -> tuple[bytes, bytes, bytes]:
    bin_, idx = pair_bytes(result.prefix)
    return bin_, idx, dataset_manifest_path(result.prefix).read_bytes()


def test_plan_cuts_plain_files_on_line_boundaries(small_ranges: None, tmp_path: Path) -> None:
    inputs, _ = _inputs(tmp_path)
    ranges = parallel.plan_ranges(inputs, 3)
    big = inputs[0].read_bytes()
    spans = [r.byte_range for r in ranges if r.index == 0]
    assert len(spans) > 5
    assert spans[0] is not None and spans[0][0] == 0 and spans[-1] == (spans[-1][0], len(big))
    for (_, end), (start, _) in itertools.pairwise(spans):  # type: ignore[misc]
        assert end == start and big[end - 1 : end] == b"\n"
    assert [r.byte_range for r in ranges if r.index == 1] == [None]  # .gz: one worker
    assert [r.byte_range for r in ranges if r.index == 2] == [(0, 0)]
    assert [r.byte_range for r in ranges if r.index == 4] == [None]  # Parquet: one worker
    order = parallel.schedule(ranges)
    assert {ranges[i].index for i in order[:2]} == {1, 4}  # whole inputs are taken first
    assert order[2:] == sorted(order[2:]) and sorted(order) == list(range(len(ranges)))


def test_any_worker_count_gives_identical_bytes_and_quarantine(
    small_ranges: None, gpt2_dir: Path, tmp_path: Path
) -> None:
    inputs, bad = _inputs(tmp_path)
    results = {
        w: _run(inputs, tmp_path / f"w{w}", gpt2_dir, w, on_bad_record="quarantine")
        for w in WORKERS
    }
    first = results[1]
    for w in WORKERS[1:]:
        assert _outputs(results[w]) == _outputs(first), w
        assert results[w].quarantine_path is not None
        assert results[w].quarantine_path.read_bytes() == first.quarantine_path.read_bytes()
        assert results[w].manifest == first.manifest
    records = [json.loads(line) for line in first.quarantine_path.read_text().splitlines()]
    assert {r["line"]: r["reason"] for r in records} == bad  # the input's real line numbers
    lines = inputs[0].read_bytes().split(b"\n")
    assert all(base64.b64decode(r["raw_b64"]) == lines[r["line"] - 1] for r in records)
    stats = [i["stats"] for i in first.manifest["inputs"]]
    assert stats[0]["quarantined"] == len(bad) and stats[0]["crlf_lines"] == 5
    counted = sum(stats[0][k] for k in ("documents", "quarantined", "blank"))
    assert stats[0]["lines"] == len(lines) - 1 == counted
    assert stats[3]["bom"] and stats[3]["missing_final_newline"]
    assert not stats[0]["bom"] and not stats[0]["missing_final_newline"]
    assert stats[2]["lines"] == 0


def test_whole_equals_its_parts_concatenated(
    small_ranges: None, gpt2_dir: Path, tmp_path: Path
) -> None:
    """One run over two files is the two single-file runs' .bin back to back."""
    inputs, _ = _inputs(tmp_path)
    both = _run([inputs[1], inputs[3]], tmp_path / "both", gpt2_dir, 3)
    parts = [_run([p], tmp_path / f"alone-{p.name}", gpt2_dir, 2) for p in (inputs[1], inputs[3])]
    assert pair_bytes(both.prefix)[0] == b"".join(pair_bytes(r.prefix)[0] for r in parts)


def test_fail_mode_names_the_real_line_of_a_late_range(
    small_ranges: None, gpt2_dir: Path, tmp_path: Path
) -> None:
    inputs, bad = _inputs(tmp_path)
    with pytest.raises(BadRecordError) as err:
        _run(inputs, tmp_path / "o", gpt2_dir, 3)
    first = min(bad)
    assert str(err.value) == f"{inputs[0]}:{first}: {bad[first]}"
    late = tmp_path / "late.jsonl"
    good = b"".join(_line(t, n) for n, t in enumerate(real_texts(40)))
    late.write_bytes(good + b"[1, 2]\n" + _line("after", 0))
    line = len(good.splitlines()) + 1
    with pytest.raises(BadRecordError, match=rf":{line}: line is not a JSON object"):
        _run([late], tmp_path / "o", gpt2_dir, 5)
    assert not [p for p in (tmp_path / "o").rglob("*") if p.is_file()]


@pytest.fixture(scope="module")
def family_dirs(gpt2_dir: Path, tiny_dir: Path) -> dict[str, Path]:
    """One tokenizer per family the tests have: byte-level, NFKC+BOS, NFC, SentencePiece+BOS."""
    return {
        "gpt2": gpt2_dir,
        "tiny-nfkc-bos": tiny_dir,
        "qwen2-nfc": build_bundled_tokenizer("qwen2", tokenizer_dir("qwen2")),
        "llama2-sentencepiece-bos": build_bundled_tokenizer("llama2", tokenizer_dir("llama2")),
    }


@pytest.mark.parametrize(
    "family", ["gpt2", "tiny-nfkc-bos", "qwen2-nfc", "llama2-sentencepiece-bos"]
)
def test_every_tokenizer_family_is_identical_at_every_worker_count(
    family: str, family_dirs: dict[str, Path], small_ranges: None, tmp_path: Path
) -> None:
    path = family_dirs[family]
    texts = [*ORDINARY, *TRICKY[:3], *ORDINARY[:30], *TRICKY[5:]]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(_line(t, n) for n, t in enumerate(texts)))
    results = {w: _run([src], tmp_path / f"w{w}", path, w) for w in WORKERS}
    assert len(parallel.plan_ranges([src], 5)) > 5
    for w in WORKERS[1:]:
        assert _outputs(results[w]) == _outputs(results[1]), w
    got = np.fromfile(f"{results[5].prefix}.bin", dtype=results[5].manifest["config"]["dtype"])
    assert got.tolist() == megatron_tokens(path, texts)


def test_every_engine_gives_the_same_bytes_in_parallel(
    small_ranges: None, gpt2_dir: Path, tmp_path: Path
) -> None:
    inputs, _ = _inputs(tmp_path)
    engines = {e: load_tokenizer(gpt2_dir, engine=e) for e in ("gigatoken", "tiktoken", "hf")}
    runs = [
        _run(inputs, tmp_path / f"{name}{w}", encoder, w, on_bad_record="quarantine")
        for name, encoder in engines.items()
        for w in (1, 3)
    ]
    assert {r.engine for r in runs} == {"gigatoken", "tiktoken", "hf"}
    assert len({pair_bytes(r.prefix) for r in runs}) == 1


def test_engine_mismatch_in_a_worker_falls_back(
    small_ranges: None, gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sample the parent checks comes from the worker of the input's first range."""
    corrupt_gigatoken(monkeypatch, tmp_path / "cache")
    texts = ["fine", "a MAGIC word", *real_texts(20)]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(_line(t, n) for n, t in enumerate(texts)))
    res = tokenize_files([src], tmp_path / "o", gpt2_dir, workers=3)
    assert res.engine == "tiktoken" and res.fallbacks[0].startswith(f"gigatoken: {src} document 2")
    assert read_docs(res.prefix) == expected_pair(gpt2_dir, texts, eod=False)[0]


def test_the_checked_sample_spans_a_first_range_s_read_batches(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reads its range in small batches; the input's checked sample is still its first
    SAMPLE_DOCS documents, so a mismatch on document 41 (a later batch) is caught."""
    corrupt_gigatoken(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(parallel, "BATCH_BYTES", 1500)
    for bound in ("MIN_RANGE_BYTES", "MAX_RANGE_BYTES"):
        monkeypatch.setattr(parallel, bound, 8000)  # two ranges, document 41 in the first
    texts = [t[:150] for t in real_texts(60)]
    texts[40] = "a MAGIC word"
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(_line(t, n) for n, t in enumerate(texts)))
    assert len(src.read_bytes()[:8000].splitlines()) > 41 and src.stat().st_size > 8000
    res = tokenize_files([src], tmp_path / "o", gpt2_dir, workers=2)
    assert res.engine == "tiktoken" and res.fallbacks[0].startswith(f"gigatoken: {src} document 41")
    assert read_docs(res.prefix) == expected_pair(gpt2_dir, texts, eod=False)[0]


def test_killed_worker_fails_the_run_and_leaves_nothing(gpt2_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    text = b"".join(_line(t, n) for n, t in enumerate(real_texts(400)))
    src.write_bytes(text * max(1, (24 << 20) // len(text)))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tokenmill.cli", "tokenize", "--input", str(src), "--tokenizer",
           str(gpt2_dir), "--workers", "2", "--output-prefix", str(out / "p")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    victim = None
    while victim is None:
        assert proc.poll() is None and time.monotonic() < deadline, "finished before the kill"
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if any(".bin.tmp-" in f.path for f in child.open_files()):
                    victim = child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert f"worker process {victim.pid} died" in err
    assert sorted(p.name for p in out.iterdir()) == [".tmp"]
    assert os.listdir(out / ".tmp") == []
