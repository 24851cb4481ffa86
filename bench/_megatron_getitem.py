"""megatron-core ``GPTDataset.__getitem__`` (@d98e8a6, FORMATS §5.5 and §11) one sample at a time,
its torch calls mirrored in numpy, and the DataLoader's default collate (a stack per key): the
per-sample baseline ``get_training_batch`` is timed against in bench_loader.py.

As Megatron does, the sample is read piece by piece through ``IndexedDataset.get``; masks and
positions come from ``_get_ltor_masks_and_position_ids`` (a dense float ``tril`` per sample when
the attention mask is asked for, then one slice assignment per EOD); the flag-free masks are
computed once and reused. Unlike Megatron, the reused loss mask is copied before padding zeroes
it, so the values stay those of §11 (the copy costs microseconds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenmill.loader import NanosetDataset


def packed_lengths(pieces: list[int], extra: bool, seq: int) -> list[int]:
    """§11.4: the lengths ``cu_seqlens`` holds for a sample of ``seq`` tokens read in ``pieces``:
    the extra token off the last piece, and the padding (if any) added to the last one."""
    lengths = list(pieces)
    if extra:
        lengths[-1] -= 1
        if lengths[-1] == 0:
            lengths.pop()
    if sum(lengths) < seq:
        if lengths:
            lengths[-1] += seq - sum(lengths)
        else:
            lengths = [seq]
    return lengths


def ltor_masks_and_position_ids(
    data: np.ndarray,
    eod: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """Megatron's ``_get_ltor_masks_and_position_ids`` for one sample."""
    seq_length = data.size
    attention_mask = None
    if create_attention_mask:
        attention_mask = np.tril(np.ones((seq_length, seq_length), np.float32))[None]
    loss_mask = np.ones(seq_length, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = np.arange(seq_length, dtype=np.int64)
    if reset_position_ids or reset_attention_mask:
        prev_index = 0
        for i in position_ids[data == eod].tolist():
            if reset_attention_mask and attention_mask is not None:
                attention_mask[0, (i + 1) :, : (i + 1)] = 0
            if reset_position_ids:
                position_ids[(i + 1) :] -= i + 1 - prev_index
                prev_index = i + 1
    if attention_mask is not None:
        attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


class MegatronGetitem:
    """``GPTDataset.__getitem__`` over a NanosetDataset's index arrays and token file."""

    def __init__(self, ds: NanosetDataset, eod: int, **flags: bool) -> None:
        self.ds, self.eod, self.pad, self.flags = ds, eod, ds.pad_id, flags
        self.extra = ds.extra
        self.cacheable = not (
            flags["reset_position_ids"] or flags["reset_attention_mask"] or flags["eod_mask_loss"]
        )
        self.cached: tuple[Any, ...] | None = None

    def query(self, k: int) -> tuple[np.ndarray, list[int]]:
        """``_query_document_sample_shuffle_indices``: the sample and its pieces' lengths."""
        ds = self.ds
        j = int(ds.shuffle_index[k])
        beg, beg_offset = (int(v) for v in ds.sample_index[j])
        end, end_offset = (int(v) for v in ds.sample_index[j + 1])
        parts = []
        if beg == end:
            length = end_offset - beg_offset + self.extra
            parts.append(ds.data.get(int(ds.document_index[beg]), beg_offset, length))
        else:
            for i in range(beg, end + 1):
                offset = 0 if i > beg else beg_offset
                length = None if i < end else end_offset + self.extra
                parts.append(ds.data.get(int(ds.document_index[i]), offset, length))
        lengths = [len(p) for p in parts]
        short = ds.sequence_length + self.extra - sum(lengths)
        if short > 0:
            parts.append(np.full(short, self.pad))
        return np.concatenate(parts, dtype=np.int64), lengths

    def __call__(self, k: int) -> dict[str, np.ndarray]:
        f = self.flags
        text, lengths = self.query(k)
        if self.extra:
            tokens, labels = text[:-1], text[1:]
        else:
            tokens = text
            labels = np.roll(text, -1)
            labels[-1] = self.pad
        if self.cached is not None:
            masks = self.cached
        else:
            masks = ltor_masks_and_position_ids(
                tokens,
                self.eod,
                f["reset_position_ids"],
                f["reset_attention_mask"],
                f["eod_mask_loss"],
                f["create_attention_mask"] and not f["inter_document_masking"],
            )
            if self.cacheable:
                self.cached = masks
        attention_mask, loss_mask, position_ids = masks
        loss_mask = loss_mask.copy()
        loss_mask[labels == self.pad] = 0.0
        tokens[tokens == self.pad] = 0
        labels[labels == self.pad] = 0
        if f["inter_document_masking"]:
            return self._packed(tokens, labels, loss_mask, lengths)
        out = {"tokens": tokens, "labels": labels}
        if attention_mask is not None:
            out["attention_mask"] = attention_mask
        return {**out, "loss_mask": loss_mask, "position_ids": position_ids}

    def _packed(
        self, tokens: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray, lengths: list[int]
    ) -> dict[str, np.ndarray]:
        """§11.4: ``cu_seqlens`` and ``max_seqlen`` of the pieces; positions restart per piece."""
        seq = len(tokens)
        lengths = packed_lengths(lengths, self.extra, seq)
        cu = np.full(seq + 1, seq, dtype=np.int32)
        cu[: len(lengths) + 1] = np.cumsum([0, *lengths])
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]),
            "cu_seqlens": cu,
            "max_seqlen": np.int32(max(lengths)),
        }

    def batch(self, ks: np.ndarray) -> dict[str, np.ndarray]:
        """Each sample, then the default collate (one stack per key)."""
        samples = [self(int(k)) for k in ks]
        return {key: np.stack([s[key] for s in samples]) for key in samples[0]}
