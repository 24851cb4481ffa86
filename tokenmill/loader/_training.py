"""Training inputs as megatron-core ``GPTDataset.__getitem__`` builds them (FORMATS §11), for a
whole batch at once, by array arithmetic over the flattened ``B·S`` positions.

Where Megatron caches the flag-free masks and then zeroes padding in the cached loss mask (so
later samples inherit those zeros), each sample here gets its own, as §11 specifies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.errors import FormatError


@dataclass(frozen=True)
class TrainingFlags:
    """megatron-core's five training-input flags (``GPTDatasetConfig``; FORMATS §11)."""

    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    inter_document_masking: bool = False


def training_inputs(
    text: np.ndarray,
    piece_rows: np.ndarray,
    piece_sizes: np.ndarray,
    *,
    extra: bool,
    eod_id: int,
    pad_id: int,
    flags: TrainingFlags,
    may_hold_pad: bool = True,
) -> dict[str, np.ndarray]:
    """The §11 dict (Megatron's keys, dtypes and values) of every row of ``text`` (``[B, S +
    extra]``, short rows padded with ``pad_id``), given its pieces' output rows and token counts
    in row order. ``may_hold_pad=False`` (no padding, no token can equal ``pad_id``) skips the
    three passes that map padding; the last label without the extra token is still pad."""
    tokens, labels = _shift(text, extra, pad_id)
    batch, seq = tokens.shape
    # positions restart after each EOD (for the position ids or the attention mask)
    resets = flags.reset_position_ids or (
        flags.create_attention_mask and flags.reset_attention_mask
    )
    need_eods = flags.eod_mask_loss or (not flags.inter_document_masking and resets)
    eods = np.flatnonzero(text[:, :seq] == eod_id) if need_eods else np.zeros(0, np.int64)
    loss_mask = np.ones((batch, seq), dtype=np.float32)
    if flags.eod_mask_loss:
        loss_mask.reshape(-1)[eods] = 0.0
    row_starts = np.arange(0, batch * seq, seq)
    attention_mask = None
    if flags.inter_document_masking:
        cu_seqlens, max_seqlen, piece_starts = _cu_seqlens(
            piece_rows, piece_sizes, batch, seq, extra
        )
        position_ids = _positions(np.union1d(row_starts, piece_starts), batch, seq)
    else:
        reset = None
        if resets:
            eod_runs = np.union1d(row_starts, eods[(eods + 1) % seq != 0] + 1)
            reset = _positions(eod_runs, batch, seq)
        if flags.reset_position_ids and reset is not None:
            position_ids = reset
        else:
            position_ids = np.tile(np.arange(seq, dtype=np.int64), (batch, 1))
        if flags.create_attention_mask:
            attention_mask = _attention_mask(
                reset if flags.reset_attention_mask else None, batch, seq
            )
    if may_hold_pad:
        loss_mask[labels == pad_id] = 0.0
        tokens[tokens == pad_id] = 0
        labels[labels == pad_id] = 0
    elif not extra:
        loss_mask[:, -1] = 0.0
        labels[:, -1] = 0
    out = {"tokens": tokens, "labels": labels}
    if attention_mask is not None:
        out["attention_mask"] = attention_mask
    out |= {"loss_mask": loss_mask, "position_ids": position_ids}
    if flags.inter_document_masking:
        out |= {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
    return out  # Megatron's key order for each flag combination


def _shift(text: np.ndarray, extra: bool, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``tokens``/``labels``: ``text[:-1]``/``text[1:]`` with the extra token; else ``text`` and
    ``text`` rolled left by one with the last label the pad id."""
    if extra:
        return text[:, :-1].astype(np.int64), text[:, 1:].astype(np.int64)
    labels = np.empty(text.shape, dtype=np.int64)
    labels[:, :-1] = text[:, 1:]
    labels[:, -1:] = pad_id
    return text.astype(np.int64), labels


def _positions(run_starts: np.ndarray, batch: int, seq: int) -> np.ndarray:
    """Position ids ``[B, S]`` counting from 0 at each run start (sorted, unique flat positions
    including every row start): a cumulative sum of ones, in place, that steps back to 0 at
    each run start (one buffer: no ``B·S`` temporaries)."""
    out = np.ones(batch * seq, dtype=np.int64)
    if len(run_starts):
        lengths = np.diff(run_starts, append=batch * seq)
        out[run_starts[1:]] = 1 - lengths[:-1]
        out[0] = 0
        np.cumsum(out, out=out)
    return out.reshape(batch, seq)


def _attention_mask(reset_positions: np.ndarray | None, batch: int, seq: int) -> np.ndarray:
    """bool ``[B, 1, S, S]``, True = may not attend: later columns (causal) and, given the
    positions that restart after each EOD, columns before the row's run (an EOD between).

    Row ``r`` at restarted position ``d`` may attend exactly to columns ``r-d..r``: the window
    at offset ``S-1-r`` of ``allowed[d]``, a ``2S`` row open on ``S-1-d..S-1``. So the mask is
    one gather of ``S``-byte rows from a strided view of that ``[S, 2S]`` table.
    """
    columns = np.arange(seq)
    if reset_positions is None:
        out = np.empty((batch, 1, seq, seq), dtype=bool)
        out[:, 0] = columns[None, :] > columns[:, None]
        return out
    j = np.arange(2 * seq)
    masked = (j[None, :] < seq - 1 - columns[:, None]) | (j[None, :] > seq - 1)
    windows = np.lib.stride_tricks.as_strided(
        masked, shape=(seq, seq, seq), strides=(2 * seq, 1, 1), writeable=False
    )
    offsets = np.broadcast_to(seq - 1 - columns, (batch, seq))
    return windows[reset_positions, offsets].reshape(batch, 1, seq, seq)


def _cu_seqlens(
    piece_rows: np.ndarray, piece_sizes: np.ndarray, batch: int, seq: int, extra: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int32 ``cu_seqlens`` ``[B, S + 1]`` of the pieces (§11.4: the extra token off the last
    piece, which is dropped if that empties it; padding folded into the last piece; padded with
    S), int32 ``max_seqlen`` ``[B]``, and the flat positions where pieces start."""
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
    end = ends_total - np.repeat(np.concatenate([[0], ends_total])[firsts], counts)
    start = end - sizes
    rank = np.arange(len(rows)) - np.repeat(firsts, counts)
    last = rank == np.repeat(counts, counts) - 1
    cu_seqlens = np.full((batch, seq + 1), seq, dtype=np.int32)
    cu_seqlens[:, 0] = 0
    cu_seqlens[rows[~last], rank[~last] + 1] = end[~last]  # the last piece ends at S
    max_seqlen = np.full(batch, seq, dtype=np.int32)  # rows left without a piece: one of S
    max_seqlen[counts > 0] = 0
    np.maximum.at(max_seqlen, rows, np.where(last, seq - start, sizes).astype(np.int32))
    inside = start < seq
    return cu_seqlens, max_seqlen, rows[inside] * seq + start[inside]
