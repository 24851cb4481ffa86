"""Owns opening one dataset: a ``.bin``/``.idx`` pair or virtual merge, and ``open_nanoset``'s
split of it from a Nanoset cache entry checked against its description and the dataset."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tokenmill.atomic import load_json
from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats.dataset_manifest import (
    check_dataset_files,
    dataset_content_hash,
    dataset_manifest_path,
    open_dataset,
)
from tokenmill.formats.indexed import IndexedDataset
from tokenmill.formats.nanoset_cache import (
    ARRAYS,
    DESCRIPTION_SUFFIX,
    entry_array_paths,
    entry_paths_from_description,
    load_entry_arrays,
)
from tokenmill.formats.virtual_merge import VirtualDataset
from tokenmill.loader._datasets import PAD_ID, IndexPaths, NanosetDataset, part_names

VERIFY_MODES = ("fast", "full")


def is_full(verify: str) -> bool:
    """Whether ``verify`` asks for the full checks; ConfigError for an unknown mode."""
    if verify not in VERIFY_MODES:
        raise ConfigError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    return verify == "full"


def open_local(
    prefix: str | os.PathLike[str], *, full: bool, recorded: dict[str, Any] | None = None
) -> IndexedDataset | VirtualDataset:
    """A ``.bin``/``.idx`` pair (checked on open; ``recorded``: counts from a checked blend
    entry) or a virtual merge of pairs (each checked when first read); ``full``: every pointer."""
    data = open_dataset(prefix, recorded=recorded)
    if full:
        data.check_pointers()
    return data


def open_nanoset(
    dataset_prefix: str | os.PathLike[str],
    index: Any,
    *,
    verify: str = "fast",
    pad_id: int = PAD_ID,
) -> NanosetDataset:
    """One dataset's split as a NanosetDataset, from ``index``: what ``build_or_load`` returns
    (the loader builds nothing) or the path of a cache entry's ``*-description.json``, whose
    settings it takes. ``verify="fast"``: the arrays' sizes, dtypes and shapes, and the dataset's
    content hash when its manifest makes that cheap; ``"full"``: also the arrays' sha256, every
    index value and the dataset's content hash always. A stale or damaged entry raises
    CacheError. ``.version`` is the entry's hash; ``pad_id`` as in ``open_blend``.
    """
    full = is_full(verify)
    if index is None:
        raise ConfigError(
            f"{dataset_prefix}: no index to open (build_or_load returns None for a split with "
            "no sequences): change the split or the dataset"
        )
    path = Path(index) if isinstance(index, str | os.PathLike) else index.paths["description"]
    key, arrays, paths = _load_cache(path, full=full)
    data = open_local(dataset_prefix, full=full)  # a malformed pair is named before hashing
    _check_dataset(path, key, dataset_prefix, full=full)
    return NanosetDataset(
        data,
        *arrays,
        sequence_length=int(key["sequence_length"]),
        add_extra_token=bool(key["add_extra_token"]),
        pad_id=pad_id,
        name=f"{dataset_prefix} ({key['split']})",
        validate=full,
        index_paths=paths,
        version=path.name[: -len(DESCRIPTION_SUFFIX)].split("-", 1)[0],
    )


def _load_cache(
    description_path: Path, *, full: bool
) -> tuple[dict[str, Any], list[Any], IndexPaths]:
    """The key, the checked arrays and their paths of a cache entry, given its description
    path (``full``: the arrays' sha256 too)."""
    if not description_path.name.endswith(DESCRIPTION_SUFFIX):
        raise ConfigError(
            f"index must be a '*{DESCRIPTION_SUFFIX}' cache file, got {description_path}"
        )
    rebuild = "rebuild it with tokenmill.indices.nanoset.build_or_load (same settings)"
    if not description_path.is_file():
        raise CacheError(f"{description_path}: missing (never completed); {rebuild}")
    description = load_json(description_path.read_bytes(), description_path, "description")
    try:
        key = description["key"]
    except (KeyError, TypeError) as exc:
        raise FormatError(description_path, "description", f"unreadable ({exc!r})") from exc
    paths = entry_paths_from_description(description_path)
    try:
        arrays = load_entry_arrays(paths, description, full=full)
    except CacheError as exc:
        raise CacheError(f"{exc}; the cache entry is stale or damaged: {rebuild}") from exc
    parts = entry_array_paths(paths, description)
    return key, [arrays[kind] for kind in ARRAYS], part_names([parts[k] for k in ARRAYS])


def _check_dataset(
    description_path: Path, key: dict[str, Any], prefix: str | os.PathLike[str], *, full: bool
) -> None:
    """Refuse an index built for other dataset content (hash from the manifest when cheap;
    ``full`` also re-hashes the files against that manifest, so a changed byte is caught)."""
    has_manifest = dataset_manifest_path(prefix).is_file()
    if not (full or has_manifest):
        return
    problems = check_dataset_files(prefix, full=True) if full and has_manifest else []
    if problems:
        raise CacheError(
            f"{description_path}: dataset {prefix} does not match its manifest "
            f"({'; '.join(problems)}): the dataset changed or is damaged; rebuild it"
        )
    actual = dataset_content_hash(prefix)
    if actual != key.get("dataset_content_hash"):
        raise CacheError(
            f"{description_path}: built for dataset content {key.get('dataset_content_hash')}, "
            f"but {prefix} now hashes to {actual}: the dataset changed; rebuild the index with "
            "tokenmill.indices.nanoset.build_or_load"
        )
