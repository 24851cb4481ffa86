"""BatchSampler: same global batches for every world size, contiguous rank slices, O(1) resume."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.errors import ConfigError
from tokenmill.loader import BatchSampler

WORLD_SIZES = (1, 2, 4, 8)


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, int]:
    """(num_samples, global batch size divisible by 8)."""
    global_batch = 8 * draw(st.integers(1, 8))
    return draw(st.integers(0, 40 * global_batch)), global_batch


def _steps(sampler: BatchSampler) -> list[list[int]]:
    return [batch.tolist() for batch in sampler]


@settings(max_examples=60, deadline=None)
@given(shapes())
def test_union_over_ranks_is_the_global_batch_for_every_world_size(shape: tuple[int, int]) -> None:
    num_samples, global_batch = shape
    reference = _steps(BatchSampler(num_samples, global_batch))
    assert len(reference) == num_samples // global_batch
    for world in WORLD_SIZES:
        per_rank = [_steps(BatchSampler(num_samples, global_batch, r, world)) for r in range(world)]
        for step, batch in enumerate(reference):
            joined = [i for rank in per_rank for i in rank[step]]
            assert joined == batch
            assert all(len(rank[step]) == global_batch // world for rank in per_rank)


@settings(max_examples=60, deadline=None)
@given(shapes(), st.integers(0, 50), st.sampled_from(WORLD_SIZES), st.data())
def test_start_step_equals_skipping_steps(
    shape: tuple[int, int], start: int, world: int, data: st.DataObject
) -> None:
    num_samples, global_batch = shape
    rank = data.draw(st.integers(0, world - 1))
    full = _steps(BatchSampler(num_samples, global_batch, rank, world))
    resumed = BatchSampler(num_samples, global_batch, rank, world, start_step=start)
    assert _steps(resumed) == full[start:]
    assert len(resumed) == len(full[start:])
    consumed = start * global_batch  # Megatron's checkpoint records this, not the step
    by_samples = BatchSampler(num_samples, global_batch, rank, world, consumed_samples=consumed)
    assert _steps(by_samples) == _steps(resumed)
    assert by_samples.start_step == start


@settings(max_examples=40, deadline=None)
@given(shapes())
def test_every_sample_once_and_partial_batch_dropped(shape: tuple[int, int]) -> None:
    num_samples, global_batch = shape
    seen = np.concatenate([np.empty(0, np.int64), *BatchSampler(num_samples, global_batch)])
    assert seen.tolist() == list(range(num_samples - num_samples % global_batch))


def test_resume_far_into_a_huge_run_is_immediate() -> None:
    sampler = BatchSampler(10**15, 1024, rank=3, world_size=8, start_step=10**11)
    first = next(iter(sampler))
    assert first[0] == 10**11 * 1024 + 3 * 128
    assert len(first) == 128
    assert len(sampler) == 10**15 // 1024 - 10**11


def test_indices_are_this_ranks_slice_of_the_global_batch() -> None:
    sampler = BatchSampler(100, 16, rank=1, world_size=4)
    assert sampler.indices(2).tolist() == [36, 37, 38, 39]
    with pytest.raises(IndexError, match="step 6 out of range"):
        sampler.indices(6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 6, 0, 4), "global_batch_size 6 is not divisible by world_size 4"),
        ((10, 8, 4, 4), r"rank must be in \[0, 4\), got 4"),
        ((10, 0), "global_batch_size must be an integer >= 1, got 0"),
        ((10, 8, 0, 1, -1), "start_step must be an integer >= 0, got -1"),
        ((-1, 8), "num_samples must be an integer >= 0, got -1"),
    ],
)
def test_bad_settings_are_config_errors(args: tuple[int, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BatchSampler(*args)


def test_consumed_samples_is_exclusive_with_start_step_and_a_global_batch_multiple() -> None:
    with pytest.raises(ConfigError, match="takes start_step or consumed_samples, not both"):
        BatchSampler(100, 8, start_step=1, consumed_samples=8)
    with pytest.raises(ConfigError, match="consumed_samples 12 is not a multiple of global_b"):
        BatchSampler(100, 8, consumed_samples=12)
    with pytest.raises(ConfigError, match="consumed_samples must be an integer >= 0, got -8"):
        BatchSampler(100, 8, consumed_samples=-8)
    assert BatchSampler(100, 8, start_step=0, consumed_samples=0).start_step == 0
