"""Owns ``NanosetSettings``: every setting a Nanoset index or a blend is built with, one frozen
value made by the recipe (``NanosetConfig.settings()``) or a caller, and the one mapping from it
to the index builders' keywords."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.indices.growing import ERA_SAMPLES


@dataclass(frozen=True)
class NanosetSettings:
    """The index settings shared by every dataset and blend of a recipe (FORMATS §4-§7).

    ``add_extra_token`` and ``drop_last_partial_validation`` are Megatron's
    ``add_extra_token_to_sequence`` and ``drop_last_partial_validation_sequence`` (the latter
    for the valid split only); ``era_samples`` matters to growing semantics only; a requested
    size of None is one epoch of the split (train: no cap under growing semantics).
    """

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

    def drop_last(self, split: str) -> bool:
        """The effective drop-last flag of ``split``: the validation setting applies to valid
        only; train and test always drop, as Megatron."""
        return split != "valid" or self.drop_last_partial_validation

    def index_keywords(self, split: str) -> dict[str, Any]:
        """The keywords of ``build_or_load``/``build_or_load_lengths``/``entry_key`` for
        ``split``, less ``num_samples`` (the era size only under growing semantics: it is no
        part of the other semantics' cache key)."""
        era = {"era_samples": self.era_samples} if self.semantics == "growing" else {}
        return {
            **era,
            "split": split,
            "split_spec": self.split_spec,
            "sequence_length": self.sequence_length,
            "seed": self.seed,
            "semantics": self.semantics,
            "add_extra_token": self.add_extra_token,
            "drop_last_partial": self.drop_last(split),
        }

    def blend_keywords(self) -> dict[str, Any]:
        """The keywords of ``build_blend``/``blend_version``/``blend_skips`` (less the
        weighting)."""
        return {
            "sequence_length": self.sequence_length,
            "split_spec": self.split_spec,
            "seed": self.seed,
            "semantics": self.semantics,
            "add_extra_token": self.add_extra_token,
            "drop_last_partial_validation": self.drop_last_partial_validation,
            "era_samples": self.era_samples,
            **{f"{split}_samples": n for split, n in self.sizes().items()},
        }
