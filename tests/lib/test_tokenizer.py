"""Bundled tokenizers, engine verification and every engine's ids against transformers."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import reference_tokenizer
from pipeline_project import tokenizer_dir

from tokenmill.errors import ConfigError
from tokenmill.tokenize import tokenizer, tokenizer_verify
from tokenmill.tokenize.tokenizer import (
    ENGINES,
    inspect_tokenizer,
    load_encoder,
    load_tokenizer,
    pack_flat,
    record_mismatch,
)
from tokenmill.tokenize.tokenizer_probes import probe_texts
from tokenmill.tokenize.tokenizer_ranks import tiktoken_parts
from tokenmill.tokenize.tokenizer_verify import passthrough_problem, template_ids
from tokenmill_dev.bundled import build_bundled_tokenizer

REAL_TEXTS = [
    "Hello world",
    "",
    "a<|endoftext|>b </s><s>[INST] x",
    "Windows\r\nline endings\r\n",
    "ﬁ ① ｆｕｌｌ\u00a0\u3000 e\u0301",
    Path(json.__file__).read_text(encoding="utf-8")[:20000],
]


def reference_ids(path: Path, texts: list[str]) -> list[list[int]]:
    """What Megatron's HuggingFaceTokenizer computes: ``tokenizer(text).input_ids``."""
    tok = reference_tokenizer(path)
    return [list(tok(t).input_ids) for t in texts]


def split(flat: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    ends = np.cumsum(lengths)
    return [flat[e - n : e].tolist() for e, n in zip(ends, lengths, strict=True)]


@pytest.mark.parametrize(
    ("name", "vocab", "specials", "encoded"),
    [
        # GPT-2 as on the hub
        (
            "gpt2_dir",
            50257,
            ("<|endoftext|>", 50256, 50256),
            {"Hello world": [15496, 995], " Hello world": [18435, 995]},
        ),
        # Tekken: its special ids, and no BOS added
        ("tekken_dir", 131072, ("</s>", 2, 1), {"Hello world": [22177, 4304], "<s>[INST]": [1, 3]}),
    ],
)
def test_bundled_special_ids_and_encodings(
    name: str, vocab: int, specials: tuple, encoded: dict, request: pytest.FixtureRequest
) -> None:
    tok = reference_tokenizer(request.getfixturevalue(name))
    assert len(tok) == vocab
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == specials
    assert {text: tok(text).input_ids for text in encoded} == encoded


def test_bundled_gpt2_config_matches_hub_gpt2(gpt2_dir: Path) -> None:
    config = json.loads((gpt2_dir / "tokenizer_config.json").read_text())
    assert config["add_prefix_space"] is False
    assert config["model_max_length"] == 1024


def test_bundled_build_is_idempotent(gpt2_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in gpt2_dir.iterdir()}
    assert build_bundled_tokenizer("gpt2", gpt2_dir) == gpt2_dir
    assert {p.name: p.stat().st_mtime_ns for p in gpt2_dir.iterdir()} == before


def test_bundled_rejects_unknown_name_and_foreign_dest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown bundled tokenizer 'llama'"):
        build_bundled_tokenizer("llama", tmp_path / "x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not a tokenizer directory"):
        build_bundled_tokenizer("gpt2", tmp_path / "busy")


@pytest.mark.parametrize(
    ("name", "vocab", "eod", "dtype"),
    [("gpt2_dir", 50257, 50256, np.uint16), ("tekken_dir", 131072, 2, np.int32)],
)
def test_inspect_reports_megatron_facts(
    name: str, vocab: int, eod: int, dtype: type, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(name)
    info = inspect_tokenizer(path)
    assert (info.vocab_size, info.eod_id, info.dtype) == (vocab, eod, np.dtype(dtype))
    assert info.max_id == max(reference_tokenizer(path).get_vocab().values())
    assert (info.prefix_ids, info.suffix_ids) == ((), ())
    assert info.verdicts == dict.fromkeys(ENGINES, "ok")
    assert info.ranks is not None and info.ranks.scheme is not None


def test_verification_is_cached(gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = inspect_tokenizer(gpt2_dir)

    def fail(*args: object) -> None:
        raise AssertionError("verification ran again")

    monkeypatch.setattr(tokenizer, "run_verification", fail)
    assert inspect_tokenizer(gpt2_dir / "tokenizer.json") == first


def test_verification_child_never_imports_torch(gpt2_dir: Path, tmp_path: Path) -> None:
    """transformers would import torch (seconds) for nothing a tokenizer call uses; the child
    hides it and still writes the record (its ids are checked against transformers with torch
    in the tests of every engine)."""
    record = tmp_path / "record.json"
    cmd = [sys.executable, "-X", "importtime", "-m", "tokenmill.tokenize.tokenizer_verify"]
    cmd += [str(gpt2_dir), str(gpt2_dir / "tokenizer.json"), "fp", str(record)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "transformers" in imported and "torch" not in imported
    assert json.loads(record.read_text())["verdicts"] == dict.fromkeys(ENGINES, "ok")


FORKED = """
import sys
from tokenmill.errors import TokenmillError
from tokenmill.tokenize import tokenizer
forks = []
real = tokenizer._forked_verification
tokenizer._forked_verification = lambda *args: forks.append(1) or real(*args)
tokenizer.inspect_tokenizer(sys.argv[1])
try:
    tokenizer.inspect_tokenizer(sys.argv[2])
except TokenmillError as exc:
    sys.stdout.write(f"{len(forks)} forks; {exc}")
"""


def test_a_fresh_process_forks_the_verification_child(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that loaded no engine (a CLI run) forks the verification child instead of
    starting an interpreter: the record and files are those a new interpreter writes, none of
    its output reaches the caller, and a failure is reported with the child's last lines."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"model": {"type": "BPE"}}', encoding="utf-8")
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path / "forked")}
    cmd = [sys.executable, "-c", FORKED, str(gpt2_dir), str(broken)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    assert proc.stderr == ""
    assert proc.stdout.startswith(f"2 forks; tokenizer {broken}: verification against ")
    assert "(exit 1): " in proc.stdout and "Error" in proc.stdout
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "started"))
    monkeypatch.setattr(tokenizer, "FORK_BLOCKERS", ("tokenmill",))  # a new interpreter
    inspect_tokenizer(gpt2_dir)

    def files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

    forked, started = files(tmp_path / "forked"), files(tmp_path / "started")
    assert len(started) == 4 and forked == started  # record, hf copy, ranks, ids


@pytest.mark.parametrize("name", ["gpt2", "gpt2-compact", "llama2"])
def test_speculated_engine_side_writes_what_the_serial_path_writes(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engines' part runs in a forked helper on the definition on disk while the reference
    loads; the record and files are the same as without it, also where transformers rewrites the
    definition (llama2: the speculation is discarded) or the helper fails. The reference's side
    parses no definition when the backend serializes to the file's bytes (gpt2, as
    save_pretrained wrote it), and keeps the speculation when it parses to the same (the same
    definition in compact JSON)."""
    src = build_bundled_tokenizer(name.split("-")[0], tokenizer_dir(name.split("-")[0]))
    if name == "gpt2-compact":
        shutil.copytree(src, tmp_path / name)
        src = tmp_path / name
        spec = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
        (src / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    calls: list[str] = []

    def counting(fn: Any) -> Any:
        def counted(*args: Any, **kw: Any) -> Any:
            calls.append(fn.__name__)  # only this process's calls reach this list
            return fn(*args, **kw)

        return counted

    for fn_name in ("_disk_definition", "engine_side"):
        monkeypatch.setattr(tokenizer_verify, fn_name, counting(getattr(tokenizer_verify, fn_name)))

    def files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}

    def verify(folder: Path) -> dict[str, bytes]:
        folder.mkdir()
        record = folder / "rec.json"
        result = tokenizer_verify.verify_tokenizer(src, src / "tokenizer.json", "fp", record)
        record.write_bytes(json.dumps(result).encode())
        return files(folder)

    speculated = verify(tmp_path / "speculated")
    assert (
        calls
        == {
            "gpt2": [],
            "gpt2-compact": ["_disk_definition"],
            "llama2": ["_disk_definition", "engine_side"],
        }[name]
    )
    monkeypatch.setattr(tokenizer_verify.Speculation, "result", lambda self: None)
    assert verify(tmp_path / "serial") == speculated
    assert multiprocessing.active_children() == []  # an untaken helper is ended, not left blocked
    record = json.loads(speculated["rec.json"])
    assert (record["effective_definition"] is None) == (name != "llama2")


def test_reference_loads_without_the_model_table(gpt2_dir: Path, tekken_dir: Path) -> None:
    """``load_reference`` skips transformers' table of every model (0.3 s) and still gives the
    class and ids ``AutoTokenizer`` gives in a normal import; asking the package for any other
    name builds the table then."""
    llama2 = build_bundled_tokenizer("llama2", tokenizer_dir("llama2"))
    paths = [gpt2_dir, tekken_dir, llama2]
    code = (
        "import json, sys; from pathlib import Path; sys.modules['torch'] = None\n"
        "from tokenmill.tokenize.engines import load_reference\n"
        "texts = json.loads(sys.stdin.read())\n"
        "out = {p: [type(t).__qualname__, t(texts).input_ids]\n"
        "       for p in sys.argv[1:] for t in [load_reference(Path(p))]}\n"
        "import transformers; out['deferred'] = type(sys.modules['transformers.models']).__name__\n"
        "out['looked_up'] = transformers.models.GPT2Tokenizer.__qualname__\n"
        "out['after'] = type(sys.modules['transformers.models']).__name__\n"
        "print(json.dumps(out))\n"
    )
    texts = [*REAL_TEXTS, *probe_texts(["<|endoftext|>", "</s>", "<s>"])]
    cmd = [sys.executable, "-c", code, *map(str, paths)]
    proc = subprocess.run(cmd, input=json.dumps(texts), capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    assert (out["deferred"], out["looked_up"], out["after"]) == (
        "module",
        "GPT2Tokenizer",
        "_LazyModule",
    )
    for path in paths:
        tok = reference_tokenizer(path)
        assert out[str(path)] == [type(tok).__qualname__, reference_ids(path, texts)]


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_gives_reference_ids_gpt2(gpt2_dir: Path, engine: str) -> None:
    texts = [*REAL_TEXTS, *probe_texts(["<|endoftext|>"])]
    got = split(*load_tokenizer(gpt2_dir, engine=engine).encode(texts))
    assert got == reference_ids(gpt2_dir, texts)


@pytest.mark.parametrize("engine", ["gigatoken", "tiktoken", "hf"])
def test_fast_engines_give_reference_ids_tekken(tekken_dir: Path, engine: str) -> None:
    got = split(*load_tokenizer(tekken_dir, engine=engine).encode(REAL_TEXTS))
    assert got == reference_ids(tekken_dir, REAL_TEXTS)


def test_nfkc_and_bos_template_tokenizer(tiny_dir: Path) -> None:
    info = inspect_tokenizer(tiny_dir)
    bos = reference_tokenizer(tiny_dir).bos_token_id
    assert info.prefix_ids == (bos,)
    assert info.normalizer == "NFKC"  # the fast engines run behind unicodedata's NFKC
    assert info.usable_engines() == list(ENGINES)
    expected = reference_ids(tiny_dir, REAL_TEXTS)
    assert all(ids[0] == bos for ids in expected)
    for engine in info.usable_engines():
        assert split(*load_encoder(info, engine).encode(REAL_TEXTS)) == expected, engine


def test_record_mismatch_demotes_engine(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(os.environ["TOKENMILL_CACHE_DIR"], tmp_path / "cache")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    info = inspect_tokenizer(gpt2_dir)
    record_mismatch(info, "gigatoken", "doc 3 differs")
    again = inspect_tokenizer(gpt2_dir)
    assert again.verdicts["gigatoken"] == "mismatch on input: doc 3 differs"
    assert load_tokenizer(gpt2_dir).name == "tiktoken"
    with pytest.raises(ConfigError, match="engine 'gigatoken' is not verified"):
        load_tokenizer(gpt2_dir, engine="gigatoken")


def test_bad_tokenizer_paths(gpt2_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file or directory"):
        inspect_tokenizer(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"no tokenizer\.json in the directory"):
        inspect_tokenizer(tmp_path)
    for hub_name in ("gpt2", "meta-llama/Llama-2-7b"):  # hub names get the offline hint
        with pytest.raises(
            ConfigError,
            match=rf"tokenizer {hub_name}: .*never downloads.*make tokenizers.*save_pretrained",
        ):
            inspect_tokenizer(hub_name)
    with pytest.raises(ConfigError, match="engine='fast': expected 'auto' or one of"):
        load_encoder(inspect_tokenizer(gpt2_dir), "fast")


def test_template_ids() -> None:
    bos = {"id": "<s>", "ids": [1], "tokens": ["<s>"]}
    eos = {"id": "</s>", "ids": [2], "tokens": ["</s>"]}
    single = [
        {"SpecialToken": {"id": "<s>"}},
        {"Sequence": {"id": "A"}},
        {"SpecialToken": {"id": "</s>"}},
    ]
    pp = {
        "type": "TemplateProcessing",
        "single": single,
        "special_tokens": {"<s>": bos, "</s>": eos},
    }
    assert template_ids(pp) == ([1], [2])
    assert template_ids({"type": "Sequence", "processors": [{"type": "ByteLevel"}, pp]}) == (
        [1],
        [2],
    )
    assert template_ids({"type": "RobertaProcessing", "cls": ["<s>", 0], "sep": ["</s>", 2]}) == (
        [0],
        [2],
    )
    assert template_ids(None) == ([], [])
    assert template_ids({"type": "Unknown"}) is None


def test_passthrough_problem_detects_overrides(gpt2_dir: Path) -> None:
    tok = reference_tokenizer(gpt2_dir)
    assert passthrough_problem(tok) is None

    class Custom(type(tok)):  # type: ignore[misc]
        def _encode_plus(self, *args: object, **kwargs: object) -> Any:
            raise NotImplementedError

    assert passthrough_problem(Custom.__new__(Custom)) == "Custom overrides _encode_plus"


def test_tiktoken_parts_refuses_what_it_cannot_express() -> None:
    base = {
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
        "normalizer": None,
        "added_tokens": [],
    }
    assert tiktoken_parts(base)[1] == {b"a": 0, b"b": 1}
    cases = [
        ({"normalizer": {"type": "NFKC"}}, "normalizer NFKC has no tiktoken form"),
        ({"pre_tokenizer": {"type": "Whitespace"}}, "does not end in ByteLevel"),
        ({"added_tokens": [{"content": "<x>", "id": 2, "lstrip": True}]}, "strips whitespace"),
        (
            {"added_tokens": [{"content": "<x", "id": 2}, {"content": "<x>", "id": 3}]},
            "is a prefix of another",
        ),
    ]
    for change, message in cases:
        with pytest.raises(ConfigError, match=message):
            tiktoken_parts({**base, **change})


@pytest.mark.parametrize(
    ("prefix", "suffix", "eod"), [((), (), None), ((), (), 3), ((7,), (), 3), ((7, 8), (9,), None)]
)
@pytest.mark.parametrize("sizes", [[0, 4, 1, 0, 2] * 400, [3000, 0, 5000, 2500]])
def test_pack_flat_equals_per_text_assembly(
    prefix: tuple[int, ...], suffix: tuple[int, ...], eod: int | None, sizes: list[int]
) -> None:
    arrays = [np.arange(i, i + n, dtype=np.uint32) for i, n in enumerate(sizes)]
    docs = [[*prefix, *a.tolist(), *suffix] for a in arrays]
    docs = [[*d, eod] if d and eod is not None else d for d in docs]
    expected = np.array([t for d in docs for t in d], np.uint16), np.array([len(d) for d in docs])
    flat = np.concatenate(arrays)
    got = pack_flat(flat, np.array(sizes, dtype=np.int64), prefix, suffix, eod, np.uint16)
    assert got[0].dtype == np.uint16
    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])


def test_gigatoken_batches_agree_with_per_text_and_hf(gpt2_dir: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from tokenmill.tokenize.tokenizer import load_tokenizer\n"
        "enc = load_tokenizer(sys.argv[1], engine='gigatoken')\n"
        "texts = ['Hello world', '', 'a<|endoftext|>b'] * 50\n"
        "flat, lengths = enc.pack(texts, 50256, np.uint16, threads=True)\n"
        "again = enc.pack(texts, 50256, np.uint16, threads=False)\n"
        "assert np.array_equal(flat, again[0]) and np.array_equal(lengths, again[1])\n"
        "ref = load_tokenizer(sys.argv[1], engine='hf').pack(texts, 50256, np.uint16)\n"
        "assert np.array_equal(flat, ref[0]) and np.array_equal(lengths, ref[1])\n"
        "print(lengths[:3].tolist())\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(gpt2_dir)], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[3, 0, 4]"
