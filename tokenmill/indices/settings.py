"""Owns ``NanosetSettings`` and ``BlendSettings``: every setting a Nanoset index or a blend is
built with, frozen values made once by the recipe (``NanosetConfig.settings()``,
``BlendConfig.settings()``) or the CLI and taken whole by the index and blend builders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from tokenmill.indices.growing import ERA_SAMPLES


@dataclass(frozen=True)
class NanosetSettings:
    """The index settings shared by every dataset and blend of a recipe (FORMATS §4-§7). The
    flags are Megatron's ``add_extra_token_to_sequence`` and
    ``drop_last_partial_validation_sequence`` (valid only); ``era_samples`` is for growing
    semantics; a requested size of None is one epoch (growing: no cap)."""

    sequence_length: int
    split_spec: str = "949,50,1"
    seed: int = 1234
    semantics: str = "megatron"
    add_extra_token: bool = True
    drop_last_partial_validation: bool = True
    era_samples: int = ERA_SAMPLES
    train_samples: int | None = None
    valid_samples: int | None = None
    test_samples: int | None = None

    def sizes(self) -> dict[str, int | None]:
        """The requested sample count of each split."""
        return {"train": self.train_samples, "valid": self.valid_samples, "test": self.test_samples}

    def index_sizes(self) -> dict[str, int | None]:
        """The requested sample count of each split of a dataset's own indices: :meth:`sizes`;
        under growing semantics none is capped (a blend caps its own size; the index grows)."""
        return dict.fromkeys(self.sizes()) if self.semantics == "growing" else self.sizes()

    def drop_last(self, split: str) -> bool:
        """The effective drop-last flag of ``split``: the validation setting applies to valid
        only; train and test always drop, as Megatron."""
        return split != "valid" or self.drop_last_partial_validation


@dataclass(frozen=True)
class BlendSettings:
    """Everything a blend build takes besides its name, datasets and folders: the index
    settings and exactly one of ``weights`` (``{dataset: weight}``, normalized by the build) and
    a token-count ``temperature``."""

    nanoset: NanosetSettings
    weights: Mapping[str, float] | None = field(default=None)
    temperature: float | None = None

    def __post_init__(self) -> None:
        if self.weights is not None:  # a read-only copy: the caller's dict may change later
            object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))
