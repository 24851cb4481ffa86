"""Small helpers several test folders share (imported as ``_helpers``; tests/ is on the path)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

# megatron-core's five training-input flags, the keywords of ``get_training_batch``.
FLAGS = (
    "reset_position_ids",
    "reset_attention_mask",
    "eod_mask_loss",
    "create_attention_mask",
    "inter_document_masking",
)
# Every combination of the five flags: 32 keyword dicts.
FLAG_COMBOS = [
    dict(zip(FLAGS, bits, strict=True)) for bits in itertools.product((False, True), repeat=5)
]

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as ``bench_<name>`` (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def corrupt_gigatoken(
    monkeypatch: pytest.MonkeyPatch,
    cache: Path,
    hit: Callable[[str], bool] = lambda t: "MAGIC" in t,
) -> None:
    """Make the gigatoken engine wrong on purpose: the last id of every document ``hit`` picks is
    dropped. The verification cache moves to a copy in ``cache`` first, so that no verdict this
    corrupt engine earns outlives the test."""
    from tokenmill.tokenize.tokenizer import GigatokenEncoder

    shutil.copytree(os.environ["TOKENMILL_CACHE_DIR"], cache)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache))
    real = GigatokenEncoder._encode_flat

    def corrupt(self: Any, texts: list[str], threads: bool) -> tuple[np.ndarray, np.ndarray]:
        flat, lengths = real(self, texts, threads)
        picked = np.array([hit(t) for t in texts], dtype=bool)
        if picked.any():
            keep = np.ones(flat.size, dtype=bool)
            keep[np.cumsum(lengths)[picked] - 1] = False
            flat, lengths = flat[keep], lengths - picked
        return flat, lengths

    monkeypatch.setattr(GigatokenEncoder, "_encode_flat", corrupt)


@functools.cache
def reference_tokenizer(path: Path) -> Any:
    """What Megatron's HuggingFaceTokenizer wraps: transformers' ``AutoTokenizer`` of ``path``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def stop_group(process: subprocess.Popen[bytes], term_seconds: float = 60) -> None:
    """SIGTERM to the process group led by ``process.pid``; SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, term_seconds), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant, as an OOM kill of its group would. Each process is
    stopped first, so none can fork a child (a compute-log ``tail``, a worker) that the kill
    would miss and that would keep the run going or hold its output pipe open."""
    import psutil

    frozen: dict[int, psutil.Process] = {}
    frontier = [psutil.Process(pid)]
    while frontier:
        for process in frontier:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.suspend()
            frozen[process.pid] = process
        found: list[psutil.Process] = []
        for process in list(frozen.values()):
            with contextlib.suppress(psutil.NoSuchProcess):
                found += [c for c in process.children() if c.pid not in frozen]
        frontier = found
    for process in frozen.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


@contextmanager
def process_group(
    command: list[str], *, cwd: Path, env: dict[str, str], log: Path, term_seconds: float = 60
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` leading a session of its own, its output to ``log``; its whole process group
    stopped on exit (``stop_group``)."""
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process
    finally:
        stop_group(process, term_seconds)


# The annotation of pytest's ``capsys`` fixture.
Capture = pytest.CaptureFixture[str]
