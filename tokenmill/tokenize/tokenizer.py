"""Tokenizer records: what a local HF tokenizer is and which engines reproduce its reference ids.

The reference is Megatron's ``HuggingFaceTokenizer`` path,
``AutoTokenizer.from_pretrained(dir)(text).input_ids``. This module owns the tokenizer's identity
(path, fingerprint) and its verification record (``TokenizerInfo``), written on first use per
fingerprint and library versions by a child (``tokenmill.tokenize.tokenizer_verify``) and cached
under ``$TOKENMILL_CACHE_DIR``, so later runs never import transformers. A run's disagreement
with the reference on its own documents is recorded here and demotes the engine for good. The
engines (``tokenmill.tokenize.engines``) are importable from here too.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import write_json
from tokenmill.errors import ConfigError, TokenmillError
from tokenmill.tokenize.engines import ENCODERS as ENCODERS  # the engines, importable from here
from tokenmill.tokenize.engines import Encoder as Encoder
from tokenmill.tokenize.engines import GigatokenEncoder as GigatokenEncoder
from tokenmill.tokenize.engines import HFEncoder as HFEncoder
from tokenmill.tokenize.engines import TiktokenEncoder as TiktokenEncoder
from tokenmill.tokenize.engines import TransformersEncoder as TransformersEncoder
from tokenmill.tokenize.engines import load_encoder as load_encoder
from tokenmill.tokenize.engines import load_reference as load_reference
from tokenmill.tokenize.engines import pack_flat as pack_flat
from tokenmill.tokenize.engines import reference_encoder as reference_encoder
from tokenmill.tokenize.tokenizer_guard import CLASSES
from tokenmill.tokenize.tokenizer_info import ENGINES as ENGINES
from tokenmill.tokenize.tokenizer_info import RankFiles as RankFiles
from tokenmill.tokenize.tokenizer_info import TokenizerInfo as TokenizerInfo

CACHE_VERSION = 4  # bump when the probes or the record layout change
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
VERIFIER = "tokenmill.tokenize.tokenizer_verify"  # the verification child's module
# Modules whose thread pools or state a forked verification child must not inherit.
FORK_BLOCKERS = ("gigatoken", "tiktoken", "tokenizers", "transformers", "torch")


def cache_dir() -> Path:
    """Where verification records live: ``$TOKENMILL_CACHE_DIR`` or ``~/.cache/tokenmill``."""
    env = os.environ.get("TOKENMILL_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenmill"


def resolve_tokenizer_path(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``(source, tokenizer.json)`` for a save_pretrained directory or a tokenizer.json file."""
    p = Path(path)
    if p.is_file() and p.name == "tokenizer.json" and (p.parent / CONFIG_FILES[0]).is_file():
        p = p.parent
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise ConfigError(
                f"tokenizer {p}: no tokenizer.json in the directory; save a fast tokenizer with "
                "save_pretrained (tokenmill reads tokenizer.json + tokenizer_config.json)"
            )
        return p, p / "tokenizer.json"
    if p.is_file():
        return p, p
    raise ConfigError(
        f"tokenizer {p}: no such file or directory: not a local directory or tokenizer.json "
        "(a hub name such as 'gpt2' is not one: tokenmill never downloads; build one offline "
        "with `make tokenizers` or save one with save_pretrained)"
    )


def tokenizer_fingerprint(source: Path, definition: Path) -> str:
    """sha256 over tokenizer.json and the config files that change how transformers loads it."""
    h = hashlib.sha256(b"tokenizer.json\0")
    h.update(definition.read_bytes())
    for name in CONFIG_FILES if source.is_dir() else ():
        cfg = source / name
        if cfg.is_file():
            try:
                data = json.loads(cfg.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                raise ConfigError(f"tokenizer {cfg}: not valid JSON ({exc!r})") from exc
            if isinstance(data, dict):
                data.pop("chat_template", None)
            h.update(f"\0{name}\0".encode() + json.dumps(data, sort_keys=True).encode())
    return h.hexdigest()


def _library_versions() -> dict[str, str]:
    """Installed versions of the engines, read from their ``*.dist-info`` folder names
    (``importlib.metadata`` answers the same but costs a noticeable import on every run)."""
    out = {}
    for dist in ("gigatoken", "tiktoken", "tokenizers", "transformers"):
        spec = importlib.util.find_spec(dist)
        origin = Path(spec.origin).parent if spec and spec.origin else None
        infos = sorted(origin.parent.glob(f"{dist}-*.dist-info")) if origin else []
        if infos:
            out[dist] = infos[-1].name[len(dist) + 1 : -len(".dist-info")]
        else:
            from importlib import metadata

            try:
                out[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                out[dist] = "absent"
    return out


def _cached_record(
    path: str | os.PathLike[str],
) -> tuple[Path, Path, str, Path, dict[str, Any] | None]:
    """``(source, definition, fingerprint, record path, record)`` of a tokenizer: the record
    of its verification in the cache, None when it was not verified here yet."""
    source, definition = resolve_tokenizer_path(path)
    fingerprint = tokenizer_fingerprint(source, definition)
    versions = {**_library_versions(), "unicodedata": unicodedata.unidata_version}
    key_src = json.dumps([fingerprint, versions, CACHE_VERSION], sort_keys=True)
    record_path = (
        cache_dir() / "tokenizers" / f"{hashlib.sha256(key_src.encode()).hexdigest()}.json"
    )
    return source, definition, fingerprint, record_path, _read_record(record_path, fingerprint)


def inspect_tokenizer(path: str | os.PathLike[str]) -> TokenizerInfo:
    """Facts and engine verdicts for a tokenizer; verifies it (once, cached) when needed."""
    source, definition, fingerprint, record_path, record = _cached_record(path)
    if record is None:
        run_verification(source, definition, fingerprint, record_path)
        record = _read_record(record_path, fingerprint)
        if record is None:
            raise TokenmillError(f"tokenizer {source}: verification wrote no record {record_path}")
    ranks = record.get("ranks")
    guard = record.get("guard") or {}

    def beside(key: str) -> Path | None:
        """The cached file the record names under ``key``, if any."""
        return record_path.parent / record[key] if record.get(key) else None

    return TokenizerInfo(
        source=source,
        definition=beside("effective_definition") or definition,
        fingerprint=fingerprint,
        vocab_size=int(record["vocab_size"]),
        max_id=int(record["max_id"]),
        eod_id=record["eod_id"],
        prefix_ids=tuple(record["prefix_ids"]),
        suffix_ids=tuple(record["suffix_ids"]),
        verdicts=dict(record["verdicts"]),
        record_path=record_path,
        split_special_tokens=bool(record["split_special_tokens"]),
        hf_definition=beside("hf_definition"),
        ranks=None
        if ranks is None
        else RankFiles(
            ranks=record_path.parent / ranks["ranks"],
            ids=record_path.parent / ranks["ids"],
            pattern=ranks["pattern"],
            scheme=ranks["scheme"],
            specials=tuple(ranks["specials"]),
        ),
        normalizer=record.get("normalizer"),
        fast_definition=beside("fast_definition"),
        specials=tuple(guard.get("specials", ())),
        guard_ranges=tuple((int(a), int(b)) for a, b in guard.get("ranges", ())),
    )


def run_verification(source: Path, definition: Path, fingerprint: str, record_path: Path) -> None:
    """Verify in a child process and wait; TokenmillError with its output's tail if it fails.
    A process with no thread of its own and no engine or transformers loaded forks the child (no
    interpreter start: 0.15 s); any other starts a new interpreter, as forking threads is unsafe."""
    argv = [str(source), str(definition), fingerprint, str(record_path)]
    with tempfile.TemporaryFile() as output:  # the child's stdout and stderr
        if threading.active_count() == 1 and not any(m in sys.modules for m in FORK_BLOCKERS):
            status = _forked_verification(argv, output.fileno())
        else:
            cmd = [sys.executable, "-m", VERIFIER, *argv]
            status = subprocess.run(cmd, stdout=output, stderr=output, check=False).returncode
        if status != 0:
            output.seek(0)
            tail = output.read().decode(errors="replace").strip().splitlines()[-5:]
            raise TokenmillError(
                f"tokenizer {source}: verification against transformers failed "
                f"(exit {status}): {' | '.join(tail)}"
            )


def _forked_verification(argv: list[str], output: int) -> int:
    """``python -m tokenmill.tokenize.tokenizer_verify *argv`` run by ``runpy`` in a forked child
    (the same entry code as in a new interpreter) writing to ``output``; its exit code."""
    sys.stdout.flush()  # else the child would write what this process had buffered
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's frames
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller ends it (below)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the handler the caller set
            os.dup2(output, 1)
            os.dup2(output, 2)
            sys.argv = ["tokenizer_verify", *argv]
            runpy.run_module(VERIFIER, run_name="__main__", alter_sys=True)  # exits by itself
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # reached only when the module failed before its own exit
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except BaseException:  # interrupted: end the child, as subprocess.run would
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise


def _read_record(path: Path, fingerprint: str) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable: the record is rebuilt
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != fingerprint:
        return None
    return record


def record_mismatch(info: TokenizerInfo, engine: str, reason: str) -> None:
    """Demote ``engine`` for this tokenizer after it disagreed with the reference on real input."""
    record = _read_record(info.record_path, info.fingerprint)
    if record is not None:
        record["verdicts"][engine] = f"mismatch on input: {reason}"
        write_json(info.record_path, record)
    info.verdicts[engine] = f"mismatch on input: {reason}"


def first_mismatch(
    texts: list[str], expected: tuple[np.ndarray, np.ndarray], got: tuple[np.ndarray, np.ndarray]
) -> tuple[int, str] | None:
    """``(index, description)`` of the first text whose ``(flat, lengths)`` ids differ."""
    ends_e, ends_g = np.cumsum(expected[1]), np.cumsum(got[1])
    for i, text in enumerate(texts):
        a = expected[0][ends_e[i] - expected[1][i] : ends_e[i]]
        b = got[0][ends_g[i] - got[1][i] : ends_g[i]]
        if a.shape != b.shape or not np.array_equal(a, b):
            n = min(len(a), len(b))
            diff = np.flatnonzero(a[:n] != b[:n])
            k = int(diff[0]) if diff.size else n
            return i, (
                f"{text[:40]!r}...: token {k} is {b[k : k + 3].tolist()}, reference has "
                f"{a[k : k + 3].tolist()} ({len(b)} vs {len(a)} tokens)"
            )
    return None


def load_tokenizer(path: str | os.PathLike[str], *, engine: str = "auto") -> Encoder:
    """Inspect (verify once, cached) and load a tokenizer with its fastest exact engine."""
    return load_encoder(inspect_tokenizer(path), engine)


def verification_summary(
    encoder: Encoder, *, sample_documents: int, sample_chars: int, sampled: bool
) -> dict[str, Any]:
    """What a run's ids were checked against, for its manifest: the engine, its verdict on the
    probe set, the run's sample, the guard and how many documents it sent to the reference.
    Nothing in it names a path or a time (manifests of the same inputs are byte-identical)."""
    info = encoder.info
    record = _read_record(info.record_path, info.fingerprint) or {}
    guard = record.get("guard") or {}
    reference = "hf" if info.verdicts.get("hf") == "ok" else "transformers"
    summary: dict[str, Any] = {
        "engine": encoder.name,
        "reference": str(record.get("reference", "")).split(" from ")[0],
        "libraries": record.get("libraries"),
        "probes": {**(record.get("probes") or {}), "verdict": info.verdicts.get(encoder.name)},
        "sample": {"documents_per_input": sample_documents, "chars_per_document": sample_chars}
        if sampled
        else None,
        "normalizer": None
        if info.normalizer is None or not encoder.guarded
        else {"form": info.normalizer, "by": f"unicodedata {guard.get('unidata_version')}"},
        "guard": None,
    }
    if encoder.guarded:
        summary["guard"] = {
            "documents": "every",
            "classes": {
                "special_token": f"{len(info.specials)} added-token strings",
                "code_point": f"{len(info.guard_ranges)} code-point ranges: unassigned in "
                f"unicodedata {guard.get('unidata_version')}, and "
                f"{len(guard.get('normalization_differences') or ())} normalization differences",
            },
            "reference_engine": reference,
            "routed_documents": {k: int(encoder.routed.get(k, 0)) for k in CLASSES},
        }
    return summary
