"""The engines that encode texts for a verified tokenizer: ``Encoder`` and its four engines.

Engines, fastest first: ``gigatoken`` (Rust), ``tiktoken`` (ranks built from a byte-level BPE
``tokenizer.json``), ``hf`` (the ``tokenizers`` backend transformers itself calls) and
``transformers`` (the reference, ``load_reference``), each built from a ``TokenizerInfo``; the
fast ones run behind the tokenizer's per-document guard.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import ConfigError, TokenmillError
from tokenmill.tokenize import _batching
from tokenmill.tokenize.tokenizer_info import TokenizerInfo


def load_reference(source: Path) -> Any:
    """The tokenizer exactly as Megatron's HuggingFaceTokenizer loads it (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _defer_model_table()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if source.is_dir():
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    return PreTrainedTokenizerFast(tokenizer_file=str(source))


def _defer_model_table() -> None:
    """Import ``transformers.models`` without its ``__init__`` (0.3 s reading ~1,700 model sources
    for a table ``AutoTokenizer`` does not use); asked for an attribute, the stub imports that
    submodule, or runs the real ``__init__`` and answers from it."""
    import importlib
    import importlib.util

    if "transformers.models" in sys.modules:
        return
    spec = importlib.util.find_spec("transformers.models")  # imports transformers itself
    if spec is None or spec.submodule_search_locations is None:
        return
    stub = importlib.util.module_from_spec(spec)

    def attribute(name: str) -> Any:
        if importlib.util.find_spec(f"{spec.name}.{name}"):
            return importlib.import_module(f"{spec.name}.{name}")
        if sys.modules.get(spec.name) is stub:
            del sys.modules[spec.name]
        return getattr(importlib.import_module(spec.name), name)

    stub.__getattr__ = attribute  # type: ignore[method-assign]  # PEP 562, for this module only
    sys.modules[spec.name] = stub


def hide_torch() -> None:
    """Make this process look torch-free to transformers (the verification child calls it first):
    ``find_spec`` answers None for a ``sys.modules`` entry of None, and without ``return_tensors``
    the ids are the same lists with or without torch (the tests compare)."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]


def flatten(arrays: Sequence[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-text ids as one concatenated uint32 array, and each text's length."""
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    if not arrays:
        return np.empty(0, np.uint32), lengths
    return np.concatenate(arrays, dtype=np.uint32, casting="unsafe"), lengths


def pack_flat(
    ids: np.ndarray,
    lengths: np.ndarray,
    prefix: tuple[int, ...] = (),
    suffix: tuple[int, ...] = (),
    eod: int | None = None,
    dtype: np.dtype | type = np.uint32,
) -> tuple[np.ndarray, np.ndarray]:
    """Output-ready ids: one copy of the concatenated ``ids`` into ``dtype`` as ``prefix + ids +
    suffix`` per text, then ``eod`` after every text that has any id (Megatron's
    ``--append-eod``); by slices when texts are long, by a mask when they are many."""
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
    """A tokenizer bound to one engine: ``tokenizer(text).input_ids`` for many texts at once. A
    ``guarded`` engine sends documents of a risky class to ``reference_encoder``, counted by class
    in ``routed`` by ``pack`` (not by ``encode``, used for probes and samples)."""

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
        """Output-ready ids in ``dtype`` with ``eod`` ending each non-empty text, and lengths;
        ``threads`` lets an engine with its own thread pool use it (gigatoken)."""
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
        mine = np.flatnonzero(~np.isin(np.arange(len(texts)), routed))
        return _batching.interleave(
            len(texts),
            [
                (mine, self._pack([prepared[i] for i in mine], eod, dtype, threads)),
                (routed, self._reference.pack([texts[i] for i in routed], eod, dtype)),
            ],
            dtype,
        )

    def _pack(
        self, texts: list[str], eod: int | None, dtype: np.dtype | type, threads: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """The engine's own ``pack``, without the guard."""
        flat, lengths = self._encode_flat(texts, threads)
        info = self.info
        around = ((), ()) if self.adds_special_tokens else (info.prefix_ids, info.suffix_ids)
        return pack_flat(flat, lengths, *around, eod, dtype)

    def _encode_flat(self, texts: list[str], threads: bool) -> tuple[np.ndarray, np.ndarray]:
        """Every text's ids concatenated, and each text's length."""
        return flatten(self._encode_each(texts))

    def _encode_each(self, texts: list[str]) -> list[np.ndarray]:
        raise NotImplementedError


class GigatokenEncoder(Encoder):
    """gigatoken's Rust BPE: text by text on one thread, a whole batch on its pool with ``threads``.
    Loaded from the cached ranks when gigatoken has the regex built in (3x faster to load than
    tokenizer.json), it then works in rank space, mapped back to ids with one gather."""

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
        """Flat ids and per-text lengths: with ``threads`` from the pool's awkward array (~0.5 s to
        import), else through ``tokenmill.tokenize._batching`` on this thread."""
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
        return (flat if self._table is None else self._table[flat]), lengths

    def _encode_padded(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """One padded ``[texts, longest]`` matrix on the calling thread, and the row lengths."""
        matrix, lengths = self._backend.encode_batch_padded(texts, self._padding, parallel=False)
        return np.asarray(matrix), np.asarray(lengths, dtype=np.int64)


class TiktokenEncoder(Encoder):
    """tiktoken over the cached ranks (ids as mergeable ranks) and the pre-tokenizer's regex."""

    name = "tiktoken"
    guarded = True

    def __init__(self, info: TokenizerInfo) -> None:
        super().__init__(info)
        from binascii import a2b_base64

        import tiktoken

        rf = info.ranks
        if rf is None:
            raise ConfigError(f"tokenizer {info.source}: has no tiktoken form")
        ids = np.load(rf.ids, allow_pickle=False).tolist()
        with open(rf.ranks, "rb") as fh:  # base64 and rank per line, ranks 0..n-1 in order
            ranks = dict(zip(map(a2b_base64, (line.split()[0] for line in fh)), ids, strict=False))
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


def reference_encoder(info: TokenizerInfo) -> Encoder:
    """The engine runs are checked against: ``hf`` when verified, else transformers itself."""
    return load_encoder(info, "hf" if info.verdicts.get("hf") == "ok" else "transformers")
