"""``tokenmill.tokenize._batching``: batches encoded through padded and one-by-one calls give
exactly the per-text ids in order; gigatoken's paths (text by text, padded, its thread pool)
agree with the reference engine, and the text-by-text path imports no awkward."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.tokenize import _batching


class FakeEngine:
    """ids = code points + 1; padded rows filled with 0 after their end."""

    def __init__(self) -> None:
        self.padded_rows: list[int] = []
        self.singles = 0

    def one(self, text: str) -> np.ndarray:
        self.singles += 1
        return np.array([ord(c) + 1 for c in text], dtype=np.uint32)

    def padded(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        self.padded_rows.append(len(texts))
        matrix = np.zeros((len(texts), max(map(len, texts))), dtype=np.uint32)
        for row, text in enumerate(texts):
            matrix[row, : len(text)] = [ord(c) + 1 for c in text]
        return matrix, np.array([len(t) for t in texts], dtype=np.int64)


def expected(texts: list[str]) -> tuple[list[int], list[int]]:
    return [ord(c) + 1 for t in texts for c in t], [len(t) for t in texts]


SIZES = [0, 1, 7, 200, _batching.SHORT_TEXT, _batching.SHORT_TEXT + 1, 5000]


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.sampled_from(SIZES), max_size=40),
    group=st.integers(1, 5),
    padded=st.booleans(),
)
def test_batches_equal_per_text_ids(sizes: list[int], group: int, padded: bool) -> None:
    texts = [chr(97 + i % 26) * n for i, n in enumerate(sizes)]
    engine = FakeEngine()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_batching, "GROUP", group)
        flat, lengths = _batching.encode_batch(texts, engine.one, engine.padded if padded else None)
    assert flat.dtype == np.uint32 and lengths.dtype == np.int64
    assert (flat.tolist(), lengths.tolist()) == expected(texts)
    assert all(rows <= group for rows in engine.padded_rows)
    shorts = _batching.count_short(texts)
    in_padded = shorts if padded and shorts >= 2 else 0
    assert sum(engine.padded_rows) == in_padded
    assert engine.singles == len(texts) - in_padded


@pytest.mark.parametrize(
    ("mode", "awkward_imported"), [("default", False), ("padded", True), ("threads", True)]
)
def test_gigatoken_paths_match_hf(gpt2_dir: Path, mode: str, awkward_imported: bool) -> None:
    """Real GPT-2 on short and long texts: text by text (the default), padded calls from the
    first text, or gigatoken's thread pool, all equal to the reference engine's ids."""
    code = (
        "import sys, numpy as np\n"
        "from tokenmill.tokenize import _batching\n"
        "from tokenmill.tokenize.tokenizer import load_tokenizer\n"
        "mode = sys.argv[2]\n"
        "if mode == 'padded':\n"
        "    _batching.PADDED_AFTER = 0\n"
        "enc = load_tokenizer(sys.argv[1], engine='gigatoken')\n"
        "words = 'the quick brown fox, 42 emoji \\U0001F600 tab\\t CRLF\\r\\n '\n"
        "texts = [(words * (1 + i % 9)) * (1 if i % 4 else 40) for i in range(300)] + ['', 'a']\n"
        "got = enc.pack(texts, 50256, np.uint16, threads=mode == 'threads')\n"
        "ref = load_tokenizer(sys.argv[1], engine='hf').pack(texts, 50256, np.uint16)\n"
        "assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])\n"
        "print(len(texts), int(got[1].sum()), 'awkward' in sys.modules)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(gpt2_dir), mode],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    count, tokens, imported = run.stdout.split()
    assert int(count) == 302 and int(tokens) > 300 * 10
    assert imported == str(awkward_imported)
