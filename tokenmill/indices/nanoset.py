"""Nanoset indices: split ranges, document/sample/shuffle indices, and their on-disk cache.

``semantics="megatron"`` follows megatron-core GPTDataset and ``semantics="nanotron"`` the
index-era nanotron Nanoset, both bit-exact (FORMATS.md §4–§6; the algorithms are in
``tokenmill.indices._nanoset_indices``). :func:`build_or_load` caches one split's arrays as
``<hash>-Nanoset-<split>-{document,sample,shuffle}_index.npy`` plus
``<hash>-Nanoset-<split>-description.json`` (written last). The hash is the md5 of an ordered
JSON key holding everything that changes the arrays: the dataset's content hash, semantics,
split string and range, sequence length, seed, num_samples, both flags and the format version
(both references leave some of these out, so they can reuse a stale cache; we do not).

``semantics="growing"`` (``tokenmill.indices.growing``) splits by document identity and only
ever extends as shards are appended; its key has no split range but the sha256 of the dataset's
shard table (keys and document counts, which decide the splits) and the era size.

A virtual merge with masked (taken-down) documents (``tokenmill.formats.virtual_merge``) is
indexed without them: megatron and nanotron index it exactly as the physical merge of its
unmasked documents (split ranges over the unmasked count, then each document id mapped back to
its sequence id in the merge), so every sample after the first removed document's position can
change; growing drops them from their split by identity (the other documents keep their split,
samples packed before the first removed document stay as they were). The mask enters the key
through the dataset's content hash.

An entry needs only the dataset's sequence lengths (its ``.idx``) and content hash:
:func:`entry_key` names a split's entry without building it and :func:`build_or_load_lengths`
builds from the lengths, so remote storage can be asked for an entry by name first; the
``fetch`` hook of both builders brings a missing entry's files from there before building.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats import nanoset_cache as cache
from tokenmill.formats.dataset_manifest import (
    dataset_content_hash,
    dataset_manifest_path,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.formats.virtual_merge import masked_sequences
from tokenmill.indices import growing, growing_segments
from tokenmill.indices._nanoset_indices import (
    SPLITS,
    check_int,
    compute_indices,
    parse_split,
    split_ranges,
)
from tokenmill.indices.settings import NanosetSettings
from tokenmill.storage.versions import version_hash

__all__ = [
    "SEMANTICS",
    "SPLITS",
    "NanosetIndex",
    "build_nanoset_indices",
    "build_or_load",
    "build_or_load_lengths",
    "cache_key",
    "cache_paths",
    "entry_key",
    "index_lengths",
    "index_version",
    "masked_of",
    "split_key",
    "split_ranges",
    "verify_index",
]

FORMAT_VERSION = 1
ARRAYS = cache.ARRAYS
SEMANTICS = ("megatron", "nanotron", "growing")  # growing: tokenmill.indices.growing
ShardTable = Sequence[tuple[str, int]]


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
    reference. ``sequence_lengths`` are all of the dataset's (the .idx array); ``split_range``
    an entry of :func:`split_ranges`; ``drop_last_partial`` the effective flag for the split
    (Megatron drops for train/test and applies its validation setting to valid only).
    """
    document_index, sample_index, shuffle_index, _ = compute_indices(
        sequence_lengths,
        split_range,
        sequence_length=sequence_length,
        seed=seed,
        num_samples=num_samples,
        semantics=semantics,
        add_extra_token=add_extra_token,
        drop_last_partial=drop_last_partial,
    )
    return document_index, sample_index, shuffle_index


def masked_of(dataset_prefix: str | Path) -> np.ndarray:
    """The sequence ids a dataset masks (taken down; ascending int64, empty when none): the
    ``masked`` shard records of a virtual merge's manifest."""
    if not dataset_manifest_path(dataset_prefix).is_file():
        return np.zeros(0, dtype=np.int64)
    return masked_sequences(read_dataset_manifest(dataset_prefix))


def unmasked(num_sequences: int, masked: np.ndarray | None) -> np.ndarray | None:
    """The sequence ids an index of a masked dataset draws from (ascending), None without a
    mask."""
    if masked is None or not len(masked):
        return None
    keep = np.ones(num_sequences, dtype=bool)
    keep[np.asarray(masked, dtype=np.int64)] = False
    return np.flatnonzero(keep)


def index_lengths(dataset_prefix: str | Path, semantics: str) -> np.ndarray:
    """The sequence lengths a split's range and tokens count over (from the ``.idx`` files):
    under megatron and nanotron, the unmasked sequences' (a masked merge indexes as the physical
    merge of its unmasked documents); under growing, every sequence's (masked documents leave
    their split by identity)."""
    index_only = dataset_manifest_path(dataset_prefix).is_file()
    lengths = np.asarray(open_dataset(dataset_prefix, index_only=index_only).sequence_lengths)
    kept = None if semantics == "growing" else unmasked(len(lengths), masked_of(dataset_prefix))
    return lengths if kept is None else lengths[kept]


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
    empty for this dataset. Safe when many processes call it at once: one builds under an
    exclusive lock, the others wait and load the same files. ``num_samples``: the split's size
    (None: one epoch; growing: no cap). ``build=False`` only loads: a missing entry is a
    CacheError (checks read, never repair). A dataset with a manifest is read through its
    ``.idx`` and manifest alone (the ``.bin`` is never opened, so an S3 step need not stage
    it); a hand-made pair without one is hashed whole. ``fetch(paths)``, if given, is called
    with the entry's :func:`cache_paths` when its description is not in ``cache_dir``, to bring
    a stored copy there (e.g. from S3) before anything is loaded or built. Growing semantics
    reads the dataset's shard table from its manifest (``growing.shard_table``); ``previous``
    is the description of the entry of a dataset version this one extends (same settings): a
    new entry then writes only the rows after it (``growing_segments``).
    """
    _check_choices(split, settings.semantics)
    index_only = dataset_manifest_path(dataset_prefix).is_file()  # lengths + hash suffice
    growing_shards = settings.semantics == "growing"
    return build_or_load_lengths(
        open_dataset(dataset_prefix, index_only=index_only).sequence_lengths,
        dataset_content_hash(dataset_prefix, index_only=index_only),
        cache_dir,
        split,
        settings,
        num_samples,
        build=build,
        fetch=fetch,
        shards=growing.shard_table(dataset_prefix) if growing_shards else None,
        masked=masked_of(dataset_prefix),
        previous=previous,
    )


def build_or_load_lengths(
    lengths: np.ndarray,
    content_hash: str,
    cache_dir: str | Path,
    split: str,
    settings: NanosetSettings,
    num_samples: int | None = None,
    *,
    build: bool = True,
    fetch: FetchEntry | None = None,
    shards: ShardTable | None = None,
    masked: np.ndarray | None = None,
    previous: Mapping[str, Any] | None = None,
) -> NanosetIndex | None:
    """:func:`build_or_load` from a dataset's sequence lengths (e.g. of
    ``IndexedDataset(prefix, index_only=True)``, every sequence's) and content hash: no ``.bin``
    is needed. Growing semantics also needs ``shards``, the dataset's ``growing.shard_table``;
    ``masked``: the sequence ids the dataset masks (:func:`masked_of`), left out of the index."""
    made = ensure_entry(
        lengths,
        content_hash,
        cache_dir,
        split,
        settings,
        num_samples,
        build=build,
        fetch=fetch,
        shards=shards,
        masked=masked,
        previous=previous,
    )
    if made is None:
        return None
    paths, key, digest = made
    try:
        loaded = _load_entry(paths, key, digest)
    except CacheError as exc:
        if not build or not isinstance(exc.__cause__, FormatError):
            raise  # e.g. a growing entry's missing segment: named, not silently rebuilt whole
        # Complete-looking but unreadable (a damaged or planted array of the recorded size):
        # built again in place, as an absent entry would be; what still fails is loud.
        _build_locked(cache_dir, paths, key, digest, lengths, shards, previous, masked, True)
        loaded = _load_entry(paths, key, digest)
    if loaded is None:
        raise CacheError(f"{paths['description']}: written but not readable back")
    return loaded


def ensure_entry(
    lengths: np.ndarray,
    content_hash: str,
    cache_dir: str | Path,
    split: str,
    settings: NanosetSettings,
    num_samples: int | None = None,
    *,
    build: bool = True,
    fetch: FetchEntry | None = None,
    shards: ShardTable | None = None,
    masked: np.ndarray | None = None,
    previous: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Path], dict[str, Any], str] | None:
    """(paths, key, hash) of the split's committed entry, building it first if needed (as
    :func:`build_or_load_lengths`, whose arguments these are) without mapping its arrays: a
    growing entry's segments (earlier entries' files) need not be in ``cache_dir``, e.g. in an
    S3 step that uploads only the new part. None if the split is empty."""
    found = entry_key(
        len(lengths), content_hash, split, settings, num_samples, shards=shards, masked=masked
    )
    if found is None:
        return None
    key, digest = found
    paths = cache_paths(cache_dir, digest, split)
    if fetch is not None and not paths["description"].is_file():
        fetch(paths)
    if _committed(paths, key, digest) or not build:
        if not paths["description"].is_file():
            raise CacheError(f"{paths['description']}: missing; the index was never built")
        return paths, key, digest
    _build_locked(cache_dir, paths, key, digest, lengths, shards, previous, masked, False)
    return paths, key, digest


def _build_locked(
    cache_dir: str | Path,
    paths: dict[str, Path],
    key: dict[str, Any],
    digest: str,
    lengths: np.ndarray,
    shards: ShardTable | None,
    previous: Mapping[str, Any] | None,
    masked: np.ndarray | None,
    again: bool,
) -> None:
    """Build the entry under its lock: when it is still not committed (another process may
    have built it meanwhile), or whatever is there when ``again`` (its own arrays unreadable)."""
    with cache.exclusive_lock(Path(cache_dir) / f"{digest}-Nanoset-{key['split']}.lock"):
        if again or not _committed(paths, key, digest):  # absent, or its own arrays partial
            _build_entry(paths, key, digest, np.asarray(lengths), shards, previous, masked)


def _committed(paths: dict[str, Path], key: dict[str, Any], digest: str) -> bool:
    """True when the entry's description and its own array files (at their recorded sizes)
    are there; CacheError when the description was made for other settings."""
    description = cache.read_description(paths["description"])
    if description is None:
        return False
    if description.get("key") != key or description.get("hash") != digest:
        raise CacheError(
            f"{paths['description']}: describes {description.get('key')!r}, not the requested "
            f"{key!r}; remove the entry's files to rebuild it"
        )
    files = description.get("files")
    return isinstance(files, dict) and all(
        isinstance(files.get(name), dict)
        and paths[name].is_file()
        and paths[name].stat().st_size == files[name].get("bytes")
        for name in ARRAYS
    )


def entry_key(
    num_sequences: int,
    content_hash: str,
    split: str,
    settings: NanosetSettings,
    num_samples: int | None = None,
    *,
    shards: ShardTable | None = None,
    masked: np.ndarray | None = None,
) -> tuple[dict[str, Any], str] | None:
    """``(key, hash)`` of a split's cache entry (its :func:`cache_key` and the ``<hash>`` of
    its file names) for a dataset of ``num_sequences`` sequences; None if the split is empty
    (growing: if its split weight is 0; an entry may hold 0 samples until one era is there).
    ``masked``: the sequence ids the dataset masks (megatron and nanotron split the rest)."""
    _check_choices(split, settings.semantics)
    if settings.semantics == "growing":
        return _growing_entry_key(num_sequences, content_hash, split, settings, num_samples, shards)
    indexed = num_sequences - (0 if masked is None else len(masked))
    split_range = split_ranges(settings.split_spec, indexed, settings.semantics)[
        SPLITS.index(split)
    ]
    if split_range is None or split_range[0] >= split_range[1]:
        return None
    key = split_key(content_hash, split, settings, split_range, num_samples)
    return key, cache.key_hash(key)


def index_version(
    dataset_version: str | None,
    settings: NanosetSettings,
    num_samples: Mapping[str, int | None],
) -> str:
    """The version of a dataset's indices as known before the dataset is read: the hash of the
    :func:`cache_key` of each split (``num_samples``: its requested size) with the dataset's
    version (e.g. its merged version, which fixes its content) in place of its content hash
    and no split range or shard table (the content fixes them). An orchestrator records it
    (e.g. as a Dagster data version) to tell stale indices from their upstream versions alone."""
    _check_choices(SPLITS[0], settings.semantics)
    growing_era = settings.semantics == "growing"
    keys = [
        cache_key(
            "",
            semantics=settings.semantics,
            split=split,
            split_spec=settings.split_spec,
            split_range=None,
            sequence_length=settings.sequence_length,
            seed=settings.seed,
            num_samples=num_samples[split],
            add_extra_token=settings.add_extra_token,
            drop_last_partial=settings.drop_last(split),
            era_samples=growing.split_era(split, settings.era_samples) if growing_era else None,
        )
        | {"dataset_content_hash": dataset_version}
        for split in SPLITS
    ]
    return version_hash({"kind": "nanoset", "keys": keys})


def split_key(
    content_hash: str,
    split: str,
    settings: NanosetSettings,
    split_range: tuple[int, int],
    num_samples: int | None,
) -> dict[str, Any]:
    """The :func:`cache_key` of a megatron or nanotron split whose range is known."""
    return cache_key(
        content_hash,
        semantics=settings.semantics,
        split=split,
        split_spec=settings.split_spec,
        split_range=split_range,
        sequence_length=settings.sequence_length,
        seed=settings.seed,
        num_samples=num_samples,
        add_extra_token=settings.add_extra_token,
        drop_last_partial=settings.drop_last(split),
    )


def _growing_entry_key(
    num_sequences: int,
    content_hash: str,
    split: str,
    settings: NanosetSettings,
    num_samples: int | None,
    shards: ShardTable | None,
) -> tuple[dict[str, Any], str] | None:
    """:func:`entry_key` of growing semantics (checks the shard table against the dataset)."""
    if shards is None:
        raise ConfigError("growing semantics needs the dataset's shard table (shards=...)")
    if sum(n for _, n in shards) != num_sequences:
        raise ConfigError(
            f"the shard table counts {sum(n for _, n in shards)} documents, the dataset has "
            f"{num_sequences} sequences: growing semantics needs one sequence per document"
        )
    if not settings.drop_last(split):
        raise ConfigError(
            "growing semantics always drops the last partial sample (it would change when data "
            "is added): drop_last_partial_validation must be true"
        )
    if parse_split(settings.split_spec)[SPLITS.index(split)] == 0:
        return None
    key = cache_key(
        content_hash,
        semantics="growing",
        split=split,
        split_spec=settings.split_spec,
        split_range=None,
        sequence_length=settings.sequence_length,
        seed=settings.seed,
        num_samples=num_samples,
        add_extra_token=settings.add_extra_token,
        drop_last_partial=True,
        era_samples=growing.split_era(split, settings.era_samples),  # the effective size
        shard_table_sha256=growing.shard_table_hash(shards),
    )
    return key, cache.key_hash(key)


def _check_choices(split: str, semantics: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if semantics not in SEMANTICS:
        raise ConfigError(f"semantics must be one of {list(SEMANTICS)}, got {semantics!r}")


def cache_key(
    content_hash: str,
    *,
    semantics: str,
    split: str,
    split_spec: str,
    split_range: tuple[int, int] | None,
    sequence_length: int,
    seed: int,
    num_samples: int | None,
    add_extra_token: bool,
    drop_last_partial: bool,
    era_samples: int | None = None,
    shard_table_sha256: str | None = None,
) -> dict[str, Any]:
    """The ordered description of everything that changes a split's arrays (hashed for names).

    Growing semantics has no split range (None) and adds ``era_samples`` and
    ``shard_table_sha256``; the megatron and nanotron keys are unchanged by them."""
    key = {
        "class": "Nanoset",
        "format_version": FORMAT_VERSION,
        "dataset_content_hash": content_hash,
        "semantics": semantics,
        "split": split,
        "split_spec": split_spec,
        "split_range": None if split_range is None else list(split_range),
        "sequence_length": check_int("sequence_length", sequence_length, minimum=2),
        "seed": check_int("seed", seed, minimum=0, maximum=2**32 - 1),
        "num_samples": None
        if num_samples is None
        else check_int("num_samples", num_samples, minimum=0),
        "add_extra_token": bool(add_extra_token),
        "drop_last_partial": bool(drop_last_partial),
    }
    if semantics == "growing":
        key["era_samples"] = check_int("era_samples", era_samples, minimum=1)
        key["shard_table_sha256"] = shard_table_sha256
    return key


def cache_paths(cache_dir: str | Path, digest: str, split: str) -> dict[str, Path]:
    """The four files of one cache entry, keyed "document", "sample", "shuffle", "description"."""
    return cache.entry_paths(cache_dir, digest, split)


def verify_index(index: NanosetIndex) -> None:
    """Full check of a loaded index: re-hash every array file against its description."""
    cache.load_entry_arrays(index.paths, index.description, full=True)


def _load_entry(paths: dict[str, Path], key: dict[str, Any], digest: str) -> NanosetIndex | None:
    """The committed entry (its segments too), or None when it is absent.

    A description made for other settings is refused (CacheError), never overwritten.
    """
    description = cache.read_description(paths["description"])
    if description is None:
        return None
    if description.get("key") != key or description.get("hash") != digest:
        raise CacheError(
            f"{paths['description']}: describes {description.get('key')!r}, not the requested "
            f"{key!r}; remove the entry's files to rebuild it"
        )
    try:
        arrays = cache.load_entry_arrays(paths, description)
    except (CacheError, FormatError, KeyError, TypeError, AttributeError) as exc:
        raise CacheError(f"{paths['description']}: incomplete or damaged entry ({exc})") from exc
    return NanosetIndex(
        split=key["split"],
        cache_hash=digest,
        description=description,
        document_index=arrays["document"],
        sample_index=arrays["sample"],
        shuffle_index=arrays["shuffle"],
        paths=_all_paths(paths, description),
    )


def _all_paths(paths: dict[str, Path], description: dict[str, Any]) -> dict[str, Path]:
    """The entry's files keyed as its description's ``files`` (segments ``<array>.<i>`` too)
    plus ``description``: what a blend manifest records of it."""
    out = dict(paths)
    for name, parts in cache.entry_array_paths(paths, description).items():
        keys = cache.segment_keys(description["files"], name)
        out.update(zip(keys, parts, strict=True))
    return out


def _build_entry(
    paths: dict[str, Path],
    key: dict[str, Any],
    digest: str,
    lengths: np.ndarray,
    shards: ShardTable | None,
    previous: Mapping[str, Any] | None = None,
    masked: np.ndarray | None = None,
) -> None:
    """Compute the arrays and commit them: arrays first, the description last."""
    entry = [paths["description"], *(paths[name] for name in ARRAYS)]
    cache.remove_entry(entry)
    try:
        _write_entry(paths, key, digest, lengths, shards, previous, masked)
    except BaseException:  # e.g. a full disk: no arrays stay without their description
        cache.remove_entry(entry)
        raise


def _write_entry(
    paths: dict[str, Path],
    key: dict[str, Any],
    digest: str,
    lengths: np.ndarray,
    shards: ShardTable | None,
    previous: Mapping[str, Any] | None = None,
    masked: np.ndarray | None = None,
) -> None:
    """The arrays of one entry, then its description (growing: only the rows after
    ``previous`` when it can be extended, see ``growing_segments``; module docstring: masked
    documents)."""
    if key["semantics"] == "growing":
        if shards is None or growing.shard_table_hash(shards) != key["shard_table_sha256"]:
            raise CacheError(f"{paths['description']}: the shard table does not match the key")
        grown = growing_segments.plan_extension(previous, key, lengths, shards, masked)
        if grown is not None:
            extra = {"growth": grown.growth()}
            _commit_arrays(
                paths, key, digest, grown.arrays, grown.plan.counts(), extra, grown.records()
            )
            return
        *arrays, grown_plan = growing.build_growing_indices(
            lengths,
            shards,
            key["split"],
            split_spec=key["split_spec"],
            sequence_length=key["sequence_length"],
            seed=key["seed"],
            num_samples=key["num_samples"],
            era_samples=key["era_samples"],
            add_extra_token=key["add_extra_token"],
            masked=masked,
        )
        state = growing_segments.end_state(arrays[0], arrays[1], grown_plan, shards)
        extra = {"growth": {"state": state, "segments": []}}
        _commit_arrays(paths, key, digest, arrays, grown_plan.counts(), extra)
        return
    kept = unmasked(len(lengths), masked)
    document_index, sample_index, shuffle_index, plan = compute_indices(
        lengths if kept is None else lengths[kept],
        tuple(key["split_range"]),
        sequence_length=key["sequence_length"],
        seed=key["seed"],
        num_samples=key["num_samples"],
        semantics=key["semantics"],
        add_extra_token=key["add_extra_token"],
        drop_last_partial=key["drop_last_partial"],
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
    _commit_arrays(paths, key, digest, [document_index, sample_index, shuffle_index], counts)


def _commit_arrays(
    paths: dict[str, Path],
    key: dict[str, Any],
    digest: str,
    arrays: Sequence[np.ndarray],
    counts: dict[str, Any],
    extra: dict[str, Any] | None = None,
    segments: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Save the document, sample and shuffle arrays, then the description (last); ``extra``
    adds description fields, ``segments`` the records of earlier entries' parts."""
    named = dict(zip(("document", "sample", "shuffle"), arrays, strict=True))
    files = {name: cache.save_array(paths[name], named[name]) for name in ARRAYS}
    description = {
        "key": key,
        "hash": digest,
        "counts": counts,
        "files": {**(segments or {}), **files},
        **(extra or {}),
    }
    cache.write_description(paths["description"], description)
