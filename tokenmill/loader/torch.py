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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset


class _Samples(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, k: int) -> np.ndarray: ...
    def get_batch(self, indices: Any) -> np.ndarray: ...


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
