"""The per-document guard of the fast engines, and the study that sizes it.

Beyond the probes and each run's sample, one pass over every document (C-speed ``re`` searches,
skipped for pure ASCII) sends it to the reference engine when it is in a class where the fast
path can differ:

- ``special_token``: the text (or its normalized form) contains an added token's string. The
  reference splits added tokens out before normalizing, so normalizing first can create one
  (``＜|endoftext|＞`` under NFKC) or break one (``<|endoftext|>`` + U+0338 under NFC); the
  engines' matching of overlapping or adjacent added tokens is only probed, not proven.
- ``code_point``: the text holds a code point unassigned (``Cn``) or surrogate (``Cs``) in
  Python's ``unicodedata`` (the Rust engines' regex tables are of other Unicode versions), or,
  with a Unicode normalizer run in Python, one where ``unicodedata`` and the ``tokenizers``
  normalizer disagree (``normalization_differences``).

Normalization is idempotent, so normalizing in Python and encoding with the normalizer removed
gives the reference ids wherever both Unicode databases agree.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast

import numpy as np

Form = Literal["NFC", "NFD", "NFKC", "NFKD"]
FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_FEW_SPECIALS = 8  # up to this many added tokens, ``in`` per token beats one regex
CLASSES = ("special_token", "code_point")
# Marks that reorder against a neighbour with another combining class (ccc 1 and 240), and a
# separator no normalization form touches or composes with.
_LOW_MARK, _HIGH_MARK, _SEP = "\u0334", "\u0345", "\x00"


def unicode_form(normalizer: dict | None) -> str | None:
    """The Unicode form a ``tokenizer.json`` normalizer applies, when that is all it does."""
    if not normalizer:
        return None
    if normalizer.get("type") == "Sequence":
        steps = normalizer.get("normalizers") or []
        return unicode_form(steps[0]) if len(steps) == 1 else None
    kind = normalizer.get("type")
    return kind if kind in FORMS else None


def to_ranges(code_points: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """Sorted inclusive ``(first, last)`` runs of ``code_points`` (via a mask of all of them)."""
    mask = np.zeros(0x110001, dtype=np.int8)
    mask[np.asarray(code_points, dtype=np.int64)] = 1
    edges = np.flatnonzero(np.diff(mask, prepend=0))
    return list(zip(edges[0::2].tolist(), (edges[1::2] - 1).tolist(), strict=True))


def _as_text(code_points: np.ndarray) -> str:
    """The code points as one string (lone surrogates included)."""
    return code_points.astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")


@functools.cache
def unassigned_mask() -> np.ndarray:
    """Per code point, whether Python's ``unicodedata`` calls it unassigned (``Cn``) or a
    surrogate (``Cs``): one pass of ``category`` over all 0x110000 in C (0.1 s)."""
    unassigned = frozenset(("Cn", "Cs")).__contains__
    text = _as_text(np.arange(0x110000))
    mask = np.fromiter(map(unassigned, map(unicodedata.category, text)), bool, len(text))
    mask.flags.writeable = False
    return mask


def normalization_differences(form: str) -> list[int]:
    """Assigned code points where ``unicodedata.normalize(form)`` and the ``tokenizers``
    normalizer of that form disagree in some context.

    Each code point that takes part in normalization in Python (Unicode keeps that stable for
    assigned ones) is normalized alone, next to marks of classes 1, 240 and 220 (a combining class
    known to one database only reorders), and, decomposed, as a sequence (a composition known to
    one database only). All contexts go through each normalizer as one NUL-joined string.
    """
    from tokenizers import normalizers

    theirs = getattr(normalizers, form)()
    normalize, combining = unicodedata.normalize, unicodedata.combining
    assigned = _as_text(np.flatnonzero(~unassigned_mask()[1:]) + 1)
    decomposed = normalize("NFKD", _SEP.join(assigned)).split(_SEP)
    parts_of = set("".join(d for ch, d in zip(assigned, decomposed, strict=True) if d != ch))
    contexts: list[str] = []
    owners: list[str] = []
    for ch, d in zip(assigned, decomposed, strict=True):
        if d == ch and not combining(ch) and ch not in parts_of:
            continue
        contexts += (ch, ch + _LOW_MARK, _HIGH_MARK + ch, "a" + ch + "\u0316")
        owners += (ch,) * 4
        parts = normalize("NFD", ch)
        if parts != ch:
            contexts.append(parts)
            owners.append(ch + parts)
    joined = _SEP.join(contexts)
    ours = unicodedata.normalize(cast(Form, form), joined).split(_SEP)
    other = theirs.normalize_str(joined).split(_SEP)
    if not len(ours) == len(other) == len(contexts):
        raise RuntimeError(f"{form}: a normalizer changed the NUL separators")
    bad = {ord(ch) for a, b, who in zip(ours, other, owners, strict=True) if a != b for ch in who}
    return sorted(bad)


def _any_of(words: Iterable[str]) -> str:
    """A regex that finds any of ``words``, as a trie (``<(?:s>|/s>|SPECIAL_(?:1|2...)...)``):
    one alternation per shared prefix instead of one per word. A word ends the search there,
    since a longer word that extends it contains it."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        if "" in node:
            return ""
        alts = [re.escape(ch) + emit(child) for ch, child in sorted(node.items())]
        return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"

    return emit(trie)


class Guard:
    """Sends documents of a risky class to the reference; normalizes the others when asked. Per
    text: a search for the added tokens, and unless it is pure ASCII a table lookup of its code
    points."""

    def __init__(
        self, specials: Iterable[str], ranges: Sequence[Sequence[int]], form: str | None
    ) -> None:
        words = sorted({s for s in specials if s}, key=len, reverse=True)
        self.form = cast(Form | None, form)
        self._special: Callable[[str], bool] | None = None
        if len(words) > _FEW_SPECIALS:
            search = re.compile(_any_of(words)).search
            self._special = lambda text: search(text) is not None
        elif words:
            self._special = lambda text: any(word in text for word in words)
        self._table: np.ndarray | None = None
        if ranges:
            self._table = np.zeros(0x110000, dtype=bool)
            for first, last in ranges:
                self._table[first : last + 1] = True

    def risk(self, text: str) -> str | None:
        """The class that sends ``text`` to the reference (checked on the raw text), or None."""
        if self._special is not None and self._special(text):
            return "special_token"
        if self._table is not None and not text.isascii():
            try:
                code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            except UnicodeEncodeError:  # a lone surrogate
                return "code_point"
            if self._table[code_points].any():
                return "code_point"
        return None

    def split(self, texts: list[str]) -> tuple[list[str], list[int], Counter[str]]:
        """``(prepared, routed, counts)``: each text as the fast engine should see it
        (normalized), the indices of the texts for the reference, and their count by class."""
        routed: list[int] = []
        counts: Counter[str] = Counter()
        form, special, normalize = self.form, self._special, unicodedata.normalize
        prepared = list(texts)
        for i, text in enumerate(texts):
            why = self.risk(text)
            if why is None and form is not None and not text.isascii():
                done = prepared[i] = normalize(form, text)
                if done != text and special is not None and special(done):
                    why = "special_token"
            if why is not None:
                routed.append(i)
                counts[why] += 1
        return prepared, routed, counts
