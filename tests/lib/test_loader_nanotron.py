"""nanotron users: ``{"input_ids": ...}`` items and nanotron's DistributedSampler order.

The sampler order is checked against ``torch.utils.data.DistributedSampler(..., shuffle=True,
seed=42)`` built here independently (what index-era nanotron's ``get_sampler`` constructs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokenmill.errors import ConfigError
from tokenmill.formats.indexed import IndexedDataset, IndexedDatasetWriter
from tokenmill.loader import BatchSampler, NanosetDataset

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from tokenmill.loader.torch import (  # noqa: E402
    NanotronDataset,
    NanotronSkipSampler,
    nanotron_sampler,
)

S = 4  # sequence length


def samples(tmp_path: Path, n: int) -> NanosetDataset:
    """``n`` samples of ``S + 1`` tokens cut from one document of ``n·S + 1`` tokens
    (``1000 + position``), read through a reversed shuffle index."""
    prefix = tmp_path / f"doc{n}_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        length = n * S + 1
        writer.add_document(np.arange(length) + 1000, [length])

    sample_index = [[0, k * S] for k in range(n + 1)]
    shuffle = np.arange(n, dtype=np.uint32)[::-1].copy()
    return NanosetDataset(
        IndexedDataset(prefix), np.array([0], np.int32), np.array(sample_index, np.int32), shuffle,
        sequence_length=S,
    )  # fmt: skip


def reference(n: int, rank: int, size: int, seed: int = 42, epoch: int = 0) -> list[int]:
    ref = DistributedSampler(
        range(n), num_replicas=size, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    ref.set_epoch(epoch)
    return list(ref)


def test_items_are_input_ids_long_tensors(tmp_path: Path) -> None:
    ds = samples(tmp_path, 6)
    wrapped = NanotronDataset(ds)
    assert len(wrapped) == 6
    item = wrapped[0]
    assert list(item) == ["input_ids"]  # nanotron's collator asserts this is the only key
    assert item["input_ids"].dtype == torch.int64 and item["input_ids"].shape == (S + 1,)
    assert item["input_ids"].tolist() == [1020, 1021, 1022, 1023, 1024]  # shuffle[0] = 5
    batch = wrapped.__getitems__([3, 0, 5])
    assert [list(b) for b in batch] == [["input_ids"]] * 3
    for b, k in zip(batch, [3, 0, 5], strict=True):
        assert torch.equal(b["input_ids"], wrapped[k]["input_ids"])
    # What nanotron's DataCollatorForCLM does with the items (np.vstack), and later torch.vstack.
    stacked = np.vstack([b["input_ids"] for b in batch])
    assert stacked.dtype == np.int64
    np.testing.assert_array_equal(stacked, ds.get_batch([3, 0, 5]))
    assert torch.vstack([b["input_ids"] for b in batch]).tolist() == stacked.tolist()


@pytest.mark.parametrize("n", [10, 11])
def test_sampler_order_is_distributed_sampler_seed_42(tmp_path: Path, n: int) -> None:
    wrapped = NanotronDataset(samples(tmp_path, n))
    for rank in (0, 1):
        sampler = nanotron_sampler(wrapped, rank, 2)
        assert isinstance(sampler, DistributedSampler)
        assert list(sampler) == reference(n, rank, 2)
        assert len(sampler) == n // 2
    assert list(nanotron_sampler(wrapped, 0, 2, seed=7)) == reference(n, 0, 2, seed=7)
    assert reference(n, 0, 2, seed=7) != reference(n, 0, 2)


@pytest.mark.parametrize("n", [10, 11])
def test_two_ranks_cover_each_index_once_per_epoch(tmp_path: Path, n: int) -> None:
    wrapped = NanotronDataset(samples(tmp_path, n))
    orders = []
    for epoch in (0, 1):
        ranks = [nanotron_sampler(wrapped, rank, 2) for rank in (0, 1)]
        for sampler in ranks:
            sampler.set_epoch(epoch)
        seen = [k for sampler in ranks for k in sampler]
        assert len(seen) == len(set(seen)) == 2 * (n // 2)  # drop_last: the odd one out is left
        if n % 2 == 0:
            assert sorted(seen) == list(range(n))
        assert list(ranks[1]) == reference(n, 1, 2, epoch=epoch)
        orders.append(list(ranks[0]))
    assert orders[0] != orders[1]  # set_epoch reshuffles, as torch's sampler does


def test_order_differs_from_batch_sampler(tmp_path: Path) -> None:
    wrapped = NanotronDataset(samples(tmp_path, 12))
    ours = [k for step in BatchSampler(12, 4, rank=0, world_size=2) for k in step.tolist()]
    assert ours == [0, 1, 4, 5, 8, 9]  # contiguous slices of index-order global batches
    assert list(nanotron_sampler(wrapped, 0, 2)) == reference(12, 0, 2) != ours


def test_consumed_train_samples_skip_this_ranks_share(tmp_path: Path) -> None:
    wrapped = NanotronDataset(samples(tmp_path, 12))
    for rank in (0, 1):
        resumed = nanotron_sampler(wrapped, rank, 2, consumed_train_samples=4)
        assert isinstance(resumed, NanotronSkipSampler)
        assert list(resumed) == reference(12, rank, 2)[2:]  # nanotron: consumed // dp_size
        assert len(resumed) == 4
    assert list(nanotron_sampler(wrapped, 0, 2, consumed_train_samples=100)) == []
    assert len(nanotron_sampler(wrapped, 0, 2, consumed_train_samples=100)) == 0


def test_dataloader_as_nanotron_builds_it(tmp_path: Path) -> None:
    ds = samples(tmp_path, 11)
    wrapped = NanotronDataset(ds)

    def collate(examples: list[dict[str, torch.Tensor]]) -> np.ndarray:
        assert all(list(example.keys()) == ["input_ids"] for example in examples)
        return np.vstack([example["input_ids"] for example in examples])

    for rank in (0, 1):
        sampler = nanotron_sampler(wrapped, rank, 2, consumed_train_samples=2)
        loader = DataLoader(
            wrapped, batch_size=2, sampler=sampler, collate_fn=collate, drop_last=True
        )
        order = reference(11, rank, 2)[1:]
        batches = list(loader)
        assert len(batches) == len(order) // 2
        for b, batch in enumerate(batches):
            np.testing.assert_array_equal(batch, ds.get_batch(order[2 * b : 2 * b + 2]))


@pytest.mark.parametrize(
    ("rank", "size", "consumed", "message"),
    [
        (2, 2, 0, "dp_rank must be in"),
        (-1, 2, 0, "dp_rank must be in"),
        (0, 0, 0, "dp_size must be an integer >= 1"),
        (0, 2, -1, "consumed_train_samples must be an integer >= 0"),
        (0, 2, 1.5, "consumed_train_samples must be an integer >= 0"),
    ],
)
def test_bad_sampler_arguments_are_refused(
    tmp_path: Path, rank: int, size: int, consumed: object, message: str
) -> None:
    wrapped = NanotronDataset(samples(tmp_path, 4))
    with pytest.raises(ConfigError, match=message):
        nanotron_sampler(wrapped, rank, size, consumed_train_samples=consumed)  # type: ignore[arg-type]
