"""Local HF tokenizers, encoded by the fastest engine verified (on a probe set, then on each run's
sample, behind a per-document guard) to give the reference ids.

The reference is what Megatron's ``HuggingFaceTokenizer`` path computes:
``AutoTokenizer.from_pretrained(dir)(text).input_ids`` (transformers). Engines, fastest first:
``gigatoken`` (Rust), ``tiktoken`` (ranks built from a byte-level BPE ``tokenizer.json``), ``hf``
(the ``tokenizers`` backend transformers itself calls) and ``transformers`` (the reference).

On first use of a tokenizer (per fingerprint and library versions) a child process imports
transformers, checks that the tokenizer class calls its ``tokenizers`` backend unchanged, reads
the effective definition and the facts Megatron uses (``len(tokenizer)``, ``eos_token_id``), and
runs every engine on a fixed probe set (unicode, whitespace, CRLF, emoji, NFKC-sensitive text,
digits, code, long words, every added token written literally, a sweep of code points). The
verdicts are cached under ``$TOKENMILL_CACHE_DIR`` (default ``~/.cache/tokenmill``), so later runs
never import transformers (seconds); runs still compare the engine on their own first documents
(``tokenmill.tokenize.run``) and record a disagreement here, which demotes the engine for good.

A tokenizer whose only normalizer is a Unicode form (NFC, NFKC, ...) runs on the fast engines
through a copy without the normalizer, its texts normalized by Python's ``unicodedata`` first.
The fast engines are guarded (``tokenmill.tokenize.tokenizer_guard``): every document of a class
where they could differ from the reference (an added token's string in the text, a code point whose
handling depends on the Unicode version) is encoded by the reference engine instead, counted
in ``Encoder.routed``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import write_json
from tokenmill.errors import ConfigError, TokenmillError
from tokenmill.formats.indexed import optimal_dtype
from tokenmill.tokenize import _batching
from tokenmill.tokenize.tokenizer_guard import CLASSES, Guard

ENGINES = ("gigatoken", "tiktoken", "hf", "transformers")
CACHE_VERSION = 4  # bump when the probes or the record layout change
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def cache_dir() -> Path:
    """Where verification records live: ``$TOKENMILL_CACHE_DIR`` or ``~/.cache/tokenmill``."""
    env = os.environ.get("TOKENMILL_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenmill"


@dataclass(frozen=True)
class RankFiles:
    """A byte-level BPE written as tiktoken-style ranks at verification (cached beside it).

    ``ranks`` holds ``base64 rank`` lines with dense ranks ``0..N-1`` in id order; ``ids`` (.npy)
    maps a rank to its id, specials taking ranks ``N..`` in ``specials`` order.
    """

    ranks: Path
    ids: Path
    pattern: str
    scheme: str | None  # gigatoken's built-in pre-tokenizer for ``pattern``, when it has one
    specials: tuple[str, ...]


@dataclass(frozen=True)
class TokenizerInfo:
    """What a run needs to know about a tokenizer, from its cached verification record."""

    source: Path
    definition: Path
    fingerprint: str
    vocab_size: int
    max_id: int
    eod_id: int | None
    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    verdicts: dict[str, str] = field(hash=False)
    record_path: Path
    split_special_tokens: bool = False
    ranks: RankFiles | None = None
    hf_definition: Path | None = None  # same definition, faster for ``tokenizers`` to load
    normalizer: str | None = None  # Unicode form the fast engines' texts get from Python
    fast_definition: Path | None = None  # the definition without that normalizer
    specials: tuple[str, ...] = ()  # added tokens' strings: the guard's special_token class
    guard_ranges: tuple[tuple[int, int], ...] = ()  # the guard's code_point class

    def guard(self) -> Guard:
        """The per-document guard of the fast engines for this tokenizer."""
        return Guard(self.specials, self.guard_ranges, self.normalizer)

    @property
    def dtype(self) -> np.dtype:
        """Megatron's token dtype for ``len(tokenizer)``: uint16 below 65500, else int32."""
        return np.dtype(optimal_dtype(self.vocab_size))

    def usable_engines(self) -> list[str]:
        """Engines that reproduced the reference, fastest first (``transformers`` always)."""
        return [e for e in ENGINES if self.verdicts.get(e) == "ok"]


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
    raise ConfigError(f"tokenizer {p}: no such file or directory")


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
    """Installed versions of the engines, read from their ``*.dist-info`` folder names.

    (``importlib.metadata`` answers the same but costs a noticeable import on every run.)
    """
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


def inspect_tokenizer(path: str | os.PathLike[str]) -> TokenizerInfo:
    """Facts and engine verdicts for a tokenizer; verifies it (once, cached) when needed."""
    source, definition = resolve_tokenizer_path(path)
    fingerprint = tokenizer_fingerprint(source, definition)
    versions = {**_library_versions(), "unicodedata": unicodedata.unidata_version}
    key_src = json.dumps([fingerprint, versions, CACHE_VERSION], sort_keys=True)
    record_path = (
        cache_dir() / "tokenizers" / f"{hashlib.sha256(key_src.encode()).hexdigest()}.json"
    )
    record = _read_record(record_path, fingerprint)
    if record is None:
        run_verification(source, definition, fingerprint, record_path)
        record = _read_record(record_path, fingerprint)
        if record is None:
            raise TokenmillError(f"tokenizer {source}: verification wrote no record {record_path}")
    effective = record.get("effective_definition")
    hf_definition = record.get("hf_definition")
    ranks = record.get("ranks")
    fast = record.get("fast_definition")
    guard = record.get("guard") or {}
    return TokenizerInfo(
        source=source,
        definition=record_path.parent / effective if effective else definition,
        fingerprint=fingerprint,
        vocab_size=int(record["vocab_size"]),
        max_id=int(record["max_id"]),
        eod_id=record["eod_id"],
        prefix_ids=tuple(record["prefix_ids"]),
        suffix_ids=tuple(record["suffix_ids"]),
        verdicts=dict(record["verdicts"]),
        record_path=record_path,
        split_special_tokens=bool(record["split_special_tokens"]),
        hf_definition=record_path.parent / hf_definition if hf_definition else None,
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
        fast_definition=record_path.parent / fast if fast else None,
        specials=tuple(guard.get("specials", ())),
        guard_ranges=tuple((int(a), int(b)) for a, b in guard.get("ranges", ())),
    )


def load_reference(source: Path) -> Any:
    """The tokenizer exactly as Megatron's HuggingFaceTokenizer loads it (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if source.is_dir():
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    return PreTrainedTokenizerFast(tokenizer_file=str(source))


def run_verification(source: Path, definition: Path, fingerprint: str, record_path: Path) -> None:
    """Verify in a child interpreter and wait; TokenmillError with its stderr if it fails."""
    cmd = [sys.executable, "-m", "tokenmill.tokenize.tokenizer_verify"]
    cmd += [str(source), str(definition), fingerprint, str(record_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-5:]
        raise TokenmillError(
            f"tokenizer {source}: verification against transformers failed "
            f"(exit {proc.returncode}): {' | '.join(tail)}"
        )


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


def _assemble(
    arrays: list[np.ndarray],
    prefix: tuple[int, ...] = (),
    suffix: tuple[int, ...] = (),
    eod: int | None = None,
    dtype: np.dtype | type = np.uint32,
) -> tuple[np.ndarray, np.ndarray]:
    """One pass from per-text ids to flat ``dtype`` ids + lengths: ``prefix + ids + suffix``,
    then ``eod`` after every text that has any id (Megatron's ``--append-eod`` rule)."""
    around = [np.array(prefix, np.uint32)] if prefix else []
    after = [np.array(suffix, np.uint32)] if suffix else []
    if eod is not None:
        after.append(np.array([eod], np.uint32))
    extra = len(prefix) + len(suffix)
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    if around or after:
        parts = []
        for a in arrays:
            if a.size + extra:
                parts += [*around, a, *after]
        lengths += np.where(lengths + extra > 0, extra + (eod is not None), 0)
    else:
        parts = arrays
    flat = np.concatenate(parts, dtype=dtype, casting="unsafe") if parts else np.empty(0, dtype)
    return flat, lengths


def pack_flat(
    ids: np.ndarray,
    lengths: np.ndarray,
    prefix: tuple[int, ...] = (),
    suffix: tuple[int, ...] = (),
    eod: int | None = None,
    dtype: np.dtype | type = np.uint32,
) -> tuple[np.ndarray, np.ndarray]:
    """``_assemble`` for ids already concatenated: one copy into ``dtype`` with the specials
    placed around each text (by slices when texts are long, by a mask when they are many)."""
    tail = (*suffix, *(() if eod is None else (eod,)))
    if not prefix and not tail:
        return ids.astype(dtype, copy=False), lengths
    keep = lengths + len(prefix) + len(suffix) > 0
    grown = lengths + np.where(keep, len(prefix) + len(tail), 0)
    out = np.empty(int(grown.sum()), dtype)
    starts = np.cumsum(grown) - grown
    body = starts + len(prefix)
    if len(lengths) * 1000 < ids.size:
        src = 0
        for at, n in zip(body.tolist(), lengths.tolist(), strict=True):
            out[at : at + n] = ids[src : src + n]
            src += n
    else:
        mask = np.ones(out.size, dtype=bool)
        for k in range(len(prefix)):
            mask[starts[keep] + k] = False
        for k in range(len(tail)):
            mask[(body + lengths)[keep] + k] = False
        out[mask] = ids
    for k, tok in enumerate(prefix):
        out[starts[keep] + k] = tok
    for k, tok in enumerate(tail):
        out[(body + lengths)[keep] + k] = tok
    return out, grown


class Encoder:
    """A tokenizer bound to one engine: ``tokenizer(text).input_ids`` for many texts at once.

    A ``guarded`` engine (the fast ones) runs each batch through the tokenizer's ``Guard``:
    documents of a risky class go to ``reference_encoder`` and are counted in ``routed`` by
    class (``pack`` only; ``encode``, used for probes and samples, counts nothing).
    """

    name = ""
    adds_special_tokens = False  # True when the engine applies the post-processor itself
    guarded = False

    def __init__(self, info: TokenizerInfo) -> None:
        self.info = info
        self.routed: Counter[str] = Counter()
        self._guard = info.guard() if self.guarded else None
        self._reference: Encoder | None = None

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Every text's ids, concatenated (uint32), and each text's length."""
        return self._guarded(texts, None, np.uint32, False, None)

    def pack(
        self,
        texts: list[str],
        eod: int | None = None,
        dtype: np.dtype | type = np.uint32,
        *,
        threads: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Output-ready ids in ``dtype`` with ``eod`` ending each non-empty text, and lengths.

        ``threads`` lets an engine with its own thread pool use it (gigatoken); others ignore it.
        """
        return self._guarded(texts, eod, dtype, threads, self.routed)

    def _guarded(
        self,
        texts: list[str],
        eod: int | None,
        dtype: np.dtype | type,
        threads: bool,
        counts: Counter[str] | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        if self._guard is None:
            return self._pack(texts, eod, dtype, threads)
        prepared, routed, classes = self._guard.split(texts)
        if counts is not None:
            counts.update(classes)
        if not routed:
            return self._pack(prepared, eod, dtype, threads)
        if self._reference is None:
            self._reference = reference_encoder(self.info)
        fast = np.ones(len(texts), dtype=bool)
        fast[routed] = False
        mine = np.flatnonzero(fast)
        parts = [
            (mine, self._pack([prepared[i] for i in mine], eod, dtype, threads)),
            (np.array(routed), self._reference.pack([texts[i] for i in routed], eod, dtype)),
        ]
        lengths = np.empty(len(texts), dtype=np.int64)
        for where, (_, n) in parts:
            lengths[where] = n
        starts = np.cumsum(lengths) - lengths
        out = np.empty(int(lengths.sum()), dtype)
        for where, (flat, n) in parts:
            out[np.repeat(starts[where] - (np.cumsum(n) - n), n) + np.arange(flat.size)] = flat
        return out, lengths

    def _pack(
        self, texts: list[str], eod: int | None, dtype: np.dtype | type, threads: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """The engine's own ``pack``, without the guard."""
        if self.adds_special_tokens:
            return _assemble(self._encode_each(texts), eod=eod, dtype=dtype)
        info = self.info
        return _assemble(self._encode_each(texts), info.prefix_ids, info.suffix_ids, eod, dtype)

    def _encode_each(self, texts: list[str]) -> list[np.ndarray]:
        raise NotImplementedError


class GigatokenEncoder(Encoder):
    """gigatoken's Rust BPE: text by text on one thread, a whole batch on its pool with ``threads``.

    Loaded from the cached ranks with gigatoken's built-in pre-tokenizer when the regex has one
    (3x faster to load than tokenizer.json); it then works in rank space, and ``pack`` maps the
    whole batch back to ids with one gather. Per-text ``encode`` holds the GIL; the batch call
    on its thread pool releases it.
    """

    name = "gigatoken"
    guarded = True

    def __init__(self, info: TokenizerInfo) -> None:
        super().__init__(info)
        import gigatoken

        self._table: np.ndarray | None = None
        backend: Any
        rf = info.ranks
        if rf is not None and rf.scheme is not None:
            ids = np.load(rf.ids, allow_pickle=False)
            n = len(ids) - len(rf.specials)
            specials = {s: n + j for j, s in enumerate(rf.specials)}
            backend = gigatoken.gigatoken_rs.BPETokenizer.from_tiktoken(
                rf.ranks, rf.scheme, specials
            )
            if not np.array_equal(ids, np.arange(len(ids))):
                self._table = ids
        else:
            definition = info.fast_definition or info.definition
            backend = gigatoken.gigatoken_rs.load_hf_json(definition.read_bytes())
        self._tok = gigatoken.Tokenizer(backend)
        self._backend = backend
        self._padding = gigatoken.gigatoken_rs.PadTruncate(0)
        self._short_texts = 0  # seen so far; padded calls start at _batching.PADDED_AFTER

    def _encode_flat(self, texts: list[str], threads: bool) -> tuple[np.ndarray, np.ndarray]:
        """Flat uint32 ranks and per-text lengths.

        With ``threads`` the batch call spreads texts over gigatoken's pool and returns an
        awkward array, whose two buffers are read directly; awkward costs ~0.5 s to import, so
        ``tokenize`` asks for threads only on large inputs. On one thread texts go through
        ``tokenmill.tokenize._batching`` (one by one; short ones padded together once many were
        seen).
        """
        if threads and texts:
            out = self._tok.encode_batch(texts, parallel=None)
            offsets = np.asarray(out.layout.offsets.data)
            flat = np.asarray(out.layout.content.data)[offsets[0] : offsets[-1]]
            lengths = np.diff(offsets).astype(np.int64)
        else:
            self._short_texts += _batching.count_short(texts)
            padded = self._encode_padded if self._short_texts >= _batching.PADDED_AFTER else None
            flat, lengths = _batching.encode_batch(texts, self._tok.encode, padded)
        flat = np.asarray(flat)
        if lengths.shape != (len(texts),) or int(lengths.sum()) != flat.size:
            raise TokenmillError(
                f"gigatoken: batch result has {lengths.size} lengths summing to "
                f"{int(lengths.sum())} for {len(texts)} texts and {flat.size} ids"
            )
        return flat, lengths

    def _encode_padded(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """One padded ``[texts, longest]`` matrix on the calling thread, and the row lengths."""
        matrix, lengths = self._backend.encode_batch_padded(texts, self._padding, parallel=False)
        return np.asarray(matrix), np.asarray(lengths, dtype=np.int64)

    def _pack(
        self, texts: list[str], eod: int | None, dtype: np.dtype | type, threads: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """As ``Encoder._pack``; ranks become ids with one gather before the specials go in."""
        flat, lengths = self._encode_flat(texts, threads)
        if self._table is not None:
            flat = self._table.astype(dtype, copy=False)[flat]
        info = self.info
        return pack_flat(flat, lengths, info.prefix_ids, info.suffix_ids, eod, dtype)


class TiktokenEncoder(Encoder):
    """tiktoken over the cached ranks (ids as mergeable ranks) and the pre-tokenizer's regex."""

    name = "tiktoken"
    guarded = True

    def __init__(self, info: TokenizerInfo) -> None:
        super().__init__(info)
        import base64

        import tiktoken

        rf = info.ranks
        if rf is None:
            raise ConfigError(f"tokenizer {info.source}: has no tiktoken form")
        ids = np.load(rf.ids, allow_pickle=False).tolist()
        with open(rf.ranks, "rb") as fh:
            ranks = {base64.b64decode(line.split()[0]): ids[i] for i, line in enumerate(fh)}
        n = len(ranks)
        specials = {s: ids[n + j] for j, s in enumerate(rf.specials)}
        enc = tiktoken.Encoding(
            f"tokenmill-{info.fingerprint[:12]}",
            pat_str=rf.pattern,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self.encoding = enc
        self._one = enc.encode_to_numpy
        self._allowed = frozenset(specials)

    def _encode_each(self, texts: list[str]) -> list[np.ndarray]:
        one, allowed = self._one, self._allowed
        return [one(t, allowed_special=allowed) for t in texts]


class HFEncoder(Encoder):
    """The ``tokenizers`` backend transformers calls, with ``add_special_tokens=True``."""

    name = "hf"
    adds_special_tokens = True

    def __init__(self, info: TokenizerInfo) -> None:
        super().__init__(info)
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(info.hf_definition or info.definition))
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = info.split_special_tokens
        self._batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def _encode_each(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._batch(texts, add_special_tokens=True)
        return [np.array(e.ids, dtype=np.uint32) for e in encodings]


class TransformersEncoder(Encoder):
    """The reference itself: ``AutoTokenizer.from_pretrained(dir)(texts).input_ids``."""

    name = "transformers"
    adds_special_tokens = True

    def __init__(self, info: TokenizerInfo) -> None:
        super().__init__(info)
        self._tok = load_reference(info.source)

    def _encode_each(self, texts: list[str]) -> list[np.ndarray]:
        ids = self._tok(texts).input_ids if texts else []
        return [np.array(x, dtype=np.uint32) for x in ids]


ENCODERS: dict[str, type[Encoder]] = {
    "gigatoken": GigatokenEncoder,
    "tiktoken": TiktokenEncoder,
    "hf": HFEncoder,
    "transformers": TransformersEncoder,
}


def load_encoder(info: TokenizerInfo, engine: str = "auto") -> Encoder:
    """The fastest verified engine (``auto``) or the named one if it was verified."""
    if engine == "auto":
        return ENCODERS[info.usable_engines()[0]](info)
    if engine not in ENCODERS:
        raise ConfigError(f"engine={engine!r}: expected 'auto' or one of {list(ENCODERS)}")
    if info.verdicts.get(engine) != "ok":
        raise ConfigError(
            f"engine {engine!r} is not verified for tokenizer {info.source}: "
            f"{info.verdicts.get(engine)}"
        )
    return ENCODERS[engine](info)


def load_tokenizer(path: str | os.PathLike[str], *, engine: str = "auto") -> Encoder:
    """Inspect (verify once, cached) and load a tokenizer with its fastest exact engine."""
    return load_encoder(inspect_tokenizer(path), engine)


def reference_encoder(info: TokenizerInfo) -> Encoder:
    """The engine runs are checked against: ``hf`` when verified, else transformers itself."""
    return load_encoder(info, "hf" if info.verdicts.get("hf") == "ok" else "transformers")


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
