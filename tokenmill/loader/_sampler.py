"""Deterministic, resumable data-parallel batch sampler over an already shuffled dataset.

Global batch ``b`` is samples ``[b·G, (b+1)·G)`` in index order (the indices already shuffle,
as in Megatron's pretraining sampler; a final partial batch is dropped), and rank ``r`` of ``w``
gets its slice ``[r·G/w, (r+1)·G/w)``: the same global batches for every ``w`` dividing ``G``,
and a resume at a step (or Megatron's ``consumed_samples`` = step · G) is O(1).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from tokenmill.errors import ConfigError


class BatchSampler:
    """Yields, per training step, this rank's sample indices (int64 array of ``G / world_size``)."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
        *,
        consumed_samples: int | None = None,
    ) -> None:
        for name, value, low in (
            ("num_samples", num_samples, 0),
            ("global_batch_size", global_batch_size, 1),
            ("world_size", world_size, 1),
            ("start_step", start_step, 0),
        ):
            if not isinstance(value, int | np.integer) or value < low:
                raise ConfigError(f"BatchSampler {name} must be an integer >= {low}, got {value!r}")
        if global_batch_size % world_size:
            raise ConfigError(
                f"BatchSampler global_batch_size {global_batch_size} is not divisible by "
                f"world_size {world_size}"
            )
        if not isinstance(rank, int | np.integer) or not 0 <= rank < world_size:
            raise ConfigError(f"BatchSampler rank must be in [0, {world_size}), got {rank!r}")
        if consumed_samples is not None:
            start_step = self._step_of(consumed_samples, global_batch_size, start_step)
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.start_step = int(start_step)
        self.micro_batch_size = self.global_batch_size // self.world_size

    @staticmethod
    def _step_of(consumed_samples: int, global_batch_size: int, start_step: int) -> int:
        """The step that Megatron's ``consumed_samples`` resumes at (``consumed / G``)."""
        if start_step:
            raise ConfigError(
                "BatchSampler takes start_step or consumed_samples, not both "
                f"(got start_step={start_step!r}, consumed_samples={consumed_samples!r})"
            )
        if not isinstance(consumed_samples, int | np.integer) or consumed_samples < 0:
            raise ConfigError(
                f"BatchSampler consumed_samples must be an integer >= 0, got {consumed_samples!r}"
            )
        if consumed_samples % global_batch_size:
            raise ConfigError(
                f"BatchSampler consumed_samples {consumed_samples} is not a multiple of "
                f"global_batch_size {global_batch_size} (a resume starts at a global batch)"
            )
        return int(consumed_samples) // int(global_batch_size)

    @property
    def total_steps(self) -> int:
        """Full global batches in the dataset (the final partial one is dropped)."""
        return self.num_samples // self.global_batch_size

    def indices(self, step: int) -> np.ndarray:
        """This rank's slice of global batch ``step``."""
        if not 0 <= step < self.total_steps:
            raise IndexError(f"step {step} out of range [0, {self.total_steps})")
        start = step * self.global_batch_size + self.rank * self.micro_batch_size
        return np.arange(start, start + self.micro_batch_size, dtype=np.int64)

    def __len__(self) -> int:
        """Steps remaining from ``start_step``."""
        return max(0, self.total_steps - self.start_step)

    def __iter__(self) -> Iterator[np.ndarray]:
        for step in range(self.start_step, self.total_steps):
            yield self.indices(step)
