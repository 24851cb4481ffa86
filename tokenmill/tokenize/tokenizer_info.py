"""``TokenizerInfo``: what a run knows about a tokenizer, as its cached verification record says
(``tokenmill.tokenize.tokenizer`` reads it; the engines are built from it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokenmill.formats.indexed import optimal_dtype
from tokenmill.tokenize.tokenizer_guard import Guard

ENGINES = ("gigatoken", "tiktoken", "hf", "transformers")


@dataclass(frozen=True)
class RankFiles:
    """A byte-level BPE as tiktoken-style ranks, cached at verification: ``ranks`` holds ``base64
    rank`` lines (ranks ``0..N-1`` in id order), ``ids`` (.npy) each rank's id, the specials
    taking ranks ``N..`` in ``specials`` order."""

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
