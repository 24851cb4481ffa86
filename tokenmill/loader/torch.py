"""Optional PyTorch adapter: a map-style Dataset and a collate giving ``input_ids``/``labels``.

    from torch.utils.data import DataLoader
    from tokenmill.loader import BatchSampler, open_blend
    from tokenmill.loader.torch import TokenDataset, collate

    ds = TokenDataset(open_blend("blends/mix", split="train"))
    sampler = BatchSampler(len(ds), 512, rank=r, world_size=w, start_step=b)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=2)

With a batch sampler, DataLoader calls ``__getitems__`` once per step: one vectorized
``get_batch``. Also: §11 training inputs (``training_batch``, ``TrainingDataset``, and
``packed_collate`` for Hugging Face models), ``growth_loader`` for ``FollowGrowth``, and
nanotron's dataset and sampler (``NanotronDataset``, ``nanotron_sampler``); the user guide's §5
shows each.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from tokenmill.errors import ConfigError
from tokenmill.loader import BlendedDataset, FollowGrowth, NanosetDataset

_Samples = BlendedDataset | NanosetDataset

IGNORE_INDEX = -100  # the label Hugging Face losses skip


class _Adapter(Dataset):  # type: ignore[type-arg]
    """A NanosetDataset or BlendedDataset as a torch map-style Dataset."""

    def __init__(self, samples: _Samples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def _tokens(self, indices: Sequence[int]) -> torch.Tensor:
        """Samples ``indices`` read at once, ``[B, S + 1]`` int64."""
        return torch.from_numpy(self.samples.get_batch(np.asarray(indices, dtype=np.int64)))


class TokenDataset(_Adapter):
    """A NanosetDataset or BlendedDataset as a torch map-style Dataset of int64 tensors."""

    def __getitem__(self, k: int) -> torch.Tensor:
        return torch.from_numpy(self.samples[int(k)])

    def __getitems__(self, indices: Sequence[int]) -> torch.Tensor:
        """The whole batch at once, ``[B, S + 1]`` (used by DataLoader with a batch sampler)."""
        return self._tokens(indices)


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


class TrainingDataset(_Adapter):
    """A NanosetDataset or BlendedDataset whose items are §11 training dicts of tensors
    (``get_training_batch`` with fixed flags, e.g. ``eod_id``, ``inter_document_masking``)."""

    def __init__(self, samples: _Samples, **flags: Any) -> None:
        super().__init__(samples)
        self.flags = flags

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


class NanotronDataset(_Adapter):
    """Items as nanotron's collators take them: ``{"input_ids": int64 tensor [S + 1]}``, as the
    Nanoset of huggingface/nanotron#102 (whose indices the ``nanotron`` semantics follow) returns
    them; a CPU ``torch.LongTensor`` stacks under both its ``np.vstack`` and ``torch.vstack``
    collators."""

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.from_numpy(self.samples[int(k)])}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """The samples of one batch, read at once (DataLoader calls this per batch)."""
        return [{"input_ids": row} for row in self._tokens(indices)]


class NanotronSkipSampler(Sampler[int]):
    """nanotron's ``SkipBatchSampler`` over a per-rank sampler: drops the first
    ``consumed_train_samples // dp_size`` indices of this rank (its resume rule)."""

    def __init__(self, sampler: DistributedSampler[int], skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


def nanotron_sampler(
    dataset: Sized,
    dp_rank: int,
    dp_size: int,
    *,
    seed: int = 42,
    consumed_train_samples: int = 0,
    drop_last: bool = True,
) -> DistributedSampler[int] | NanotronSkipSampler:
    """The sampler nanotron's ``get_sampler`` (src/nanotron/dataloader.py of huggingface/
    nanotron#102) builds for a Nanoset: ``DistributedSampler(dataset, num_replicas=dp_size,
    rank=dp_rank, seed=seed, drop_last=drop_last)`` with the default ``shuffle=True``, skipping
    ``consumed_train_samples // dp_size`` indices on resume (its ``SkipBatchSampler``).

    Its order depends on ``dp_size`` (a second shuffle dealt round-robin to the ranks), so a
    resume must keep it; use it to reproduce a nanotron run, ``BatchSampler`` otherwise.
    """
    for name, value, low in (
        ("dp_size", dp_size, 1),
        ("consumed_train_samples", consumed_train_samples, 0),
    ):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
            raise ConfigError(f"nanotron_sampler {name} must be an integer >= {low}, got {value!r}")
    if not isinstance(dp_rank, int | np.integer) or not 0 <= dp_rank < dp_size:
        raise ConfigError(f"nanotron_sampler dp_rank must be in [0, {dp_size}), got {dp_rank!r}")
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset,  # type: ignore[arg-type]
        num_replicas=int(dp_size),
        rank=int(dp_rank),
        shuffle=True,
        seed=seed,
        drop_last=drop_last,
    )
    if consumed_train_samples > 0:
        return NanotronSkipSampler(sampler, int(consumed_train_samples) // int(dp_size))
    return sampler


def growth_loader(follow: FollowGrowth, start_step: int = 0, **kwargs: Any) -> DataLoader:  # type: ignore[type-arg]
    """A DataLoader over the version ``follow`` uses, from ``start_step`` (this rank's slice of
    each global batch, :func:`collate`d unless ``collate_fn`` is given). Make a new one from
    the same step after ``follow.refresh()`` switched versions: workers hold the old one."""
    kwargs.setdefault("collate_fn", collate)
    batches: Any = follow.sampler(start_step)  # yields index arrays, not the lists typed
    return DataLoader(TokenDataset(follow.ds), batch_sampler=batches, **kwargs)
