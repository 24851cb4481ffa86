"""``bench_tokenize.py --first-use``: a tokenize run with a new tokenizer vs the same run cached.

For each tokenizer (GPT-2, GPT-2 with an NFKC normalizer, Qwen2-style NFC, Llama-2-style
SentencePiece + BOS), each repetition runs our CLI twice over the same corpus, alternating which
goes first: once with a fresh ``$TOKENMILL_CACHE_DIR`` (an empty folder: the run verifies the
tokenizer against transformers in a child process, the normalization study included) and once
with the cache the previous fresh run left (the verification record read back). Both report
wall and CPU seconds of the whole process tree; the first-use cost is the difference, goal
<= 2 s. Both runs' ``.bin`` must be equal. The machine's load average is recorded per pair.
Every run first removes the outputs at its prefix (manifest included): a run whose outputs are
up to date writes nothing and verifies nothing.

On a loaded machine the wall difference says little, so the verification child is also run
alone (``child_split``): the CPU seconds of its own process (the reference's side) and of its
forked helper (the engines' side), which run at once. On idle cores the child's wall is about
the larger of the two (two cores or more), which is the "idle-core estimate" reported. Beside
it, ``reference_load`` times what Megatron itself pays to load the reference (a fresh
interpreter, torch hidden as in the child, ``AutoTokenizer.from_pretrained``): transformers' own
part of a first use, which an exact check keeps (the child defers transformers' table of model
sources, so it can come in under it). ``profile``
writes a cProfile of the child's reference side (``--profile``), for machines lent too briefly
to explore.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _util import remove_outputs

RunStats = dict[str, float]
# The verification child as ``tokenizer.run_verification`` starts it, reporting its own CPU and
# its helper's (a joined child) from getrusage.
CHILD = """
import json, os, resource, sys
from tokenmill.tokenize import tokenizer, tokenizer_verify
source, definition = tokenizer.resolve_tokenizer_path(sys.argv[1])
fingerprint = tokenizer.tokenizer_fingerprint(source, definition)
tokenizer_verify.main([str(source), str(definition), fingerprint, sys.argv[2]])
me, helper = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
threads = []  # each native thread's name and CPU-s: CPU-s above wall means threads ran
for task in sorted(os.listdir("/proc/self/task")):
    with open(f"/proc/self/task/{task}/stat") as fh:
        name, rest = fh.read().rsplit(")", 1)
    ticks = sum(int(x) for x in rest.split()[11:13])
    threads.append([name.split("(", 1)[1], ticks / os.sysconf("SC_CLK_TCK")])
print(json.dumps({"reference": me.ru_utime + me.ru_stime,
                  "helper": helper.ru_utime + helper.ru_stime, "threads": threads}))
"""
# The reference alone, loaded as Megatron's HuggingFaceTokenizer does, torch hidden as in CHILD.
REFERENCE_LOAD = """
import json, resource, sys, time
sys.modules["torch"] = None
start = time.perf_counter()
from transformers import AutoTokenizer
imported = time.perf_counter()
AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
me = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"import": imported - start, "load": time.perf_counter() - imported,
                  "cpu": me.ru_utime + me.ru_stime}))
"""
# CHILD's verification under cProfile: the reference side's functions by cumulative and own time.
PROFILE = """
import cProfile, io, pstats, sys
from tokenmill.tokenize import tokenizer, tokenizer_verify
source, definition = tokenizer.resolve_tokenizer_path(sys.argv[1])
fingerprint = tokenizer.tokenizer_fingerprint(source, definition)
prof = cProfile.Profile()
prof.runcall(tokenizer_verify.main, [str(source), str(definition), fingerprint, sys.argv[2]])
text = io.StringIO()
stats = pstats.Stats(prof, stream=text)
stats.sort_stats("cumulative").print_stats(50)
stats.sort_stats("tottime").print_stats(30)
with open(sys.argv[3], "w") as fh:
    fh.write(text.getvalue())
"""
HEADER = ("tokenizer", "fresh wall s", "fresh CPU-s", "cached wall s", "cached CPU-s",
          "first use +wall s", "first use +CPU-s", "per rep +wall", "load")  # fmt: skip


def first_use_runs(
    dirs: dict[str, Path],
    corpus: Path,
    work: Path,
    repeat: int,
    env: dict[str, str],
    run_cli: Callable[[Path, Path, Path, dict[str, str]], RunStats],
) -> dict[str, Any]:
    """Alternating fresh-cache and cached CLI runs per tokenizer (see the module docstring).

    ``run_cli(corpus, tokenizer_dir, output_prefix, env)`` runs one ``tokenmill tokenize``.
    """
    out: dict[str, Any] = {}
    for name, tok_dir in dirs.items():
        rows: dict[str, list[Any]] = {"fresh": [], "cached": [], "load": []}
        with tempfile.TemporaryDirectory() as keep:
            cached_env = {**env, "TOKENMILL_CACHE_DIR": keep}
            remove_outputs(work, f"{name}-warmup")  # kept outputs would skip verifying
            run_cli(corpus, tok_dir, work / f"{name}-warmup", cached_env)  # fills the cache
            for rep in range(repeat):
                rows["load"].append(round(os.getloadavg()[0], 2))
                order = ("fresh", "cached") if rep % 2 == 0 else ("cached", "fresh")
                for kind in order:
                    remove_outputs(work, f"{name}-{kind}")  # else the run finds them up to date
                    with tempfile.TemporaryDirectory() as fresh:
                        run_env = cached_env if kind == "cached" else {
                            **env, "TOKENMILL_CACHE_DIR": fresh}  # fmt: skip
                        prefix = work / f"{name}-{kind}"
                        rows[kind].append(run_cli(corpus, tok_dir, prefix, run_env))
                a = (work / f"{name}-fresh_text_document.bin").read_bytes()
                b = (work / f"{name}-cached_text_document.bin").read_bytes()
                if a != b:
                    raise RuntimeError(f"{name}: the fresh and the cached run wrote different .bin")
        out[name] = rows
    return out


def child_split(tok_dir: Path, env: dict[str, str], repeat: int) -> dict[str, Any]:
    """The verification child alone in a fresh cache, ``repeat`` times: wall, and CPU-s of its
    reference side and of its helper (each run's numbers)."""
    runs = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cache:
            cmd = [sys.executable, "-c", CHILD, str(tok_dir), str(Path(cache) / "record.json")]
            start = time.perf_counter()
            proc = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            runs.append({"wall": time.perf_counter() - start, **json.loads(proc.stdout)})
    return {"runs": runs, "load": round(os.getloadavg()[0], 2)}


def reference_load(tok_dir: Path, env: dict[str, str], repeat: int) -> dict[str, Any]:
    """``REFERENCE_LOAD`` in a fresh interpreter, ``repeat`` times, and as many bare interpreter
    starts: wall, import and load seconds, CPU-s."""
    runs, starts = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        starts.append(time.perf_counter() - start)
        start = time.perf_counter()
        cmd = [sys.executable, "-c", REFERENCE_LOAD, str(tok_dir)]
        proc = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        runs.append({"wall": time.perf_counter() - start, **json.loads(proc.stdout)})
    return {"runs": runs, "interpreter_start": starts}


def profile(tok_dir: Path, env: dict[str, str], out: Path) -> Path:
    """A cProfile of the verification child in a fresh cache, as text at ``out``."""
    with tempfile.TemporaryDirectory() as cache:
        cmd = [sys.executable, "-c", PROFILE, str(tok_dir), str(Path(cache) / "record.json")]
        subprocess.run([*cmd, str(out)], env=env, check=True)
    return out


def report_child_split(data: dict[str, Any]) -> list[list[str]]:
    """Table rows: per tokenizer, the least CPU-s of each side over the runs (the least
    disturbed by other load), their max (the idle-core estimate) and the child's wall."""
    rows = [["tokenizer", "reference side CPU-s", "helper CPU-s", "idle-core estimate s",
             "child wall s (median)", "threads", "reference load wall s (import + load)",
             "its CPU-s", "interpreter start s", "load"]]  # fmt: skip
    for name, split in data["child_split"].items():
        ref = min(r["reference"] for r in split["runs"])
        helper = min(r["helper"] for r in split["runs"])
        wall = statistics.median(r["wall"] for r in split["runs"])
        others = [cpu for r in split["runs"] for _, cpu in r["threads"][1:]]
        threads = f"{len(split['runs'][0]['threads'])}, others {max(others, default=0):.2f} CPU-s"
        bare = data.get("reference_load", {}).get(name)
        if bare:
            med = {k: statistics.median(r[k] for r in bare["runs"]) for k in bare["runs"][0]}
            load = f"{med['wall']:.2f} ({med['import']:.2f} + {med['load']:.2f})"
            extra = [load, f"{med['cpu']:.2f}", f"{min(bare['interpreter_start']):.2f}"]
        else:
            extra = ["", "", ""]
        rows.append([name, f"{ref:.2f}", f"{helper:.2f}", f"{max(ref, helper):.2f}",
                     f"{wall:.2f}", str(threads), *extra, str(split["load"])])  # fmt: skip
    return rows


def report_first_use(data: dict[str, Any]) -> list[list[str]]:
    """Table rows: medians of each side and of the per-repetition differences."""
    rows = [list(HEADER)]
    for name, r in data["runs"].items():
        med = {
            k: {m: statistics.median(x[m] for x in r[k]) for m in ("wall", "cpu")}
            for k in ("fresh", "cached")
        }
        diffs = [f["wall"] - c["wall"] for f, c in zip(r["fresh"], r["cached"], strict=True)]
        cpu_diffs = [f["cpu"] - c["cpu"] for f, c in zip(r["fresh"], r["cached"], strict=True)]
        rows.append(
            [
                name,
                f"{med['fresh']['wall']:.2f}",
                f"{med['fresh']['cpu']:.2f}",
                f"{med['cached']['wall']:.2f}",
                f"{med['cached']['cpu']:.2f}",
                f"{statistics.median(diffs):.2f}",
                f"{statistics.median(cpu_diffs):.2f}",
                " ".join(f"{d:.2f}" for d in diffs),
                f"{min(r['load'])}-{max(r['load'])}",
            ]
        )
    return rows
