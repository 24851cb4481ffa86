"""First-use verification of a tokenizer against transformers, in a child process.

``python -m tokenmill.tokenize.tokenizer_verify SOURCE DEFINITION FINGERPRINT RECORD`` loads the
reference, checks that its class passes text straight to its ``tokenizers`` backend, takes the
effective backend definition (transformers may rewrite it on load), runs the probe set through
the reference and every engine as a run would (a Unicode-form normalizer removed from a copy and
applied by Python, behind the guard) and writes the verdicts to RECORD. The child keeps
transformers and thread pools out of the tokenizing process and hides torch (``hide_torch``);
while it loads the reference, a forked helper does the engines' part on the definition on disk
(``Speculation``), kept when the reference loads exactly that definition (docs/performance.md).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from tokenmill.atomic import write_bytes, write_json
from tokenmill.errors import ConfigError
from tokenmill.tokenize.engines import ENCODERS, Encoder, flatten, hide_torch, load_reference
from tokenmill.tokenize.tokenizer import CACHE_VERSION, _library_versions, first_mismatch
from tokenmill.tokenize.tokenizer_guard import (
    normalization_differences,
    to_ranges,
    unassigned_mask,
    unicode_form,
)
from tokenmill.tokenize.tokenizer_info import RankFiles, TokenizerInfo
from tokenmill.tokenize.tokenizer_probes import probe_texts, probes_digest
from tokenmill.tokenize.tokenizer_ranks import write_rank_files

# Methods on the path from ``tokenizer(text)`` to the backend; a subclass overriding one may
# change the ids, so only the transformers engine can reproduce it.
CALL_PATH = (
    "__call__",
    "_call_one",
    "encode_plus",
    "_encode_plus",
    "batch_encode_plus",
    "_batch_encode_plus",
    "prepare_for_tokenization",
)
BACKEND_MODULES = (
    "transformers.tokenization_utils_tokenizers",
    "transformers.tokenization_utils_fast",
)


def passthrough_problem(tok: Any) -> str | None:
    """Why ``tok(text)`` might not equal its backend's ``encode`` (None if it provably does)."""
    mro = type(tok).__mro__
    backend = next((i for i, k in enumerate(mro) if k.__module__ in BACKEND_MODULES), None)
    if backend is None:
        return f"{type(tok).__name__} has no tokenizers backend (a slow tokenizer)"
    for klass in mro[:backend]:
        overridden = [name for name in CALL_PATH if name in vars(klass)]
        if overridden:
            return f"{klass.__name__} overrides {', '.join(overridden)}"
    return None


def template_ids(pp: dict[str, Any] | None) -> tuple[list[int], list[int]] | None:
    """Ids a post-processor puts before/after one sequence; None when it does something else."""
    if not pp or pp.get("type") == "ByteLevel":
        return [], []
    kind = pp.get("type")
    if kind == "Sequence":
        pre: list[int] = []
        suf: list[int] = []
        for sub in pp.get("processors", []):
            ids = template_ids(sub)
            if ids is None:
                return None
            pre, suf = ids[0] + pre, suf + ids[1]
        return pre, suf
    if kind in ("BertProcessing", "RobertaProcessing"):
        return [int(pp["cls"][1])], [int(pp["sep"][1])]
    if kind != "TemplateProcessing":
        return None
    pre, suf, seen = [], [], False
    for item in pp.get("single", []):
        if "Sequence" in item and item["Sequence"].get("id") == "A" and not seen:
            seen = True
        elif "SpecialToken" in item:
            ids = pp["special_tokens"][item["SpecialToken"]["id"]]["ids"]
            (suf if seen else pre).extend(int(i) for i in ids)
        else:
            return None
    return (pre, suf) if seen else None


def _disk_definition(definition: Path) -> dict[str, Any]:
    """The definition file, parsed, without its truncation and padding (a call sets its own)."""
    spec = orjson.loads(definition.read_bytes())
    spec["truncation"] = spec["padding"] = None
    return spec


def _effective_definition(
    tok: Any, definition: Path, record_path: Path
) -> tuple[dict[str, Any] | None, str | None]:
    """``(spec, name)``: the backend as loaded (None when it serializes to the file's exact bytes:
    not parsed, 0.6 s for a 151k vocabulary), and its copy's name when it differs from the file."""
    text = tok.backend_tokenizer.to_str(pretty=True)
    if text.encode() == definition.read_bytes():
        return None, None
    effective = orjson.loads(text)
    effective["truncation"] = effective["padding"] = None
    if effective == _disk_definition(definition):
        return effective, None
    name = record_path.with_suffix(".tokenizer.json").name
    write_bytes(record_path.parent / name, orjson.dumps(effective))
    return effective, name


def _hf_definition(spec: dict[str, Any], record_path: Path) -> str | None:
    """A copy with ``"a b"`` merges, which ``tokenizers`` loads about 2x faster than pairs; only
    for BPE whose merge parts hold no space, where both spellings mean the same merges."""
    merges = (spec.get("model") or {}).get("merges") or []
    if not merges or not all(isinstance(m, list) and len(m) == 2 for m in merges):
        return None
    joined = [" ".join(m) for m in merges]
    if "".join(joined).count(" ") != len(joined):  # a part with a space of its own
        return None
    fast = dict(spec, model=dict(spec["model"], merges=joined))
    name = record_path.with_suffix(".hf.json").name
    write_bytes(record_path.parent / name, orjson.dumps(fast))
    return name


@dataclass
class EngineSide:
    """What verification writes and runs for the engines from the effective definition: its
    copies, ranks and guard, and each engine's ids on the probes (or why it is not used)."""

    hf_definition: str | None
    fast: str | None
    form: str | None
    ranks: RankFiles | None
    guard: dict[str, Any]
    around: tuple[list[int], list[int]] | None  # template_ids of the post-processor
    max_id: int | None  # the largest id in the definition, when its vocabulary is a dict or list
    probes: str  # probes_digest of the probe set it ran
    outputs: dict[str, tuple[np.ndarray, np.ndarray] | str]


def engine_side(
    spec: dict[str, Any],
    source: Path,
    definition: Path,
    fingerprint: str,
    record_path: Path,
    split: bool,
    probes: list[str] | None = None,
) -> EngineSide:
    """Write the engines' files for ``spec`` and run every engine on the probes (``probes``, or
    the set for ``spec``'s added tokens), as a tokenize run would (behind the guard, routed probes
    to the ``hf`` engine run before)."""
    hf_definition = _hf_definition(spec, record_path)
    around = template_ids(spec.get("post_processor"))
    specials = [t["content"] for t in spec.get("added_tokens") or []]
    probes = probe_texts(specials) if probes is None else probes
    form = unicode_form(spec.get("normalizer"))
    fast_spec, fast = spec, None
    if form is not None:
        fast_spec, fast = dict(spec, normalizer=None), record_path.with_suffix(".fast.json").name
        write_bytes(record_path.parent / fast, orjson.dumps(fast_spec))
    try:
        ranks: RankFiles | None = write_rank_files(fast_spec, record_path)
        no_ranks = None
    except ConfigError as exc:
        ranks, no_ranks = None, f"not used: no tiktoken form: {exc}"
    differences = _normalization_study(form, record_path.parent) if form else []
    unassigned = np.flatnonzero(unassigned_mask())
    guard = {
        "specials": specials,
        "ranges": to_ranges(np.concatenate([unassigned, np.array(differences, dtype=np.int64)])),
        "unidata_version": unicodedata.unidata_version,
        "normalization_differences": differences,
    }
    info = TokenizerInfo(  # what the engines read; the reference's facts are not needed here
        source=source,
        definition=definition,
        fingerprint=fingerprint,
        vocab_size=0,
        max_id=0,
        eod_id=None,
        prefix_ids=tuple(around[0]) if around else (),
        suffix_ids=tuple(around[1]) if around else (),
        verdicts={},
        record_path=record_path,
        split_special_tokens=split,
        ranks=ranks,
        hf_definition=record_path.parent / hf_definition if hf_definition else None,
        normalizer=form,
        fast_definition=record_path.parent / fast if fast else None,
        specials=tuple(specials),
        guard_ranges=tuple(guard["ranges"]),
    )
    outputs: dict[str, tuple[np.ndarray, np.ndarray] | str] = {}
    loaded: dict[str, Encoder] = {}
    for name in ("hf", "gigatoken", "tiktoken"):
        if name != "hf" and (split or around is None):
            outputs[name] = "not used: split_special_tokens or an unsupported post-processor"
        elif name == "tiktoken" and no_ranks:
            outputs[name] = no_ranks
        else:
            outputs[name] = _run_engine(name, info, probes, loaded)
    vocab = (spec.get("model") or {}).get("vocab")  # what get_vocab() holds: the model's ids
    ids = [int(t["id"]) for t in spec.get("added_tokens") or []]  # and the added tokens'
    if isinstance(vocab, dict):
        ids += vocab.values()
    elif isinstance(vocab, list):  # Unigram: a token's id is its position
        ids += range(len(vocab))[-1:]
    max_id = max(ids) if ids and isinstance(vocab, dict | list) else None
    return EngineSide(
        hf_definition, fast, form, ranks, guard, around, max_id, probes_digest(probes), outputs
    )


def _engine_side_child(args: tuple[Any, ...], conn: Any) -> None:
    """Forked helper: ``engine_side`` on the definition file as it is on disk, sent back."""
    try:
        source, definition, fingerprint, record_path = args
        spec = _disk_definition(definition)
        conn.send(engine_side(spec, source, definition, fingerprint, record_path, False))
    except Exception as exc:  # the parent then does the work itself
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


class Speculation:
    """``engine_side`` for the definition on disk, forked while this process loads the reference
    (no wall time on two cores); used when the reference loads exactly that definition."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        context = multiprocessing.get_context("fork")
        self._conn, child = context.Pipe(duplex=False)
        self._proc = context.Process(target=_engine_side_child, args=(args, child), daemon=True)
        self._proc.start()
        child.close()

    def result(self) -> EngineSide | None:
        """Wait for the helper (it writes the files this process would): its result, or None."""
        try:
            answer = self._conn.recv()
        except EOFError:
            answer = None
        finally:
            self._conn.close()
            self._proc.join()
        return answer if isinstance(answer, EngineSide) else None

    def close(self) -> None:
        """End an untaken helper with SIGKILL: it may block sending a result nobody reads, and
        would hold up this process's exit, which joins its children."""
        self._conn.close()
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()


def verify_tokenizer(
    source: Path, definition: Path, fingerprint: str, record_path: Path
) -> dict[str, Any]:
    """Run the reference and every engine on the probe set; return the record to cache."""
    speculation = Speculation((source, definition, fingerprint, record_path))
    try:
        tok = load_reference(source)
        problem = passthrough_problem(tok)
        split = bool(getattr(tok, "split_special_tokens", False))
        added = tok.backend_tokenizer.get_added_tokens_decoder()
        probes = probe_texts([added[i].content for i in sorted(added)])
        expected = flatten(tok(probes).input_ids)
        spec, effective = _effective_definition(tok, definition, record_path)
        side = guess = speculation.result()
    finally:
        speculation.close()
    if side is None or effective is not None or split or side.probes != probes_digest(probes):
        engines_reads = record_path.parent / effective if effective else definition
        spec = _disk_definition(definition) if spec is None else spec
        side = engine_side(spec, source, engines_reads, fingerprint, record_path, split, probes)
        if guess is not None:  # the guess's copies that this record does not name
            for name in {guess.hf_definition, guess.fast} - {side.hf_definition, side.fast}:
                if name is not None:
                    (record_path.parent / name).unlink(missing_ok=True)
            if guess.ranks is not None and side.ranks is None:
                guess.ranks.ranks.unlink(missing_ok=True)
                guess.ranks.ids.unlink(missing_ok=True)
    verdicts: dict[str, str] = {}
    for name, out in side.outputs.items():
        if problem:
            verdicts[name] = f"not used: {problem}"
        elif isinstance(out, str):
            verdicts[name] = out
        else:
            mismatch = first_mismatch(probes, expected, out)
            verdicts[name] = (
                "ok" if mismatch is None else f"mismatch on probe {mismatch[0]}: {mismatch[1]}"
            )
    verdicts["transformers"] = "ok"
    ranks, around = side.ranks, side.around
    return {
        "fingerprint": fingerprint,
        "libraries": _library_versions(),
        "cache_version": CACHE_VERSION,
        "reference": f"transformers {type(tok).__name__} from {source}",
        "vocab_size": len(tok),
        "max_id": max(tok.get_vocab().values()) if side.max_id is None else side.max_id,
        "eod_id": tok.eos_token_id,
        "prefix_ids": list(around[0]) if around else [],
        "suffix_ids": list(around[1]) if around else [],
        "split_special_tokens": split,
        "effective_definition": effective,
        "hf_definition": side.hf_definition,
        "ranks": None
        if ranks is None
        else {**asdict(ranks), "ranks": ranks.ranks.name, "ids": ranks.ids.name},
        "verdicts": verdicts,
        "normalizer": side.form,
        "fast_definition": side.fast,
        "guard": side.guard,
        "probes": {
            "texts": len(probes),
            "chars": sum(map(len, probes)),
            "sha256": probes_digest(probes),
        },
    }


def _normalization_study(form: str, folder: Path) -> list[int]:
    """``normalization_differences(form)`` (0.8 s), cached beside the records by form and Unicode
    versions: it does not depend on the tokenizer."""
    key = f"{form}-{unicodedata.unidata_version}-tokenizers-{_library_versions()['tokenizers']}"
    path = folder / f"normalization-{key}.json"
    try:
        return [int(c) for c in orjson.loads(path.read_bytes())]
    except (OSError, ValueError, TypeError):
        found = normalization_differences(form)
        write_bytes(path, orjson.dumps(found))
        return found


def _run_engine(
    name: str, info: TokenizerInfo, probes: list[str], loaded: dict[str, Encoder]
) -> tuple[np.ndarray, np.ndarray] | str:
    """The engine's ids on the probes as in a run (its guard routing to the ``hf`` engine already
    in ``loaded``), or why not."""
    try:
        encoder = loaded[name] = ENCODERS[name](info)
        if encoder.guarded and "hf" in loaded:
            encoder._reference = loaded["hf"]
        return encoder.encode(probes)
    except Exception as exc:  # any load/encode failure just rules the engine out
        return f"not used: {type(exc).__name__}: {exc}"


def main(argv: list[str]) -> int:
    """Child entry point: verify and write the record atomically."""
    hide_torch()
    source, definition, fingerprint, record = argv
    record_path = Path(record)
    record_path.parent.mkdir(parents=True, exist_ok=True)
    result = verify_tokenizer(Path(source), Path(definition), fingerprint, record_path)
    write_json(record_path, result)
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the record is written and synced; tearing down transformers took 0.2 s
