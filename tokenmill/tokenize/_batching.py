"""Encoding a batch of texts on the calling thread with an engine's per-text and padded calls.

gigatoken's batch calls import awkward and pyarrow (~0.5 s of CPU per process), so small inputs
are encoded text by text (its per-text ``encode`` imports nothing). A per-text call costs ~2 µs,
four times the encoding of a 120-character text, so once an input has shown ``PADDED_AFTER``
short texts, they go through padded calls of ``GROUP`` rows and the long ones stay one by one.
(Per-text calls on several Python threads measured slower than one thread.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

SHORT_TEXT = 1024  # characters: shorter texts share padded calls
GROUP = 1024  # texts per padded call: bounds its matrix (rows x longest row)
PADDED_AFTER = 250_000  # short texts seen before padded calls are worth their imports

EncodeOne = Callable[[str], np.ndarray]
EncodePadded = Callable[[list[str]], tuple[np.ndarray, np.ndarray]]  # (matrix, row lengths)


def count_short(texts: list[str]) -> int:
    """How many of ``texts`` are short enough for padded calls."""
    return sum(1 for text in texts if len(text) <= SHORT_TEXT)


def _padded(
    texts: list[str], which: list[int], encode_padded: EncodePadded
) -> tuple[np.ndarray, np.ndarray]:
    """Ids of ``texts[which]`` through padded calls of ``GROUP`` rows (padding dropped), and
    every row's length."""
    flats, lengths = [], []
    for at in range(0, len(which), GROUP):
        matrix, rows = encode_padded([texts[i] for i in which[at : at + GROUP]])
        flats.append(matrix[np.arange(matrix.shape[1]) < rows[:, None]])
        lengths.append(rows)
    return np.concatenate(flats), np.concatenate(lengths)


def encode_batch(
    texts: list[str], encode_one: EncodeOne, encode_padded: EncodePadded | None
) -> tuple[np.ndarray, np.ndarray]:
    """Every text's ids concatenated in order (uint32) and each text's length; without
    ``encode_padded`` every text is encoded on its own."""
    short: list[int] = []
    parts = []
    if encode_padded is not None:
        short = [i for i, text in enumerate(texts) if len(text) <= SHORT_TEXT]
        short = short if len(short) > 1 else []
        if short:
            parts.append((short, _padded(texts, short, encode_padded)))
    rest = sorted(set(range(len(texts))) - set(short)) if short else list(range(len(texts)))
    if rest:
        singles = [encode_one(texts[i]) for i in rest]
        lengths = np.fromiter(map(len, singles), dtype=np.int64, count=len(singles))
        parts.append((rest, (np.concatenate(singles), lengths)))
    return interleave(len(texts), parts, np.uint32)


def interleave(
    count: int,
    parts: Sequence[tuple[Sequence[int] | np.ndarray, tuple[np.ndarray, np.ndarray]]],
    dtype: np.dtype | type,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``(flat, lengths)`` results of groups of ``count`` texts (each with its text indices,
    ascending) merged into one result in text order."""
    if len(parts) == 1:
        return parts[0][1]
    lengths = np.zeros(count, dtype=np.int64)
    for where, (_, n) in parts:
        lengths[where] = n
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), dtype)
    for where, (flat, n) in parts:
        out[np.repeat(starts[where] - (np.cumsum(n) - n), n) + np.arange(flat.size)] = flat
    return out, lengths
