"""Nanoset indices: split ranges, document/sample/shuffle indices, and their on-disk cache.

``semantics="megatron"`` follows megatron-core GPTDataset and ``semantics="nanotron"`` the
index-era nanotron Nanoset, both bit-exact (FORMATS.md §4–§6; algorithms in
``_nanoset_indices``); ``semantics="growing"`` (``growing``) only ever extends as shards are
appended. :func:`build_or_load` caches one split's arrays (``tokenmill.formats.nanoset_cache``)
under the md5 of a key holding everything that changes them (``nanoset_keys``), so unlike both
references it never reuses a stale cache.

A virtual merge's masked (taken-down) documents are left out: megatron and nanotron index it as
the physical merge of its unmasked documents (ids then mapped back to the merge's), so samples
after the first removed document can change; growing drops them from their split by identity
(samples packed before the first stay). The mask enters the key via the content hash.

An entry needs only the dataset's :class:`IndexInputs`, never its ``.bin``: :func:`entry_key`
names a split's entry from counts alone and :func:`cache_entry` from the inputs, so remote
storage can be asked for an entry by name first; :meth:`Entry.ensure` commits it and
:meth:`Entry.load` maps it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats import nanoset_cache as cache
from tokenmill.formats.nanoset_cache import entry_paths as cache_paths
from tokenmill.indices import growing, growing_segments
from tokenmill.indices._nanoset_indices import SPLITS, compute_indices, split_ranges
from tokenmill.indices.nanoset_inputs import IndexInputs, index_lengths, masked_of, unmasked
from tokenmill.indices.nanoset_keys import (
    SEMANTICS,
    cache_key,
    check_choices,
    entry_key,
    index_version,
)
from tokenmill.indices.settings import NanosetSettings

__all__ = [
    "SEMANTICS",
    "SPLITS",
    "Entry",
    "IndexInputs",
    "NanosetIndex",
    "build_nanoset_indices",
    "build_or_load",
    "cache_entry",
    "cache_key",
    "cache_paths",
    "entry_key",
    "index_lengths",
    "index_version",
    "masked_of",
    "split_ranges",
    "verify_index",
]


def build_nanoset_indices(
    sequence_lengths: np.ndarray | Sequence[int],
    split_range: tuple[int, int],
    *,
    sequence_length: int,
    seed: int,
    num_samples: int | None,
    semantics: str = "megatron",
    add_extra_token: bool = True,
    drop_last_partial: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) of one split, values and dtypes as the
    reference, over all the dataset's ``sequence_lengths`` (the .idx array); ``drop_last_partial``
    is the split's effective flag (Megatron applies its validation setting to valid only)."""
    params = {
        "sequence_length": sequence_length,
        "seed": seed,
        "num_samples": num_samples,
        "semantics": semantics,
        "add_extra_token": add_extra_token,
        "drop_last_partial": drop_last_partial,
    }
    return compute_indices(sequence_lengths, split_range, params)[:3]


@dataclass(frozen=True)
class NanosetIndex:
    """One split's cached indices, memory-mapped read-only, with its verified description."""

    split: str
    cache_hash: str
    description: dict[str, Any]
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray
    paths: dict[str, Path]

    def __len__(self) -> int:
        """Number of samples (the length of the shuffle index)."""
        return len(self.shuffle_index)


FetchEntry = Callable[[Mapping[str, Path]], object]


@dataclass(frozen=True)
class Entry:
    """One split's cache entry, named by its key: its files, and what builds them. ``previous``:
    the description of the entry this growing one extends (writing only the rows after it)."""

    inputs: IndexInputs
    cache_dir: Path
    paths: dict[str, Path]
    key: dict[str, Any]
    digest: str
    previous: Mapping[str, Any] | None = None

    def ensure(self, *, build: bool = True, fetch: FetchEntry | None = None) -> None:
        """Commit the entry, building it first if needed, without mapping its arrays (a growing
        entry's segments need not be in ``cache_dir``). ``build=False`` only looks: a missing
        entry is a CacheError. ``fetch(paths)``, if given, first brings a stored copy (e.g. from
        S3) when the description is absent."""
        if fetch is not None and not self.paths["description"].is_file():
            fetch(self.paths)
        if self._committed() or not build:
            if not self.paths["description"].is_file():
                raise CacheError(f"{self.paths['description']}: missing; the index was never built")
            return
        self._build(again=False)

    def load(self, *, build: bool = True) -> NanosetIndex:
        """Map the committed entry's arrays (its segments too); with ``build``, one that looks
        complete but is unreadable (a damaged or planted array) is built again in place, while a
        growing entry's missing segment stays a CacheError."""
        try:
            loaded = self._mapped()
        except CacheError as exc:
            if not build or not isinstance(exc.__cause__, FormatError):
                raise
            self._build(again=True)
            loaded = self._mapped()
        if loaded is None:
            raise CacheError(f"{self.paths['description']}: written but not readable back")
        return loaded

    def _build(self, *, again: bool) -> None:
        """Build the entry under its lock: when it is still not committed (another process
        may have built it meanwhile), or whatever is there when ``again``."""
        lock = self.cache_dir / f"{self.digest}-Nanoset-{self.key['split']}.lock"
        with cache.exclusive_lock(lock):
            if again or not self._committed():
                _build_entry(self)

    def _description(self) -> dict[str, Any] | None:
        """The entry's description, None when absent; one made for other settings is refused
        (CacheError), never overwritten."""
        description = cache.read_description(self.paths["description"])
        if description is not None and (
            description.get("key") != self.key or description.get("hash") != self.digest
        ):
            raise CacheError(
                f"{self.paths['description']}: describes {description.get('key')!r}, not the "
                f"requested {self.key!r}; remove the entry's files to rebuild it"
            )
        return description

    def _committed(self) -> bool:
        """True when the entry's description and its own array files (at their recorded
        sizes) are there; CacheError when the description was made for other settings."""
        description = self._description()
        files = None if description is None else description.get("files")
        return isinstance(files, dict) and all(
            isinstance(files.get(name), dict)
            and self.paths[name].is_file()
            and self.paths[name].stat().st_size == files[name].get("bytes")
            for name in cache.ARRAYS
        )

    def _mapped(self) -> NanosetIndex | None:
        """The committed entry's arrays mapped (its segments too), or None when it is absent."""
        description = self._description()
        if description is None:
            return None
        paths = self.paths
        try:
            arrays = cache.load_entry_arrays(paths, description)
        except (CacheError, FormatError, KeyError, TypeError, AttributeError) as exc:
            raise CacheError(
                f"{paths['description']}: incomplete or damaged entry ({exc})"
            ) from exc
        return NanosetIndex(
            split=self.key["split"],
            cache_hash=self.digest,
            description=description,
            document_index=arrays["document"],
            sample_index=arrays["sample"],
            shuffle_index=arrays["shuffle"],
            paths=_all_paths(paths, description),
        )


def cache_entry(
    inputs: IndexInputs,
    cache_dir: str | Path,
    split: str,
    settings: NanosetSettings,
    num_samples: int | None = None,
    *,
    previous: Mapping[str, Any] | None = None,
) -> Entry | None:
    """The split's entry of a dataset's inputs in ``cache_dir``, nothing read or built yet; None
    if the split is empty. ``num_samples``: the split's size (None: one epoch; growing: no cap)."""
    found = entry_key(
        len(inputs.lengths),
        inputs.content_hash,
        split,
        settings,
        num_samples,
        shards=inputs.shards,
        masked=inputs.masked,
    )
    if found is None:
        return None
    key, digest = found
    paths = cache_paths(cache_dir, digest, split)
    return Entry(inputs, Path(cache_dir), paths, key, digest, previous)


def build_or_load(
    dataset_prefix: str | Path,
    cache_dir: str | Path,
    split: str,
    settings: NanosetSettings,
    num_samples: int | None = None,
    *,
    build: bool = True,
    fetch: FetchEntry | None = None,
    previous: Mapping[str, Any] | None = None,
) -> NanosetIndex | None:
    """Load the split's cached indices, building them first if needed; None if the split is
    empty for this dataset. Many processes may call it at once: one builds under an exclusive
    lock, the others wait and load the same files. ``build``, ``fetch``: :meth:`Entry.ensure`;
    ``previous``: :class:`Entry`."""
    check_choices(split, settings.semantics)
    inputs = IndexInputs.of(dataset_prefix, settings.semantics)
    entry = cache_entry(inputs, cache_dir, split, settings, num_samples, previous=previous)
    if entry is None:
        return None
    entry.ensure(build=build, fetch=fetch)
    return entry.load(build=build)


def verify_index(index: NanosetIndex) -> None:
    """Full check of a loaded index: re-hash every array file against its description."""
    cache.load_entry_arrays(index.paths, index.description, full=True)


def _all_paths(paths: dict[str, Path], description: dict[str, Any]) -> dict[str, Path]:
    """The entry's files keyed as its description's ``files`` (segments ``<array>.<i>`` too)
    plus ``description``: what a blend manifest records of it."""
    out = dict(paths)
    for name, parts in cache.entry_array_paths(paths, description).items():
        keys = cache.segment_keys(description["files"], name)
        out.update(zip(keys, parts, strict=True))
    return out


def _build_entry(entry: Entry) -> None:
    """Compute the arrays and commit them: arrays first, the description last."""
    files = [entry.paths["description"], *(entry.paths[name] for name in cache.ARRAYS)]
    cache.remove_entry(files)
    try:
        if entry.key["semantics"] == "growing":
            _write_growing(entry)
        else:
            _write_split(entry)
    except BaseException:  # e.g. a full disk: no arrays stay without their description
        cache.remove_entry(files)
        raise


def _write_growing(entry: Entry) -> None:
    """The arrays and description of a growing entry: only the rows after ``previous`` when
    it can be extended (``growing_segments``), else the whole split."""
    key, lengths, shards = entry.key, entry.inputs.lengths, entry.inputs.shards
    if shards is None or growing.shard_table_hash(shards) != key["shard_table_sha256"]:
        raise CacheError(f"{entry.paths['description']}: the shard table does not match the key")
    grown = growing_segments.plan_extension(
        entry.previous, key, lengths, shards, entry.inputs.masked
    )
    if grown is not None:
        extra = {"growth": grown.growth()}
        _commit_arrays(entry, grown.arrays, grown.plan.counts(), extra, grown.records())
        return
    *arrays, plan = growing.build_growing_indices(
        lengths,
        shards,
        key["split"],
        split_spec=key["split_spec"],
        sequence_length=key["sequence_length"],
        seed=key["seed"],
        num_samples=key["num_samples"],
        era_samples=key["era_samples"],
        add_extra_token=key["add_extra_token"],
        masked=entry.inputs.masked,
    )
    state = growing_segments.end_state(arrays[0], arrays[1], plan, shards)
    _commit_arrays(entry, arrays, plan.counts(), {"growth": {"state": state, "segments": []}})


def _write_split(entry: Entry) -> None:
    """The arrays and description of a megatron or nanotron entry (masked: module docstring)."""
    lengths = entry.inputs.lengths
    kept = unmasked(len(lengths), entry.inputs.masked)
    document_index, sample_index, shuffle_index, plan = compute_indices(
        lengths if kept is None else lengths[kept], tuple(entry.key["split_range"]), entry.key
    )
    if kept is not None:  # positions among the unmasked sequences -> sequence ids of the merge
        if len(lengths) > np.iinfo(document_index.dtype).max:
            raise ConfigError(f"{len(lengths)} sequences do not fit a {document_index.dtype} index")
        document_index = kept[document_index].astype(document_index.dtype)
    counts = {
        "num_samples": len(shuffle_index),
        "sample_index_rows": len(sample_index),
        "num_epochs": plan.num_epochs * plan.shuffle_copies,
        "tokens_per_epoch": plan.tokens_per_epoch,
        "separate_final_epoch": plan.separate_final_epoch,
    }
    _commit_arrays(entry, [document_index, sample_index, shuffle_index], counts)


def _commit_arrays(
    entry: Entry,
    arrays: Sequence[np.ndarray],
    counts: dict[str, Any],
    extra: dict[str, Any] | None = None,
    segments: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Save the document, sample and shuffle arrays, then the description (last); ``extra``
    adds description fields, ``segments`` the records of earlier entries' parts."""
    named = dict(zip(cache.ARRAYS, arrays, strict=True))
    files = {name: cache.save_array(entry.paths[name], named[name]) for name in cache.ARRAYS}
    description = {
        "key": entry.key,
        "hash": entry.digest,
        "counts": counts,
        "files": {**(segments or {}), **files},
        **(extra or {}),
    }
    cache.write_description(entry.paths["description"], description)
