"""Optional PyTorch adapter: a map-style Dataset and a collate giving ``input_ids``/``labels``.

    from torch.utils.data import DataLoader
    from tokenmill.loader import BatchSampler, open_blend
    from tokenmill.loader.torch import TokenDataset, collate

    ds = TokenDataset(open_blend("blends/mix", split="train"))
    sampler = BatchSampler(len(ds), 512, rank=r, world_size=w, start_step=b)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=2)

With a batch sampler, DataLoader calls ``__getitems__`` once per step, which reads the whole
batch with the vectorized ``get_batch``. Samples must carry the extra token (``S + 1`` tokens):
``input_ids = tokens[:, :-1]`` and ``labels = tokens[:, 1:]``.

Megatron-style training inputs (FORMATS §11: loss mask, position ids, attention mask or
``cu_seqlens``) come from ``training_batch(ds, indices, **flags)``, or per step through
``TrainingDataset(ds, **flags)``; ``packed_collate`` turns them into Hugging Face inputs::

    ds = TrainingDataset(open_blend(...), inter_document_masking=True)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=packed_collate)
    # {"input_ids", "labels" (-100 where the loss mask is 0), "position_ids"}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset


class _Samples(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, k: int) -> np.ndarray: ...
    def get_batch(self, indices: Any) -> np.ndarray: ...
    def get_training_batch(self, indices: Any, **flags: Any) -> dict[str, np.ndarray]: ...


IGNORE_INDEX = -100  # the label Hugging Face losses skip


class TokenDataset(Dataset):  # type: ignore[type-arg]
    """A NanosetDataset or BlendedDataset as a torch map-style Dataset of int64 tensors."""

    def __init__(self, samples: _Samples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, k: int) -> torch.Tensor:
        return torch.from_numpy(self.samples[int(k)])

    def __getitems__(self, indices: Sequence[int]) -> torch.Tensor:
        """The whole batch at once, ``[B, S + 1]`` (used by DataLoader with a batch sampler)."""
        return torch.from_numpy(self.samples.get_batch(np.asarray(indices, dtype=np.int64)))


def collate(batch: torch.Tensor | Sequence[torch.Tensor | np.ndarray]) -> dict[str, torch.Tensor]:
    """``{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}`` from a batch or its samples."""
    if isinstance(batch, torch.Tensor):
        tokens = batch
    else:
        tokens = torch.stack([torch.as_tensor(s) for s in batch])
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(
            f"collate expects [B, S + 1] tokens with S >= 1, got {tuple(tokens.shape)}"
        )
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def training_batch(samples: _Samples, indices: Any, **flags: Any) -> dict[str, torch.Tensor]:
    """``samples.get_training_batch(indices, **flags)`` as tensors (int64, float32, bool and
    int32 as Megatron's; they share memory with the numpy arrays)."""
    batch = samples.get_training_batch(np.asarray(indices, dtype=np.int64), **flags)
    return {key: torch.from_numpy(value) for key, value in batch.items()}


class TrainingDataset(Dataset):  # type: ignore[type-arg]
    """A NanosetDataset or BlendedDataset whose items are §11 training dicts of tensors
    (``get_training_batch`` with fixed flags, e.g. ``eod_id``, ``inter_document_masking``)."""

    def __init__(self, samples: _Samples, **flags: Any) -> None:
        self.samples = samples
        self.flags = flags

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        return {key: value[0] for key, value in self.__getitems__([k]).items()}

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The whole batch at once (used by DataLoader with a batch sampler)."""
        return training_batch(self.samples, indices, **self.flags)


def packed_collate(
    batch: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    *,
    flatten: bool = False,
) -> dict[str, torch.Tensor]:
    """Hugging Face inputs from training dicts: ``input_ids`` (tokens), ``labels`` with -100
    where the loss mask is 0, ``position_ids``; ``flatten`` makes them ``[1, B·S]``, the packed
    layout whose restarting position ids flash-attention models split documents by."""
    if not isinstance(batch, Mapping):
        batch = {key: torch.stack([sample[key] for sample in batch]) for key in batch[0]}
    out = {
        "input_ids": batch["tokens"],
        "labels": batch["labels"].masked_fill(batch["loss_mask"] == 0, IGNORE_INDEX),
        "position_ids": batch["position_ids"],
    }
    return {key: value.reshape(1, -1) for key, value in out.items()} if flatten else out
