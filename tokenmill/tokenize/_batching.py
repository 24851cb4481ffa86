"""Encoding a batch of texts on the calling thread with an engine's per-text and padded calls.

gigatoken's batch calls (``encode_batch``, even ``encode_batch_padded``) import awkward and
pyarrow: ~0.5 s of CPU per process, more than encoding 20 MB on one thread. Its per-text
``encode`` returns a numpy array and imports nothing, so small inputs are encoded text by text.
A per-text call costs ~2 µs, though, four times the encoding of a 120-character text: once an
input has shown ``PADDED_AFTER`` short texts (the import then pays for itself) its short texts
go through padded calls of ``GROUP`` rows, the long ones still one by one. The result is the
per-text ids concatenated in input order, whichever calls made them. (Per-text calls on several
Python threads do not scale: measured slower than one thread.)
"""

from __future__ import annotations

from collections.abc import Callable

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
) -> tuple[list[np.ndarray], np.ndarray]:
    """Ids of ``texts[which]`` through padded calls of ``GROUP`` rows: one flat array per call
    (rows in order, padding dropped) and every row's length."""
    flats, lengths = [], []
    for at in range(0, len(which), GROUP):
        matrix, rows = encode_padded([texts[i] for i in which[at : at + GROUP]])
        flats.append(matrix[np.arange(matrix.shape[1]) < rows[:, None]])
        lengths.append(rows)
    return flats, np.concatenate(lengths) if lengths else np.empty(0, np.int64)


def encode_batch(
    texts: list[str], encode_one: EncodeOne, encode_padded: EncodePadded | None
) -> tuple[np.ndarray, np.ndarray]:
    """Every text's ids concatenated in order (uint32) and each text's length; without
    ``encode_padded`` every text is encoded on its own."""
    short: list[int] = []
    flats: list[np.ndarray] = []
    short_lengths = np.empty(0, np.int64)
    if encode_padded is not None:
        short = [i for i, text in enumerate(texts) if len(text) <= SHORT_TEXT]
        short = short if len(short) > 1 else []
        flats, short_lengths = _padded(texts, short, encode_padded)
    lengths = np.zeros(len(texts), dtype=np.int64)
    lengths[short] = short_lengths
    if len(short) == len(texts):
        return (np.concatenate(flats) if flats else np.empty(0, np.uint32)), lengths
    rest = sorted(set(range(len(texts))) - set(short)) if short else list(range(len(texts)))
    singles = [encode_one(texts[i]) for i in rest]
    lengths[rest] = [len(ids) for ids in singles]
    if not short:
        return np.concatenate(singles), lengths
    ends = np.cumsum(lengths)
    starts = ends - lengths
    flat = np.empty(int(ends[-1]), dtype=np.uint32)
    shift = starts[short] - np.cumsum(short_lengths) + short_lengths  # row start: flat → output
    positions = np.repeat(shift, short_lengths) + np.arange(int(short_lengths.sum()))
    flat[positions] = np.concatenate(flats)
    for i, ids in zip(rest, singles, strict=True):
        flat[starts[i] : ends[i]] = ids
    return flat, lengths
