"""Normalizer tokenizers (NFKC tiny, Qwen2-style NFC) and SentencePiece+BOS (Llama-2 style) on
the fast engines behind the guard: Megatron-identical ids, per document, with tricky texts
placed after an input's first 100 documents (past the run's sample)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import reference_tokenizer
from tokenizers import normalizers

from tokenmill.tokenize import parallel
from tokenmill.tokenize.run import tokenize_files
from tokenmill.tokenize.tokenizer import inspect_tokenizer, load_encoder, load_tokenizer
from tokenmill.tokenize.tokenizer_guard import (
    Guard,
    to_ranges,
    unassigned_mask,
    unicode_form,
)

ORDINARY = [
    Path(json.__file__).read_text(encoding="utf-8")[k * 400 : (k + 1) * 400] for k in range(100)
]
TRICKY = [
    "a<|endoftext|>b </s><s>[INST] x <|im_start|>user\n<bos> <eos>",  # added tokens as text
    "<|endoftext|>\u0338 <bos>\u0338 ＜|endoftext|＞ ＜bos＞ ＜/s＞",  # NFC/NFKC make or break them
    "ﬁne ｆｕｌｌ ｗｉｄｔｈ ① ② Ⅻ ㎏ ℌ ｶﾀｶﾅ ² ™ …",
    "ab" * 100_000,
    "word " * 40_000,
    "👨\u200d👩\u200d👧\u200d👦 family 🏳️\u200d🌈 👍🏽",
    "line\u2028separator\u0085next\u2029paragraph\r\n",
    "control \x00\x01\x07\x1b[0m\x1f\x7f\x80\x9f end",
    "e\u0301 a\u0301\u0302\u0303 Z̤̈ \u0958 \u1e0b\u0323 \u212b \u2126 o\u0308\u0304",
    "한국어 텍스트 \u1100\u1161\u11a8 ᄒᆞᆫ 가\u0300",
    "unassigned \U000e0080 \u0378 \U0010fffd here",
    "newer than tokenizers: \u0898 \U00011935\U00011930 \u08ca",
    "",
]


def megatron_tokens(path: Path, texts: list[str]) -> list[int]:
    """Megatron's HuggingFaceTokenizer with --append-eod: ``input_ids`` + [eos] per document."""
    tok = reference_tokenizer(path)
    out: list[int] = []
    for ids in tok(texts).input_ids:
        if ids:
            out += [*ids, tok.eos_token_id]
    return out


def split(flat: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    ends = np.cumsum(lengths)
    return [flat[e - n : e].tolist() for e, n in zip(ends, lengths, strict=True)]


def _tokenize(tmp_path: Path, tokenizer: Any, texts: list[str], workers: int = 1) -> Any:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return tokenize_files([source], tmp_path / "out", tokenizer, append_eod=True, workers=workers)


def test_unicode_form_reads_single_forms_only() -> None:
    assert unicode_form({"type": "NFC"}) == "NFC"
    assert unicode_form({"type": "Sequence", "normalizers": [{"type": "NFKC"}]}) == "NFKC"
    assert unicode_form({"type": "Sequence", "normalizers": [{"type": "NFC"}] * 2}) is None
    assert unicode_form({"type": "Lowercase"}) is None
    assert unicode_form(None) is None
    assert to_ranges([5, 1, 2, 3, 9]) == [(1, 3), (5, 5), (9, 9)]
    assert to_ranges([]) == [] and to_ranges([0x10FFFF, 0]) == [(0, 0), (0x10FFFF, 0x10FFFF)]


def test_guard_classes_and_normalization() -> None:
    guard = Guard(["<bos>", "<|endoftext|>"], to_ranges([0x378, 0xE0080]), "NFKC")
    texts = ["plain", "x<bos>", "＜bos＞", "ﬁ①", "a\u0378", "\U000e0080", "a\u0301"]
    prepared, routed, counts = guard.split(texts)
    assert routed == [1, 2, 4, 5]
    assert counts == {"special_token": 2, "code_point": 2}
    assert prepared[0] == "plain" and prepared[3] == "fi1" and prepared[6] == "á"
    assert Guard([], [], None).split(["<bos>\u0378"]) == (["<bos>\u0378"], [], {})


def test_normalization_differences_are_in_the_guard(qwen2_dir: Path, tiny_dir: Path) -> None:
    """The study at verification finds the code points Python's Unicode (14.0 in 3.11) and the
    ``tokenizers`` normalizer treat differently; each document holding one goes to the reference.
    """
    for path, form in ((qwen2_dir, "NFC"), (tiny_dir, "NFKC")):
        info = inspect_tokenizer(path)
        assert info.normalizer == form
        guard = info.guard()
        theirs = getattr(normalizers, form)()
        for text in ("\U00011935\U00011930", "a\u0898\u0316", "\u08ca"):
            if unicodedata.normalize(form, text) != theirs.normalize_str(text):
                assert guard.risk(text) == "code_point", (form, text)
        for text in ("naïve café", "한국어", "日本語", "e\u0301", "ﬁ①", "Ω\u212b"):
            assert guard.risk(text) is None, text
            assert unicodedata.normalize(form, text) == theirs.normalize_str(text)


@pytest.mark.parametrize("name", ["tiny", "qwen2"])
def test_normalizer_on_fast_engine_with_guard(
    name: str, tiny_dir: Path, qwen2_dir: Path, tmp_path: Path
) -> None:
    path = {"tiny": tiny_dir, "qwen2": qwen2_dir}[name]
    texts = [*ORDINARY, *TRICKY]
    result = _tokenize(tmp_path, path, texts)
    assert result.engine == "gigatoken"
    got = np.fromfile(f"{result.prefix}.bin", dtype=result.manifest["config"]["dtype"])
    assert got.tolist() == megatron_tokens(path, texts)
    check = result.manifest["config"]["verification"]
    assert check["normalizer"]["form"] == inspect_tokenizer(path).normalizer
    routed = check["guard"]["routed_documents"]
    assert routed["special_token"] == 2 and routed["code_point"] == 2
    assert check["sample"] == {"documents_per_input": 64, "chars_per_document": 2048}


def test_guard_is_what_keeps_the_normalized_path_exact(qwen2_dir: Path, tiny_dir: Path) -> None:
    """Without the guard, normalizing first would change ids: NFC composes ``>`` + U+0338 of an
    added token into ``≯``; NFKC turns ``＜bos＞`` into the added token ``<bos>``."""
    for path, text in ((qwen2_dir, "x<|endoftext|>\u0338"), (tiny_dir, "x ＜bos＞ y")):
        encoder = load_tokenizer(path, engine="gigatoken")
        info = encoder.info
        expected = reference_tokenizer(path)(text).input_ids
        bare = encoder._pack([unicodedata.normalize(info.normalizer, text)], None, np.uint32, False)
        assert split(*bare) != [expected]
        assert split(*encoder.encode([text])) == [expected]


def test_tiktoken_workers_count_routed_documents(
    qwen2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tiktoken runs in forked workers (ranges of 4 KB); their guards' counts reach the
    manifest."""
    monkeypatch.setattr(parallel, "MIN_RANGE_BYTES", 4096)
    monkeypatch.setattr(parallel, "MAX_RANGE_BYTES", 4096)
    texts = [*ORDINARY, *TRICKY[:2], *TRICKY[10:]]
    encoder = load_tokenizer(qwen2_dir, engine="tiktoken")
    result = _tokenize(tmp_path, encoder, texts, workers=2)
    got = np.fromfile(f"{result.prefix}.bin", dtype=np.int32)
    assert got.tolist() == megatron_tokens(qwen2_dir, texts)
    routed = result.manifest["config"]["verification"]["guard"]["routed_documents"]
    assert routed == {"special_token": 2, "code_point": 2}


def test_llama2_sentencepiece_bos_every_engine(llama2_dir: Path, tmp_path: Path) -> None:
    tok = reference_tokenizer(llama2_dir)
    assert (len(tok), tok.bos_token_id, tok.eos_token_id) == (32000, 1, 2)
    info = inspect_tokenizer(llama2_dir)
    assert info.prefix_ids == (1,) and info.dtype == np.uint16
    texts = [*ORDINARY[:5], *TRICKY]
    expected = [list(ids) for ids in tok(texts).input_ids]
    assert all(ids[0] == 1 for ids in expected)
    engines = info.usable_engines()
    assert "hf" in engines and "transformers" in engines
    for engine in engines:
        assert split(*load_encoder(info, engine).encode(texts)) == expected, engine
    texts = [*ORDINARY, *TRICKY]
    result = _tokenize(tmp_path, llama2_dir, texts)
    assert result.engine == engines[0]
    got = np.fromfile(f"{result.prefix}.bin", dtype=np.uint16)
    assert got.tolist() == megatron_tokens(llama2_dir, texts)
    starts = np.fromfile(f"{result.prefix}.idx", dtype=np.uint8)  # BOS opens every document
    assert starts.size and got[0] == 1 and np.count_nonzero(got == 1) >= len(texts)


def test_unassigned_code_points_are_a_real_divergence(tekken_dir: Path) -> None:
    """gigatoken and ``tokenizers`` split code points Python 3.11 calls unassigned differently
    (Tekken: U+11DE0..U+11DE9, U+16FF4..U+16FF6, found by a sweep of every code point); the
    probes cannot cover every such code point, so the guard routes every document holding one."""
    import gigatoken
    from tokenizers import Tokenizer

    definition = tekken_dir / "tokenizer.json"
    fast = gigatoken.Tokenizer(gigatoken.gigatoken_rs.load_hf_json(definition.read_bytes()))
    hf = Tokenizer.from_file(str(definition))
    guard = Guard([], to_ranges(np.flatnonzero(unassigned_mask())), None)
    for ch in ("\U00011de0", "\U00016ff4"):
        text = f"a{ch}b {ch}{ch}"
        assert unicodedata.category(ch) == "Cn"
        assert fast.encode(text).tolist() != hf.encode(text, add_special_tokens=False).ids
        assert guard.risk(text) == "code_point"
    assert guard.risk("a\u00e9b 한국어 😀") is None


def test_manifest_of_the_reference_path_claims_no_sample_or_guard(
    tiny_dir: Path, tmp_path: Path
) -> None:
    texts = [*ORDINARY[:3], TRICKY[0], TRICKY[2]]
    result = _tokenize(tmp_path, load_tokenizer(tiny_dir, engine="hf"), texts)
    check = result.manifest["config"]["verification"]
    assert (check["engine"], check["probes"]["verdict"]) == ("hf", "ok")
    assert check["sample"] is None and check["guard"] is None and check["normalizer"] is None
    assert str(tmp_path) not in json.dumps(check) and "cache" not in json.dumps(check)
    got = np.fromfile(f"{result.prefix}.bin", dtype=result.manifest["config"]["dtype"])
    assert got.tolist() == megatron_tokens(tiny_dir, texts)


@pytest.mark.parametrize("name", ["tiny", "qwen2"])
def test_random_mixes_of_normalization_sensitive_characters(
    name: str, tiny_dir: Path, qwen2_dir: Path
) -> None:
    """Seeded random documents over characters that compose, decompose, reorder or fold
    (combining marks of several classes, Hangul jamo, compatibility forms, pieces of added tokens):
    the fast path behind the guard gives the reference ids for every one."""
    import random

    path = {"tiny": tiny_dir, "qwen2": qwen2_dir}[name]
    alphabet = (
        "ae oAKZ<>|/s!1 \n\t\u0301\u0300\u0316\u0327\u0334\u0345\u05b0\u0338\u093c"
        "\u1100\u1161\u11a8\uac00\u212b\u2126\u00c5\u1e0b\u0323ﬁ①Ⅻ㎏ｆ＜｜＞ｶﾞ\u3099\u309a"
        "\u0958\u0915\u0fb2\u0f80\u2028\u0085\u00a0\u200d😀🏽"
    )
    rng = random.Random(1234)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(400)]
    texts += ["<|endoftext|>" + t for t in texts[:20]] + ["<bos>" + t for t in texts[20:40]]
    encoder = load_tokenizer(path, engine="gigatoken")
    assert split(*encoder.pack(texts)) == [
        list(ids) for ids in reference_tokenizer(path)(texts).input_ids
    ]
    assert encoder.routed["special_token"] >= 20  # the documents with an added token's string
