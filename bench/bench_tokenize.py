"""Tokenization: ``tokenmill tokenize`` end to end vs the encode-only floors of exact engines.

On N MB (default 20) of real text (stdlib sources, ``bench/corpus.py``) and the GPT-2 and Tekken
tokenizers, each repetition runs, alternating: the encode-only floors on already-parsed texts
(HF ``tokenizers`` ``encode_batch_fast``, ``tiktoken`` ``encode_batch`` over ranks built from the
same tokenizer.json, ``gigatoken`` ``encode_batch``; each with a freshly constructed engine, so
caches start cold as in a real run; construction and imports not timed), then our CLI as a
subprocess per ``--workers`` value: interpreter start, imports, tokenizer load, JSON parsing,
writing and the reference check included, bytecode cache on as after a normal install; with CPU
seconds and the peak RSS/PSS of its process tree; and ``tokenize_files`` called in this warm
process (imports done, tokenizer record cached; load, parsing, check and writing timed), so the
interpreter start-up and imports show as the difference. All floors must give identical ids
and every ``.bin`` of ours must equal them plus EOD. The ratio is our median wall time over the
best floor's median. ``--rss-mb 100`` adds memory-only runs on a larger corpus. Megatron's
preprocess_data.py is not installable offline; the issue's numbers for it are quoted.

Each repetition also measures the work any exact end-to-end run must do besides encoding:
starting Python with numpy, constructing the fastest engine, parsing the JSON lines (orjson,
``text`` only) and hashing the ``.bin`` and the input for the manifest. From those and the best
floor's wall and CPU seconds, the lower bound for any such run on this machine is the larger of
the chain start-up + engine + floor wall (each needs the one before it) and all that CPU spread
over every core without a gap. It tells whether a ratio target is reachable here at all. For
context it also times gigatoken's own JSONL reader (JSON parsed in Rust), which is fast but
inexact on bad lines (``gigatoken_reader``).

``--normalizers`` instead compares tokenizers with a Unicode normalizer on the same corpus, in
this process, alternating within each repetition: GPT-2's path (gigatoken), then for Qwen2-style
NFC and GPT-2 with an NFKC normalizer added (same vocabulary as GPT-2, so only the normalizer
differs) our path (unicodedata + gigatoken on the normalizer-free copy, behind the guard) and
the old path (the ``hf`` engine, what these tokenizers ran on before); all ``tokenize_files``
with ``append_eod``, the ``.bin`` of both paths compared. It also times the fast path's encoding
alone (a loaded encoder's ``pack`` on the parsed corpus, guard included), the guard alone
(``Guard.split``: normalization included) on the corpus and on as many characters of non-ASCII
text, and each tokenizer's first-use verification in a fresh cache (a subprocess: imports
included).

    python bench/bench_tokenize.py [--mb 20] [--repeat 3] [--workers 1,2] [--rss-mb 100]
    python bench/bench_tokenize.py --mb 200 --floors gigatoken --name tokenize-200mb
    python bench/bench_tokenize.py --normalizers [--mb 20] [--repeat 3] [--workers 1,2]
    python bench/bench_tokenize.py --scaling [--mb 200] [--repeat 3] [--max-workers N]
    python bench/bench_tokenize.py --first-use [--mb 20] [--repeat 3] [--profile]

``--scaling`` compares one run at ``--workers`` 1, 2, 4 ... up to the cores present with as many
independent single-worker runs over equal parts of the corpus (see ``bench/_tokenize_scaling.py``).
``--first-use`` compares a CLI run with a new tokenizer (fresh cache: the verification runs)
with the same run cached (see ``bench/_tokenize_first_use.py``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import psutil

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from _tokenize_first_use import (  # noqa: E402
    child_split,
    first_use_runs,
    profile,
    reference_load,
    report_child_split,
    report_first_use,
)
from _tokenize_scaling import report_scaling, scaling_runs, worker_counts  # noqa: E402
from _util import OUT_DIR, machine, run_timed, table, write_results  # noqa: E402
from corpus import MB, ensure_corpus  # noqa: E402

from tokenmill.formats.shard_records import text_digest  # noqa: E402
from tokenmill.tokenize.run import tokenize_files  # noqa: E402
from tokenmill.tokenize.tokenizer import (  # noqa: E402
    TiktokenEncoder,
    TokenizerInfo,
    inspect_tokenizer,
    load_encoder,
    load_tokenizer,
)
from tokenmill_dev.bundled import build_bundled_tokenizer  # noqa: E402

TOKENIZERS = ("gpt2", "tekken")
# The CLI runs as after a normal install: with Python's bytecode cache (this sandbox disables it).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
MEGATRON = {
    "classic preprocess_data.py, GPT-2, 20 MB (issue)": 22.7,
    "fast path, 200 MB (issue; 4.8 s of it imports, 1.5 GB RSS)": 9.6,
}


Floor = tuple[float, float, np.ndarray, np.ndarray]  # wall s, CPU s, flat ids, lengths


def _flat(rows: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    arrays = [np.array(r, dtype=np.uint32) for r in rows]
    return np.concatenate(arrays), np.array([len(a) for a in arrays])


def floor_hf(tok_dir: Path, texts: list[str]) -> Floor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    cpu, start = time.process_time(), time.perf_counter()
    encodings = tok.encode_batch_fast(texts, add_special_tokens=True)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return (seconds, cpu, *_flat([e.ids for e in encodings]))


def floor_tiktoken(tok_dir: Path, texts: list[str]) -> Floor:
    enc = TiktokenEncoder(inspect_tokenizer(tok_dir)).encoding
    cpu, start = time.process_time(), time.perf_counter()
    ids = enc.encode_batch(texts, allowed_special="all", num_threads=os.cpu_count() or 1)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return (seconds, cpu, *_flat(ids))


def floor_gigatoken(tok_dir: Path, texts: list[str]) -> Floor:
    import gigatoken

    tok = gigatoken.Tokenizer(str(tok_dir))
    cpu, start = time.process_time(), time.perf_counter()
    rows = tok.encode_batch(texts)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    offsets = np.asarray(rows.layout.offsets.data)
    return seconds, cpu, np.asarray(rows.layout.content.data, dtype=np.uint32), np.diff(offsets)


FLOORS = {"hf": floor_hf, "tiktoken": floor_tiktoken, "gigatoken": floor_gigatoken}


def gigatoken_reader(tok_dir: Path, corpus: Path) -> Floor:
    """gigatoken's own file path (``encode_files`` over ``JsonlFileSource``: JSON parsed in
    Rust on its thread pool). Context only: gigatoken 0.10's reader silently ends the file at a
    bad line (not an object, text missing or not a string, invalid UTF-8, a lone surrogate, a
    raw control character, a whitespace-only line, a BOM), still yields the text of an
    unterminated object and takes the first of duplicate keys, so no exact run can use it."""
    import gigatoken

    tok = gigatoken.Tokenizer(str(tok_dir))
    cpu, start = time.process_time(), time.perf_counter()
    rows = tok.encode_files(gigatoken.JsonlFileSource([str(corpus)], "text"))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    offsets = np.asarray(rows.layout.offsets.data)
    return seconds, cpu, np.asarray(rows.layout.content.data, dtype=np.uint32), np.diff(offsets)


def tree_memory(proc: psutil.Process) -> tuple[int, int]:
    """``(RSS, PSS)`` summed over a process and its children (PSS counts shared pages once)."""
    rss = pss = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        pss += info.pss
    return rss, pss


def run_ours(
    corpus: Path, tok_dir: Path, prefix: Path, workers: int, poll: float
) -> dict[str, Any]:
    """One CLI run: wall, CPU of the tree, peak tree RSS/PSS (polled every ``poll`` s)."""
    cmd = [sys.executable, "-m", "tokenmill.cli", "tokenize", "--input", str(corpus)]
    cmd += ["--output-prefix", str(prefix), "--tokenizer", str(tok_dir), "--append-eod"]
    cmd += ["--workers", str(workers)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    handle = psutil.Process(proc.pid)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss, pss = tree_memory(handle)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(poll)
    wall = time.perf_counter() - start
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {err}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {
        "wall": wall,
        "cpu": cpu,
        "rss_mb": peak_rss / 2**20,
        "pss_mb": peak_pss / 2**20,
        "summary": out.strip(),
    }


def run_in_process(corpus: Path, tok_dir: Path, prefix: Path, workers: int) -> dict[str, Any]:
    """One ``tokenize_files`` call here: wall, CPU of this process and its (checker) children."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0, start = time.process_time(), time.perf_counter()
    tokenize_files([corpus], prefix, tok_dir, append_eod=True, workers=workers, progress=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"wall": wall, "cpu": time.process_time() - cpu0 + children}


def expected_tokens(
    floor: np.ndarray, lengths: np.ndarray, eod: int, dtype: np.dtype
) -> np.ndarray:
    """The ``.bin`` tokens: the floor's ids with EOD after every non-empty document."""
    return np.insert(floor, np.cumsum(lengths)[lengths > 0], eod).astype(dtype)


def check_output(prefix: Path, expected: np.ndarray) -> None:
    """Our .bin must hold exactly ``expected``."""
    got = np.fromfile(f"{prefix}_text_document.bin", dtype=expected.dtype)
    if not np.array_equal(got, expected):
        raise RuntimeError(f"{prefix}: output differs from the floor ids")


def _timed(fn: Any) -> dict[str, float]:
    """Wall and CPU seconds (this process, all threads) of ``fn()``."""
    cpu, start = time.process_time(), time.perf_counter()
    fn()
    return {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}


def unavoidable_work(corpus: Path, info: TokenizerInfo, expected: np.ndarray) -> dict[str, Any]:
    """Wall and CPU seconds of what any exact run does besides encoding: start Python with
    numpy (a subprocess), construct the fastest engine, parse the JSON lines, hash the .bin and
    the input (the manifest records both)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # One BLAS thread: the least CPU a start-up with numpy takes (tokenizing needs no BLAS).
    subprocess.run(
        [sys.executable, "-c", "import numpy"], check=True, env={**ENV, "OPENBLAS_NUM_THREADS": "1"}
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    engine = info.usable_engines()[0]
    return {
        "start-up": {"wall": wall, "cpu": cpu},
        f"engine load ({engine})": _timed(lambda: load_encoder(info, engine)),
        "JSON parse": _timed(
            lambda: [orjson.loads(line)["text"] for line in corpus.read_bytes().splitlines()]
        ),
        "sha256 of .bin": _timed(lambda: hashlib.sha256(expected).hexdigest()),
        "sha256 of input": _timed(lambda: hashlib.sha256(corpus.read_bytes()).hexdigest()),
    }


def lower_bound(res: dict[str, Any], cores: int) -> dict[str, Any]:
    """The least wall time any exact end-to-end run can take here (medians over repetitions):
    max(start-up + engine + best floor wall, (its CPU + the floor's CPU) / cores)."""
    floors = {k: statistics.median(v) for k, v in res["floors"].items()}
    engine = min(floors, key=floors.__getitem__)
    parts = {
        part: {
            m: statistics.median(w[part][m] for w in res["unavoidable"]) for m in ("wall", "cpu")
        }
        for part in res["unavoidable"][0]
    }
    floor_cpu = statistics.median(res["floors_cpu"][engine])
    setup = [v["wall"] for k, v in parts.items() if k == "start-up" or k.startswith("engine")]
    chain = sum(setup) + floors[engine]
    spread = (sum(v["cpu"] for v in parts.values()) + floor_cpu) / cores
    return {
        "floor": engine,
        "floor_wall": floors[engine],
        "floor_cpu": floor_cpu,
        "parts": parts,
        "cores": cores,
        "chain_wall": chain,
        "cpu_spread_wall": spread,
        "seconds": max(chain, spread),
        "ratio_to_floor": max(chain, spread) / floors[engine],
    }


def first_use_seconds(tok_dir: Path) -> float:
    """Wall time of the one-off verification against transformers (fresh cache)."""
    with tempfile.TemporaryDirectory() as cache:
        code = (
            "import sys; from tokenmill.tokenize.tokenizer import inspect_tokenizer as i; "
            "i(sys.argv[1])"
        )
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", code, str(tok_dir)],
            check=True,
            env={**ENV, "TOKENMILL_CACHE_DIR": cache},
        )
        return time.perf_counter() - start


def bench(args: argparse.Namespace) -> dict[str, Any]:
    corpus = ensure_corpus(args.mb)
    size = corpus.stat().st_size
    texts = [orjson.loads(line)["text"] for line in corpus.read_bytes().splitlines()]
    import awkward  # noqa: F401  (gigatoken returns awkward arrays; keep the import out of the floor)

    work = OUT_DIR / "tokenize"
    work.mkdir(parents=True, exist_ok=True)
    dirs = {n: build_bundled_tokenizer(n, ROOT / ".tokenizers" / n) for n in args.tokenizers}
    results: dict[str, Any] = {}
    for name, tok_dir in dirs.items():
        info = inspect_tokenizer(tok_dir)  # verifies once (cached) before anything is timed
        run_ours(corpus, tok_dir, work / name, 1, 1.0)
        results[name] = {
            "floors": {k: [] for k in args.floors},
            "floors_cpu": {k: [] for k in args.floors},
            "unavoidable": [],
            "ours": {w: [] for w in args.workers},
            "in_process": {w: [] for w in args.workers},
            "engine_reader": [],
        }
        results[name]["engine_verdicts"] = info.verdicts
    for rep in range(args.repeat):
        for name, tok_dir in dirs.items():
            info = inspect_tokenizer(tok_dir)
            floors = {engine: FLOORS[engine](tok_dir, texts) for engine in args.floors}
            first = floors[args.floors[0]]
            for engine, (seconds, cpu, flat, lengths) in floors.items():
                results[name]["floors"][engine].append(seconds)
                results[name]["floors_cpu"][engine].append(cpu)
                if not (np.array_equal(flat, first[2]) and np.array_equal(lengths, first[3])):
                    raise RuntimeError(f"{name}: floor {engine} disagrees with {args.floors[0]}")
            if "gigatoken" in args.floors:
                seconds, cpu, flat, lengths = gigatoken_reader(tok_dir, corpus)
                if not (np.array_equal(flat, first[2]) and np.array_equal(lengths, first[3])):
                    raise RuntimeError(f"{name}: gigatoken's JSONL reader disagrees with the floor")
                results[name]["engine_reader"].append({"wall": seconds, "cpu": cpu})
            expected = expected_tokens(first[2], first[3], info.eod_id, info.dtype)
            results[name]["unavoidable"].append(unavoidable_work(corpus, info, expected))
            for w in args.workers:
                prefix = work / f"{name}-w{w}"
                run = run_ours(corpus, tok_dir, prefix, w, 0.05)
                check_output(prefix, expected)
                results[name]["ours"][w].append(run)
                prefix = work / f"{name}-inproc-w{w}"
                results[name]["in_process"][w].append(run_in_process(corpus, tok_dir, prefix, w))
                check_output(prefix, expected)
            print(f"rep {rep + 1}/{args.repeat} {name} done", file=sys.stderr)
    dochash = [_timed(lambda: [text_digest(t) for t in texts]) for _ in range(args.repeat)]
    cores = len(os.sched_getaffinity(0))
    for name, tok_dir in dirs.items():
        results[name]["lower_bound"] = lower_bound(results[name], cores)
        if not args.skip_first_use:
            results[name]["first_use_verification_s"] = first_use_seconds(tok_dir)
    load = [round(x, 2) for x in os.getloadavg()]
    return {
        "corpus": str(corpus),
        "bytes": size,
        "documents": len(texts),
        "load": load,
        "results": results,
        "dochash": dochash,
    }


def gpt2_nfkc(gpt2_dir: Path) -> Path:
    """GPT-2 with an NFKC normalizer (a bench-only tokenizer: GPT-2's vocabulary and config)."""
    dest = OUT_DIR / "tokenizers" / "gpt2-nfkc"
    if not (dest / "tokenizer.json").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        spec = orjson.loads((gpt2_dir / "tokenizer.json").read_bytes())
        spec["normalizer"] = {"type": "NFKC"}
        # GPT2Tokenizer would rebuild the backend without the normalizer: load it as is
        config = orjson.loads((gpt2_dir / "tokenizer_config.json").read_bytes())
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        (dest / "tokenizer_config.json").write_bytes(orjson.dumps(config))
        (dest / "tokenizer.json").write_bytes(orjson.dumps(spec))
    return dest


def multilingual_texts(chars: int) -> list[str]:
    """Documents of 2,000 characters of the probe set's scripts, emoji and NFKC-sensitive text
    (nothing ASCII-only), ``chars`` characters in all: the guard's and normalizer's worst case."""
    from tokenmill.tokenize.tokenizer_probes import _PROBES

    unit = " ".join(_PROBES[6:11])
    doc = (unit * (2000 // len(unit) + 1))[:2000]
    return [doc] * max(1, chars // len(doc))


def first_use(tok_dir: Path) -> dict[str, float]:
    """Wall and CPU seconds of the one-off verification (fresh cache, a subprocess)."""
    with tempfile.TemporaryDirectory() as cache:
        code = (
            "import sys; from tokenmill.tokenize.tokenizer import inspect_tokenizer as i; "
            "i(sys.argv[1])"
        )
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", code, str(tok_dir)],
            check=True,
            env={**ENV, "TOKENMILL_CACHE_DIR": cache},
        )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "wall": wall,
        "cpu": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime,
    }


def normalizer_runs(args: argparse.Namespace) -> dict[str, Any]:
    """Normalizer tokenizers, fast path vs the old (hf) path vs GPT-2's path (see the docstring)."""
    corpus = ensure_corpus(args.mb)
    texts = [orjson.loads(line)["text"] for line in corpus.read_bytes().splitlines()]
    gpt2 = build_bundled_tokenizer("gpt2", ROOT / ".tokenizers" / "gpt2")
    dirs = {
        "gpt2": gpt2,
        "qwen2-nfc": build_bundled_tokenizer("qwen2", ROOT / ".tokenizers" / "qwen2"),
        "gpt2-nfkc": gpt2_nfkc(gpt2),
    }
    paths = [
        ("gpt2", "auto"),
        *((n, e) for n in ("qwen2-nfc", "gpt2-nfkc") for e in ("auto", "hf")),
    ]
    work = OUT_DIR / "tokenize-normalizers"
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    guard: dict[str, list[dict[str, float]]] = {n: [] for n in dirs}
    guard_multi: dict[str, list[dict[str, float]]] = {n: [] for n in dirs}
    multi = multilingual_texts(sum(map(len, texts)))
    encode: dict[str, list[dict[str, float]]] = {n: [] for n in dirs}
    encoders = {n: load_tokenizer(d) for n, d in dirs.items()}  # loaded once: encode-only rows
    for name, tok_dir in dirs.items():
        info = inspect_tokenizer(tok_dir)  # verified once before anything is timed
        print(
            f"{name}: normalizer {info.normalizer}, engines {info.usable_engines()}",
            file=sys.stderr,
        )
    for rep in range(args.repeat):
        for name, engine in paths:
            for w in args.workers:
                encoder = load_tokenizer(dirs[name], engine=engine)
                prefix = work / f"{name}-{engine}-w{w}"
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu0, start = time.process_time(), time.perf_counter()
                result = tokenize_files(
                    [corpus], prefix, encoder, append_eod=True, workers=w, progress=False
                )
                wall = time.perf_counter() - start
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = time.process_time() - cpu0
                cpu += after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
                guard_info = result.manifest["config"]["verification"]["guard"]
                runs.setdefault(f"{name} {engine} w{w}", []).append(
                    {
                        "wall": wall,
                        "cpu": cpu,
                        "engine": result.engine,
                        "routed": None if guard_info is None else guard_info["routed_documents"],
                    }
                )
        for name, tok_dir in dirs.items():
            g = inspect_tokenizer(tok_dir).guard()
            guard[name].append(_timed(lambda g=g: g.split(texts)))
            guard_multi[name].append(_timed(lambda g=g: g.split(multi)))
            enc = encoders[name]
            encode[name].append(_timed(lambda e=enc: e.pack(texts, e.info.eod_id, e.info.dtype)))
        print(f"rep {rep + 1}/{args.repeat} done", file=sys.stderr)
    for name in ("qwen2-nfc", "gpt2-nfkc"):
        for w in args.workers:
            a = (work / f"{name}-auto-w{w}_text_document.bin").read_bytes()
            b = (work / f"{name}-hf-w{w}_text_document.bin").read_bytes()
            if a != b:
                raise RuntimeError(f"{name} w{w}: the fast path's .bin differs from hf's")
    first = {} if args.skip_first_use else {n: first_use(d) for n, d in dirs.items()}
    non_ascii = sum(not t.isascii() for t in texts)
    return {
        "corpus": str(corpus),
        "bytes": corpus.stat().st_size,
        "documents": len(texts),
        "non_ascii_documents": non_ascii,
        "load": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
        "guard": guard,
        "guard_non_ascii": guard_multi,
        "encode_only": encode,
        "non_ascii_chars": sum(map(len, multi)),
        "first_use": first,
    }


def report_normalizers(data: dict[str, Any]) -> None:
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("wall", "cpu")}
        for k, v in data["runs"].items()
    }
    print(
        f"{data['bytes'] / MB:.1f} MB, {data['documents']} documents "
        f"({data['non_ascii_documents']} not pure ASCII); load {data['load']}"
    )
    rows = [
        ["path", "workers", "engine", "wall s", "CPU s", "vs GPT-2 path", "vs hf path", "routed"]
    ]
    for key, stats in med.items():
        name, engine, w = key.split()
        base = med[f"gpt2 auto {w}"]["wall"]
        old = med.get(f"{name} hf {w}")
        last = data["runs"][key][-1]
        rows.append(
            [
                f"{name} {engine}",
                w[1:],
                last["engine"],
                f"{stats['wall']:.2f}",
                f"{stats['cpu']:.2f}",
                f"{stats['wall'] / base:.2f}x",
                f"{stats['wall'] / old['wall']:.3f}x" if old and engine == "auto" else "",
                str(last["routed"]) if last["routed"] else "",
            ]
        )
    print(table(rows))
    rows = [["engine loaded, parsed texts (pack with guard)", "wall s", "CPU s"]]
    for key, label in (
        ("encode_only", "encode only"),
        ("guard", "guard alone, corpus"),
        ("guard_non_ascii", "guard alone, non-ASCII text, same chars"),
    ):
        for name, timings in data[key].items():
            rows.append(
                [
                    f"{name}, {label}",
                    f"{statistics.median(t['wall'] for t in timings):.3f}",
                    f"{statistics.median(t['cpu'] for t in timings):.3f}",
                ]
            )
    print(table(rows))
    if data["first_use"]:
        rows = [["first use (verification, fresh cache)", "wall s", "CPU s"]]
        for name, t in data["first_use"].items():
            rows.append([name, f"{t['wall']:.2f}", f"{t['cpu']:.2f}"])
        print(table(rows))


def rss_runs(megabytes: float, tokenizers: list[str], workers: list[int]) -> dict[str, Any]:
    corpus = ensure_corpus(megabytes)
    out: dict[str, Any] = {"corpus": str(corpus), "bytes": corpus.stat().st_size}
    for name in tokenizers:
        tok_dir = ROOT / ".tokenizers" / name
        for w in workers:
            run = run_ours(corpus, tok_dir, OUT_DIR / "tokenize" / f"rss-{name}-w{w}", w, 0.02)
            out[f"{name}-w{w}"] = run
    return out


def report(data: dict[str, Any], workers: list[int]) -> None:
    rows = [
        [
            "tokenizer",
            "what",
            "wall med (min) s",
            "cpu s",
            "MB/s",
            "peak RSS/PSS MB",
            "vs best floor med (min)",
        ]
    ]
    size = data["bytes"] / MB
    for name, res in data["results"].items():
        floors = {k: statistics.median(v) for k, v in res["floors"].items()}
        best = min(floors.values())
        for engine, seconds in floors.items():
            rows.append(
                [
                    name,
                    f"floor {engine}",
                    f"{seconds:.3f} ({min(res['floors'][engine]):.3f})",
                    "",
                    f"{size / seconds:.0f}",
                    "",
                    f"{seconds / best:.2f}x",
                ]
            )
        for w in workers:
            for what, runs in (("CLI", res["ours"][w]), ("in-process", res["in_process"][w])):
                wall = statistics.median(r["wall"] for r in runs)
                memory = (
                    f"{max(r['rss_mb'] for r in runs):.0f}/{max(r['pss_mb'] for r in runs):.0f}"
                    if "rss_mb" in runs[0]
                    else ""
                )
                rows.append(
                    [
                        name,
                        f"tokenmill {what} --workers {w}",
                        f"{wall:.3f} ({min(r['wall'] for r in runs):.3f})",
                        f"{statistics.median(r['cpu'] for r in runs):.2f}",
                        f"{size / wall:.0f}",
                        memory,
                        f"{wall / best:.2f}x ({min(r['wall'] for r in runs) / best:.2f}x)",
                    ]
                )
        if res.get("engine_reader"):
            runs = res["engine_reader"]
            wall = statistics.median(r["wall"] for r in runs)
            rows.append(
                [
                    name,
                    "gigatoken's JSONL reader (inexact on bad lines; context)",
                    f"{wall:.3f} ({min(r['wall'] for r in runs):.3f})",
                    f"{statistics.median(r['cpu'] for r in runs):.2f}",
                    f"{size / wall:.0f}",
                    "",
                    f"{wall / best:.2f}x",
                ]
            )
        bound = res["lower_bound"]
        rows.append(
            [
                name,
                f"lower bound for any exact run ({bound['cores']} cores)",
                f"{bound['seconds']:.3f}",
                "",
                f"{size / bound['seconds']:.0f}",
                "",
                f"{bound['ratio_to_floor']:.2f}x",
            ]
        )
        if "first_use_verification_s" in res:
            rows.append(
                [
                    name,
                    "first use (verify vs transformers)",
                    f"{res['first_use_verification_s']:.1f}",
                    "",
                    "",
                    "",
                    "",
                ]
            )
    print(f"\n{size:.1f} MB, {data['documents']} documents ({data['corpus']}), load {data['load']}")
    print(table(rows))
    for name, res in data["results"].items():
        bound = res["lower_bound"]
        parts = ", ".join(
            f"{part} {v['wall']:.3f} s wall / {v['cpu']:.3f} s CPU"
            for part, v in bound["parts"].items()
        )
        print(
            f"{name} lower bound {bound['seconds']:.3f} s = max(start-up + engine + floor wall "
            f"{bound['chain_wall']:.3f} s, CPU {bound['cpu_spread_wall'] * bound['cores']:.2f} s "
            f"/ {bound['cores']} cores = {bound['cpu_spread_wall']:.3f} s); floor "
            f"{bound['floor']} {bound['floor_wall']:.3f} s wall / {bound['floor_cpu']:.3f} s "
            f"CPU; {parts}"
        )
    if data.get("dochash"):
        # the raw step's per-document hash index (tokenmill find sha256:), one core, against the
        # CPU seconds of a one-worker tokenize of the same corpus
        hashing = statistics.median(r["cpu"] for r in data["dochash"])
        for name, res in data["results"].items():
            runs = res["in_process"].get(1) or next(iter(res["in_process"].values()))
            cpu = statistics.median(r["cpu"] for r in runs)
            print(
                f"{name} document hash index: {hashing:.3f} s CPU = {100 * hashing / cpu:.1f}% "
                f"of tokenize CPU {cpu:.2f} s (goal <= 5%)"
            )
    for what, seconds in MEGATRON.items():
        print(f"Megatron {what}: {seconds} s")


def first_use_bench(args: argparse.Namespace) -> dict[str, Any]:
    """``--first-use``: per tokenizer family, fresh-cache vs cached CLI runs, alternating."""
    corpus = ensure_corpus(args.mb)

    def bundled(name: str) -> Path:
        return build_bundled_tokenizer(name, ROOT / ".tokenizers" / name)

    # Built only when asked for: a machine without the test extras has only the ones carried.
    builders = {
        "gpt2": lambda: bundled("gpt2"),
        "gpt2-nfkc": lambda: gpt2_nfkc(bundled("gpt2")),
        "qwen2-nfc": lambda: bundled("qwen2"),
        "llama2": lambda: bundled("llama2"),
    }
    names = args.first_use_tokenizers.split(",") if args.first_use_tokenizers else list(builders)
    unknown = sorted(set(names) - set(builders))
    if unknown:
        raise SystemExit(f"--first-use --tokenizers: unknown {unknown}; expected {list(builders)}")
    dirs = {name: builders[name]() for name in names}
    work = OUT_DIR / "tokenize-first-use"
    work.mkdir(parents=True, exist_ok=True)

    def run_cli(corpus: Path, tok_dir: Path, prefix: Path, env: dict[str, str]) -> dict[str, float]:
        cmd = [sys.executable, "-m", "tokenmill.cli", "tokenize", "--input", str(corpus)]
        cmd += ["--output-prefix", str(prefix), "--tokenizer", str(tok_dir), "--append-eod"]
        run = run_timed([*cmd, "--workers", str(args.workers[-1])], env=env)
        print(f"{tok_dir.name} {prefix.name}: {run['wall']:.2f} s", file=sys.stderr)
        return run

    runs = first_use_runs(dirs, corpus, work, args.repeat, ENV, run_cli)
    split = {name: child_split(tok_dir, ENV, args.repeat) for name, tok_dir in dirs.items()}
    bare = {name: reference_load(tok_dir, ENV, args.repeat) for name, tok_dir in dirs.items()}
    if args.profile:
        for name, tok_dir in dirs.items():
            print(f"wrote {profile(tok_dir, ENV, OUT_DIR / f'{args.name}-profile-{name}.txt')}")
    return {"corpus": str(corpus), "bytes": corpus.stat().st_size, "workers": args.workers[-1],
            "runs": runs, "child_split": split, "reference_load": bare}  # fmt: skip


def scaling(args: argparse.Namespace) -> dict[str, Any]:
    """``--scaling``: per tokenizer, ours vs independent runs at 1, 2, 4 ... workers."""
    corpus = ensure_corpus(args.mb)
    counts = worker_counts(args.max_workers)
    data: dict[str, Any] = {
        "cores": len(os.sched_getaffinity(0)),
        "worker_counts": counts,
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "results": {},
    }
    # $TOKENMILL_SCALING_JSON (bench/device_scaling.sh): also saved there after each count.
    extra = os.environ.get("TOKENMILL_SCALING_JSON")

    def save(name: str, result: dict[str, Any]) -> None:
        data["results"][name] = result
        if extra:
            Path(extra).write_text(json.dumps({"machine": machine(), **data}, indent=2) + "\n")

    for name in args.tokenizers:
        tok_dir = build_bundled_tokenizer(name, ROOT / ".tokenizers" / name)
        work = OUT_DIR / "tokenize-scaling" / name
        work.mkdir(parents=True, exist_ok=True)
        scaling_runs(corpus, tok_dir, work, counts, args.repeat, ENV, functools.partial(save, name))
    data["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, help="corpus MB (default 20; 200 with --scaling)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", default=f"1,{os.cpu_count() or 1}")
    parser.add_argument(
        "--tokenizers",
        help=f"default {','.join(TOKENIZERS)}; gpt2 with --scaling; "
        "gpt2,gpt2-nfkc,qwen2-nfc,llama2 with --first-use",
    )
    parser.add_argument(
        "--floors",
        default=",".join(FLOORS),
        help="floors to measure (hf and tiktoken take minutes at 200 MB; gigatoken is the best)",
    )
    parser.add_argument(
        "--rss-mb", type=float, default=0.0, help="also measure memory on this size"
    )
    parser.add_argument(
        "--name", default="tokenize", help="results file: bench/out/NAME.json (default tokenize)"
    )
    parser.add_argument(
        "--skip-first-use",
        action="store_true",
        help="skip timing the one-off verification of each tokenizer (6-11 s each)",
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="one run at --workers 1, 2, 4 ... vs as many independent --workers 1 runs",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="--scaling: the largest worker count (default: the usable cores)",
    )
    parser.add_argument(
        "--normalizers",
        action="store_true",
        help="compare normalizer tokenizers' fast path with GPT-2's and the hf path instead",
    )
    parser.add_argument(
        "--first-use",
        action="store_true",
        help="a CLI run with a fresh tokenizer cache vs the same run cached, alternating",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="--first-use: also a cProfile of each verification child (bench/out/NAME-profile-*)",
    )
    args = parser.parse_args()
    args.first_use_tokenizers = args.tokenizers  # --first-use: a subset of its four, if given
    if args.mb is None:
        args.mb = 200.0 if args.scaling else 20.0
    args.workers = sorted({int(w) for w in args.workers.split(",")})
    args.tokenizers = (args.tokenizers or ("gpt2" if args.scaling else ",".join(TOKENIZERS))).split(
        ","
    )
    args.floors = args.floors.split(",")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.scaling:
        data = scaling(args)
        report_scaling(data)
        name = args.name if args.name != "tokenize" else "tokenize-scaling"
        print(f"wrote {write_results(name, data)}")
        return
    if args.first_use:
        data = first_use_bench(args)
        print(f"{data['bytes'] / MB:.1f} MB, --workers {data['workers']}")
        print(table(report_first_use(data)))
        print(table(report_child_split(data)))
        print(f"wrote {write_results(args.name + '-first-use', data)}")
        return
    if args.normalizers:
        data = normalizer_runs(args)
        report_normalizers(data)
        print(f"wrote {write_results(args.name + '-normalizers', data)}")
        return
    data = bench(args)
    report(data, args.workers)
    if args.rss_mb:
        data["rss"] = rss_runs(args.rss_mb, args.tokenizers, args.workers)
        for key, run in data["rss"].items():
            if isinstance(run, dict):
                print(
                    f"{args.rss_mb:g} MB {key}: wall {run['wall']:.2f} s, "
                    f"peak tree RSS {run['rss_mb']:.0f} MB, PSS {run['pss_mb']:.0f} MB"
                )
    data["megatron_reference_s"] = MEGATRON
    print(f"wrote {write_results(args.name, data)}")


if __name__ == "__main__":
    main()
