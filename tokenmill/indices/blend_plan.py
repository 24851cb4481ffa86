"""Owns a blend build's plan: the checked settings, each dataset's identity entry (copied from
its manifest, never reading a ``.bin``) and, per split, the ranges, skipped datasets, sample
counts and Nanoset cache hashes, all computed before anything is written.

A split whose spec weight is 0 is absent. A dataset whose split yields no sample (an empty
range, or too few tokens for one sample) is left out of that split and listed in its ``skipped``
with the reason; the others are blended as if it were not in the blend (weights renormalized:
the blend Megatron builds from those datasets alone); a split every dataset is left out of is
absent. A train split, and a valid/test split with a requested count, is a weighted blend (sizes:
FORMATS §7.2/§7.3). A valid/test split without one uses one epoch of every dataset: megatron
blends them exhaustively (every sample once, Megatron's full-validation rule), nanotron blends
``Σ len`` samples with the configured weights (its reference behaviour).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import file_sha256
from tokenmill.errors import ConfigError, FormatError
from tokenmill.formats.blend_manifest import SPLITS
from tokenmill.formats.dataset_manifest import (
    dataset_content_hash,
    dataset_manifest_path,
    file_problems,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDataset, data_file_path, index_file_path
from tokenmill.formats.virtual_merge import is_virtual
from tokenmill.indices import blend as blending
from tokenmill.indices import growing_blend
from tokenmill.indices._nanoset_indices import parse_split
from tokenmill.indices._sample_index import count_samples
from tokenmill.indices.nanoset import SEMANTICS, FetchEntry, entry_key, split_ranges
from tokenmill.indices.settings import NanosetSettings

# Megatron's add_extra_token_to_sequence and drop_last_partial_validation_sequence (both on by
# default; the second applies to the valid split only: train and test always drop).
FLAGS = ("add_extra_token", "drop_last_partial_validation")
DIGEST_FIELDS = ("bytes", "sha256", "parts", "sha256_of_parts")


def file_entry(path: Path, base: Path, sha256: str | None = None) -> dict[str, Any]:
    """``{path relative to base, bytes, sha256}`` (hashing unless the hash is already known)."""
    return {
        "path": os.path.relpath(path, base),
        "bytes": path.stat().st_size,
        "sha256": sha256 or file_sha256(path),
    }


def dataset_entry(name: str, prefix: Path, base: Path) -> dict[str, Any]:
    """A dataset's identity: relative prefix, content hash, dtype, counts and file digests. With
    a dataset manifest the digests and content hash are copied from it after a size check (a file
    of another size is a FormatError): the ``.bin`` is never read and need not be present. Only
    a hand-made pair without a manifest is hashed."""
    has_manifest = dataset_manifest_path(prefix).is_file()
    if has_manifest and not index_file_path(prefix).is_file():
        manifest = read_dataset_manifest(prefix)
        if is_virtual(manifest):  # its manifest records every shard pair's digests: none is read
            entry = {
                "name": name,
                "prefix": os.path.relpath(prefix, base),
                "content_hash": str(manifest["content_hash"]),
                "dtype": str(manifest["dtype"]),
                "num_sequences": int(manifest["counts"]["sequences"]),
                "num_tokens": int(manifest["counts"]["tokens"]),
                "files": {"manifest": file_entry(dataset_manifest_path(prefix), base)},
            }
            return entry | ({"takedown": manifest["takedown"]} if "takedown" in manifest else {})
    # The .idx header and counts; with a manifest the .bin need not even be there (an S3 step
    # stages the .idx and manifest only), else it is sized and hashed.
    data = IndexedDataset(prefix, index_only=has_manifest)
    recorded = read_dataset_manifest(prefix) if has_manifest else None
    if recorded is not None and data_file_path(prefix).is_file():
        if problems := file_problems(prefix, recorded, full=False):
            raise FormatError(prefix, "files", "; ".join(problems))
    elif recorded is not None:
        dataset_content_hash(prefix, index_only=True)  # the .idx size, or FormatError
    files = {}
    for kind, path in (("bin", data_file_path(prefix)), ("idx", index_file_path(prefix))):
        if recorded is None:
            files[kind] = file_entry(path, base)
        else:
            info = recorded["files"][path.name]
            digest = {k: info[k] for k in DIGEST_FIELDS if k in info}
            files[kind] = {"path": os.path.relpath(path, base), **digest}
    return {
        "name": name,
        "prefix": os.path.relpath(prefix, base),
        "content_hash": (
            dataset_content_hash(prefix) if recorded is None else str(recorded["content_hash"])
        ),
        "dtype": data.dtype.name,
        "num_sequences": len(data),
        "num_tokens": data.num_tokens,
        "files": files,
    }


def check_settings(
    datasets: Mapping[str, Any],
    weights: Mapping[str, float] | None,
    temperature: float | None,
    settings: NanosetSettings,
) -> None:
    """ConfigError for every setting build_blend cannot use, naming the setting and value."""
    semantics, sequence_length = settings.semantics, settings.sequence_length
    if not datasets:
        raise ConfigError("a blend needs at least one dataset")
    if (weights is None) == (temperature is None):
        raise ConfigError("give exactly one of weights and temperature")
    if weights is not None:
        if set(weights) != set(datasets):
            raise ConfigError(
                f"weights name {sorted(weights)} but the datasets are {sorted(datasets)}"
            )
        bad = {k: w for k, w in weights.items() if not (math.isfinite(w) and w >= 0)}
        if bad or not sum(weights.values()) > 0:
            raise ConfigError(f"weights must be finite, >= 0 and not all 0, got {dict(weights)}")
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    if semantics not in SEMANTICS:
        raise ConfigError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    if sequence_length < 2:
        raise ConfigError(f"sequence_length must be >= 2, got {sequence_length}")
    flags = {flag: getattr(settings, flag) for flag in FLAGS}
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{flag} must be true or false, got {value!r}")
    if semantics == "nanotron" and not all(flags.values()):
        raise ConfigError(
            "nanotron semantics always adds the extra token and drops the last partial "
            f"sample: add_extra_token and drop_last_partial_validation must be true, got "
            f"{settings.add_extra_token} and {settings.drop_last_partial_validation}"
        )
    if semantics == "growing" and not settings.drop_last_partial_validation:
        raise ConfigError(
            "growing semantics always drops the last partial sample (it would change as data "
            "grows): drop_last_partial_validation must be true"
        )
    for split, n in settings.sizes().items():
        if (n is None and split == "train" and semantics != "growing") or (n is not None and n < 1):
            raise ConfigError(f"{split}_samples must be an integer >= 1, got {n!r}")


@dataclass(frozen=True)
class Plan:
    """Everything the per-split builder needs, fixed for the whole blend."""

    name: str
    base: Path  # the version folder every recorded path is relative to (may not exist yet)
    cache_dir: Path
    prefixes: dict[str, Path]
    lengths: dict[str, np.ndarray]
    weights: list[float]
    settings: NanosetSettings
    content_hashes: dict[str, str]
    fetch: FetchEntry | None = None  # brings a stored index entry (remote storage) before a build
    growing: growing_blend.GrowingState | None = None  # growing semantics only

    def ranges(self, position: int) -> dict[str, tuple[int, int] | None]:
        """Each dataset's range of split ``SPLITS[position]`` (growing: None, no range)."""
        if self.growing is not None:
            return {n: None for n in self.lengths}
        spec, semantics = self.settings.split_spec, self.settings.semantics
        return {
            n: split_ranges(spec, len(lengths), semantics)[position]
            for n, lengths in self.lengths.items()
        }

    def skipped(self, position: int) -> dict[str, str]:
        """The datasets left out of split ``SPLITS[position]`` (no sample), with the reason."""
        split = SPLITS[position]
        spec, seq = self.settings.split_spec, self.settings.sequence_length
        extra = 1 if self.settings.add_extra_token else 0
        if self.growing is not None:  # every dataset stays in (growing_blend's docstring)
            why = f"split {split!r} has weight 0 in {spec!r}"
            return {} if parse_split(spec)[position] > 0 else dict.fromkeys(self.prefixes, why)
        out = {}
        for name, r in self.ranges(position).items():
            if r is None or r[0] >= r[1]:
                out[name] = (
                    f"no sequences in split {split!r}: {len(self.lengths[name])} sequences "
                    f"split {spec!r} give it the range {r and list(r)}"
                )
                continue
            tokens = int(self.lengths[name][r[0] : r[1]].sum(dtype=np.int64))
            if self.settings.semantics == "nanotron":
                empty = (tokens - 1) // seq < 1
            elif tokens <= 1:
                empty = True
            else:  # with a requested size Megatron repeats the split: any token suffices
                one_epoch = count_samples(tokens, seq, extra, self.settings.drop_last(split))
                empty = self.settings.sizes()[split] is None and one_epoch == 0
            if empty:
                out[name] = (
                    f"no sample in split {split!r}: its {r[1] - r[0]} sequences hold {tokens} "
                    f"tokens, fewer than one sample of sequence_length {seq} (+{extra})"
                )
        return out

    def present(self, position: int) -> list[str]:
        """The datasets blended in split ``SPLITS[position]``, in blend order."""
        skipped = self.skipped(position)
        return [n for n in self.prefixes if n not in skipped]

    def split_weights(self, position: int) -> list[float]:
        """The configured weights of the datasets present in the split (normalized by the
        blend like any configured weights: the skipped ones are renormalized away)."""
        present = set(self.present(position))
        return [w for n, w in zip(self.prefixes, self.weights, strict=True) if n in present]

    def counts(self, split: str) -> list[int | None]:
        """The ``num_samples`` each present dataset's index of ``split`` is built with."""
        position = SPLITS.index(split)
        requested = self.settings.sizes()[split]
        if requested is None or self.growing is not None:  # growing: the cap is the blend's
            return [None] * len(self.present(position))
        weights, semantics = self.split_weights(position), self.settings.semantics
        return list(blending.blend_sample_counts(weights, requested, semantics=semantics))

    def cache_hashes(self) -> dict[str, list[str | None]]:
        """The Nanoset cache hash of every (split, dataset) the blend uses, computed from the
        settings and content hashes without building anything (None: empty split range)."""
        found = {}
        shards = {} if self.growing is None else self.growing.shards
        for position, split in enumerate(SPLITS):
            present = self.present(position)
            if not present:
                continue
            nums = dict(zip(present, self.counts(split), strict=True))
            keys = [  # a skipped dataset has no index in the split
                entry_key(
                    len(self.lengths[n]),
                    self.content_hashes[n],
                    split,
                    self.settings,
                    nums[n],
                    shards=shards.get(n),
                )
                if n in nums
                else None
                for n in self.prefixes
            ]
            found[split] = [None if key is None else key[1] for key in keys]
        return found


def skipped_warnings(manifest: dict[str, Any]) -> list[str]:
    """One warning per dataset left out of a split of a blend manifest (and per configured
    split every dataset was left out of), naming the dataset, the split and the reason."""
    warnings = []
    for split, weight in zip(SPLITS, parse_split(str(manifest["split"])), strict=True):
        if weight > 0 and split not in manifest["splits"]:
            warnings.append(
                f"blend {manifest['name']!r}: split {split!r} is absent: every dataset's "
                f"{split} split is empty with split {manifest['split']!r}"
            )
        for entry in manifest["splits"].get(split, {}).get("skipped", []):
            warnings.append(
                f"blend {manifest['name']!r}: dataset {entry['name']!r} is left out of split "
                f"{split!r}: {entry['reason']}"
            )
    return warnings
