"""``bench_tokenize.py --first-use``: a tokenize run with a new tokenizer vs the same run cached.

For each tokenizer (GPT-2, GPT-2 with an NFKC normalizer, Qwen2-style NFC, Llama-2-style
SentencePiece + BOS), each repetition runs our CLI twice over the same corpus, alternating which
goes first: once with a fresh ``$TOKENMILL_CACHE_DIR`` (an empty folder: the run verifies the
tokenizer against transformers in a child process, the normalization study included) and once
with the cache the previous fresh run left (the verification record read back). Both report
wall and CPU seconds of the whole process tree; the first-use cost is the difference, goal
<= 2 s. Both runs' ``.bin`` must be equal. The machine's load average is recorded per pair.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

RunStats = dict[str, float]
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
            run_cli(corpus, tok_dir, work / f"{name}-warmup", cached_env)  # fills the cache
            for rep in range(repeat):
                rows["load"].append(round(os.getloadavg()[0], 2))
                order = ("fresh", "cached") if rep % 2 == 0 else ("cached", "fresh")
                for kind in order:
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
