"""Training inputs as megatron-core ``GPTDataset.__getitem__`` builds them (FORMATS §11), for a
whole batch at once.

``training_inputs`` takes the assembled samples ``text`` (int64 ``[B, S + extra]``, short ones
padded with the pad id) and the pieces they were read from (each piece's output row and token
count, in row order) and returns, stacked over the batch, the dict Megatron returns per sample:
same keys, dtypes and values. Everything is array arithmetic over the batch: positions that
restart after an EOD (or at a piece start) are ``column - last restart``, the last restart
being a running maximum along the row; the attention mask is ``column > row`` (causal) or
``column < first position of the row's EOD-delimited segment``. Where Megatron caches the
flag-free masks and then zeroes padding in the cached loss mask (so later samples inherit
those zeros), each sample here gets its own, as §11 specifies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from tokenmill.errors import ConfigError, FormatError


class _RecordsEod(Protocol):
    def recorded_eod_id(self) -> int | None: ...


def training_inputs(
    text: np.ndarray,
    piece_rows: np.ndarray,
    piece_sizes: np.ndarray,
    *,
    extra: bool,
    eod_id: int,
    pad_id: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = False,
    inter_document_masking: bool = False,
) -> dict[str, np.ndarray]:
    """The §11 training dict of every row of ``text`` (see the module docstring)."""
    tokens, labels = _shift(text, extra, pad_id)
    batch, seq = tokens.shape
    columns = np.arange(seq, dtype=np.int64)
    is_eod = tokens == eod_id
    loss_mask = np.ones((batch, seq), dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    attention_mask = None
    if inter_document_masking:
        cu_seqlens, piece_start = _cu_seqlens(piece_rows, piece_sizes, batch, seq, extra)
        position_ids = columns - piece_start
        max_seqlen = np.diff(cu_seqlens, axis=1).max(axis=1, initial=0).astype(np.int32)
    else:
        resets = reset_position_ids or (create_attention_mask and reset_attention_mask)
        segment_start = _restarts(is_eod, columns) if resets else np.zeros((batch, 1), np.int64)
        if reset_position_ids:
            position_ids = columns - segment_start
        else:
            position_ids = np.tile(columns, (batch, 1))
        if create_attention_mask:
            attention_mask = _attention_mask(segment_start, reset_attention_mask, batch, seq)
    loss_mask[labels == pad_id] = 0.0
    tokens[tokens == pad_id] = 0
    labels[labels == pad_id] = 0
    if inter_document_masking:
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
            "cu_seqlens": cu_seqlens,
            "max_seqlen": max_seqlen,
        }
    if attention_mask is not None:
        return {
            "tokens": tokens,
            "labels": labels,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
        }
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
    }


def resolve_eod(datasets: Mapping[str, _RecordsEod], eod_id: int | None) -> int:
    """``eod_id``, or the EOD id all ``datasets`` record; ConfigError when one records none or
    they disagree (naming them)."""
    if eod_id is not None:
        return int(eod_id)
    recorded = {name: ds.recorded_eod_id() for name, ds in datasets.items()}
    missing = [name for name, value in recorded.items() if value is None]
    if missing:
        raise ConfigError(
            f"no EOD id recorded for {', '.join(map(repr, missing))} (config.eod_id of the "
            "dataset's .manifest.json); pass eod_id=... to get_training_batch"
        )
    values = set(recorded.values())
    if len(values) > 1:
        shown = ", ".join(f"{name!r}: {value}" for name, value in recorded.items())
        raise ConfigError(
            f"the blend's datasets record different EOD ids ({shown}); they were tokenized "
            "differently: pass eod_id=... explicitly only if that is intended"
        )
    return int(values.pop())  # type: ignore[arg-type]


def _shift(text: np.ndarray, extra: bool, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``tokens``/``labels``: ``text[:-1]``/``text[1:]`` with the extra token; else ``text`` and
    ``text`` rolled left by one with the last label the pad id."""
    text = np.asarray(text, dtype=np.int64)
    if extra:
        return text[:, :-1].copy(), text[:, 1:].copy()
    labels = np.empty_like(text)
    labels[:, :-1] = text[:, 1:]
    labels[:, -1:] = pad_id
    return text.copy(), labels


def _restarts(starts_here: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """Per position, where its run began: a run restarts after every True of ``starts_here``
    (the position right after an EOD), so it is the running maximum of those positions."""
    marker = np.zeros(starts_here.shape, dtype=np.int64)
    marker[:, 1:] = np.where(starts_here[:, :-1], columns[1:], 0)
    return np.maximum.accumulate(marker, axis=1)


def _attention_mask(segment_start: np.ndarray, reset: bool, batch: int, seq: int) -> np.ndarray:
    """bool ``[B, 1, S, S]``, True = may not attend: later columns (causal) and, with ``reset``,
    columns before the row's EOD-delimited segment (an EOD lies between them)."""
    columns = np.arange(seq)
    causal = columns[None, :] > columns[:, None]
    out = np.empty((batch, 1, seq, seq), dtype=bool)
    if not reset:
        out[:, 0] = causal
        return out
    np.less(columns[None, None, :], segment_start[:, :, None], out=out[:, 0])
    out[:, 0] |= causal
    return out


def _cu_seqlens(
    piece_rows: np.ndarray, piece_sizes: np.ndarray, batch: int, seq: int, extra: bool
) -> tuple[np.ndarray, np.ndarray]:
    """int32 ``cu_seqlens`` ``[B, S + 1]`` of the pieces (§11.4: the extra token off the last
    piece, which is dropped if that empties it; padding folded into the last piece; padded with
    S), and per position the start of its piece."""
    rows = np.asarray(piece_rows, dtype=np.int64)
    sizes = np.asarray(piece_sizes, dtype=np.int64).copy()
    counts = np.bincount(rows, minlength=batch)
    if extra and len(rows):
        last = np.cumsum(counts)[counts > 0] - 1
        sizes[last] -= 1
        keep = np.ones(len(rows), dtype=bool)
        keep[last[sizes[last] == 0]] = False
        rows, sizes = rows[keep], sizes[keep]
        counts = np.bincount(rows, minlength=batch)
    if len(rows) and int(counts.max()) > seq:
        row = int(np.argmax(counts))
        raise FormatError(
            f"batch row {row}",
            "pieces",
            f"{int(counts[row])} document pieces (empty sequences included) do not fit in "
            f"cu_seqlens of sequence_length + 1 = {seq + 1} entries",
        )
    firsts = np.cumsum(counts) - counts
    ends_total = np.cumsum(sizes)
    before_row = np.concatenate([[0], ends_total])[firsts]
    end = ends_total - np.repeat(before_row, counts)
    rank = np.arange(len(rows)) - np.repeat(firsts, counts)
    cu_seqlens = np.full((batch, seq + 1), seq, dtype=np.int32)
    cu_seqlens[:, 0] = 0
    inner = rank < np.repeat(counts, counts) - 1  # the last piece ends at S: padding folded in
    cu_seqlens[rows[inner], rank[inner] + 1] = end[inner]
    start = end - sizes
    marker = np.zeros((batch, seq), dtype=np.int64)
    inside = start < seq
    marker[rows[inside], start[inside]] = start[inside]
    return cu_seqlens, np.maximum.accumulate(marker, axis=1)
