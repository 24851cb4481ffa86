"""Owns merging ``.bin``/``.idx`` datasets into one (Megatron ``merge_datasets.py``, ``add_index``).

Inputs are concatenated in the order given by default; ``order="lexicographic"`` reproduces
Megatron's ``sorted()`` order of prefixes and ``order="natural"`` sorts numeric runs by value
(``part_2`` before ``part_10``). Directories expand to the ``.bin``/``.idx`` pairs directly in them.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.atomic import fsync_dir
from tokenmill.errors import ConfigError, InputError
from tokenmill.formats.dataset_manifest import (
    bin_parts,
    dataset_content_hash,
    dataset_manifest_path,
    read_dataset_manifest,
    write_dataset_manifest,
)
from tokenmill.formats.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    data_file_path,
    index_file_path,
)
from tokenmill.formats.virtual_merge import is_virtual, shard_entry, write_virtual_manifest

ORDERS = ("given", "lexicographic", "natural")
_PAIR_SUFFIXES = (".bin", ".idx")


@dataclass(frozen=True)
class MergeResult:
    """What a merge produced."""

    prefix: Path
    inputs: list[Path]
    documents: int
    sequences: int
    tokens: int
    bytes: int
    seconds: float
    manifest: dict[str, Any]

    @classmethod
    def of(
        cls, prefix: Path, inputs: list[Path], manifest: dict[str, Any], nbytes: int, start: float
    ) -> MergeResult:
        """The result of the merge into ``prefix`` whose ``manifest`` was just written
        (``start``: its ``time.perf_counter()`` when the merge began)."""
        counts = manifest["counts"]
        return cls(
            prefix=prefix,
            inputs=inputs,
            documents=counts["documents"],
            sequences=counts["sequences"],
            tokens=counts["tokens"],
            bytes=nbytes,
            seconds=time.perf_counter() - start,
            manifest=manifest,
        )


def natural_key(name: str) -> list[Any]:
    """Sort key that compares digit runs as numbers: ``part_2`` < ``part_10``."""
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", name)]


def _prefixes_in_dir(directory: Path) -> list[Path]:
    """Every ``.bin``/``.idx`` prefix directly in ``directory``; a lone partner is an error."""
    stems: dict[str, set[str]] = {}
    for entry in directory.iterdir():
        if entry.is_file() and entry.suffix in _PAIR_SUFFIXES:
            stems.setdefault(entry.stem, set()).add(entry.suffix)
    for stem, found in stems.items():
        for missing in set(_PAIR_SUFFIXES) - found:
            raise InputError(f"{directory / (stem + missing)}: missing partner file")
    return sorted(directory / stem for stem in stems)


def resolve_inputs(inputs: list[str | os.PathLike[str]], order: str = "given") -> list[Path]:
    """Expand directories and ``.bin``/``.idx`` paths to prefixes, then order them."""
    if order not in ORDERS:
        raise ConfigError(f"--order {order!r}: allowed values are {', '.join(ORDERS)}")
    prefixes: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            prefixes.extend(_prefixes_in_dir(p))
        elif (shards := _virtual_shards(p)) is not None:
            prefixes.extend(shards)
        else:
            prefix = p.with_suffix("") if p.suffix in _PAIR_SUFFIXES else p
            for part in (data_file_path(prefix), index_file_path(prefix)):
                if not part.is_file():
                    raise InputError(f"{part}: missing (needed to merge prefix {prefix})")
            prefixes.append(prefix)
    if not prefixes:
        raise ConfigError("no .bin/.idx inputs found to merge")
    if order == "lexicographic":
        prefixes.sort(key=lambda q: q.name)
    elif order == "natural":
        prefixes.sort(key=lambda q: natural_key(q.name))
    seen: set[Path] = set()
    for q in prefixes:
        if q.resolve() in seen:
            raise ConfigError(f"{q}: given twice; each input may appear once")
        seen.add(q.resolve())
    return prefixes


def _virtual_shards(prefix: Path) -> list[Path] | None:
    """The shard pairs of a virtual merge at ``prefix``, in order (so ``tokenmill merge`` writes
    its physical pair); None when ``prefix`` is not one."""
    if data_file_path(prefix).is_file() or not dataset_manifest_path(prefix).is_file():
        return None
    manifest = read_dataset_manifest(prefix)
    if not is_virtual(manifest):
        return None
    return [prefix.parent / str(shard["prefix"]) for shard in manifest["shards"]]


PROVENANCE = ("tokenizer_fingerprint", "text_key", "append_eod", "eod_id")


def _manifests(prefixes: list[Path]) -> list[tuple[Path, dict[str, Any] | None]]:
    """Each input with its dataset manifest (None for a hand-made pair without one)."""
    return [
        (q, read_dataset_manifest(q) if dataset_manifest_path(q).is_file() else None)
        for q in prefixes
    ]


def _provenance(
    inputs: list[tuple[Path, dict[str, Any] | None]],
) -> tuple[dict[str, Any], int]:
    """The tokenizer settings (``PROVENANCE``) the inputs' manifests state (null where none
    does) and the documents they quarantined in all. Inputs made by different tokenizers or
    settings are refused: their ids would mean different things in one dataset."""
    seen: dict[str, tuple[Any, Path]] = {}
    quarantined = 0
    for q, manifest in inputs:
        if manifest is None:
            continue
        quarantined += int(manifest["counts"].get("quarantined", 0))
        for key in PROVENANCE:
            if manifest["config"].get(key) is None:
                continue
            value = manifest["config"][key]
            if key in seen and seen[key][0] != value:
                first_value, first = seen[key]
                raise InputError(
                    f"{dataset_manifest_path(q)}: {key} {value!r}, but {first} has "
                    f"{first_value!r}; merge only datasets tokenized the same way"
                )
            seen.setdefault(key, (value, q))
    return {key: seen[key][0] if key in seen else None for key in PROVENANCE}, quarantined


def _counts(data: IndexedDataset | Path) -> dict[str, int]:
    """Documents, sequences and tokens of a dataset (of an input: from its ``.idx`` alone), so
    checks compare the merged pair against its recorded inputs without reading them again."""
    if isinstance(data, Path):
        with IndexedDataset(data, index_only=True) as opened:
            return _counts(opened)
    return {"documents": data.num_documents, "sequences": len(data), "tokens": data.num_tokens}


def _shard_records(keys: list[str], prefixes: list[Path], extends: str | None) -> dict[str, Any]:
    """``shards`` (key, content hash, counts) and ``extends`` of a keyed physical merge."""
    if len(keys) != len(prefixes):
        raise ConfigError(f"{len(keys)} shard keys for {len(prefixes)} inputs")
    shards = [
        {"key": key, "content_hash": dataset_content_hash(q), **_counts(q)}
        for key, q in zip(keys, prefixes, strict=True)
    ]
    return {"shards": shards, "extends": extends}


def merge_datasets(
    inputs: list[str | os.PathLike[str]],
    output_prefix: str | os.PathLike[str],
    *,
    order: str = "given",
    input_uri: Callable[[Path], str] | None = None,
    keys: list[str] | None = None,
    extends: str | None = None,
) -> MergeResult:
    """Concatenate datasets with Megatron ``add_index`` semantics and write a manifest last.

    The output dtype is the first input's (another is an error naming the file). The manifest
    names inputs by ``input_uri(prefix)`` (default: the absolute path). ``keys`` (the inputs'
    shard keys) records ``shards`` and ``extends`` as a virtual merge does, so document
    identities survive either merge mode.
    """
    start = time.perf_counter()
    prefixes = resolve_inputs(inputs, order)
    name = input_uri or (lambda q: str(q.resolve()))
    out = Path(output_prefix)
    if any(out.resolve() == q.resolve() for q in prefixes):
        raise ConfigError(f"--output-prefix {out} is also an input")
    with IndexedDataset(prefixes[0]) as first:
        dtype = first.dtype
    provenance, quarantined = _provenance(_manifests(prefixes))
    # The old manifest goes first: it must never vouch for a new pair of the same sizes.
    outputs = (dataset_manifest_path(out), data_file_path(out), index_file_path(out))
    if outputs[0].is_file():
        outputs[0].unlink()
        fsync_dir(outputs[0].parent)  # gone on disk before the pair changes (another folder)
    try:
        with IndexedDatasetWriter(out, dtype) as writer:
            for q in prefixes:
                writer.add_index(q)
        with IndexedDataset(out) as merged:  # a full open: the .bin size checked too
            counts = {**_counts(merged), "quarantined": quarantined}
            nbytes = merged.bin_path.stat().st_size
        manifest = write_dataset_manifest(
            out,
            kind="merged",
            inputs=[
                {"prefix": name(q), "content_hash": dataset_content_hash(q), "counts": _counts(q)}
                for q in prefixes
            ],
            config={"order": order, "dtype": str(dtype), **provenance},
            counts=counts,
            bin_parts=[part for q in prefixes for part in bin_parts(q)],
            extra=None if keys is None else _shard_records(keys, prefixes, extends),
        )
    except BaseException:  # e.g. a full disk: no pair is left without its manifest
        for path in outputs:
            path.unlink(missing_ok=True)
        raise
    return MergeResult.of(out, prefixes, manifest, nbytes, start)


def virtual_merge(
    shards: list[tuple[str, Path]],
    output_prefix: str | os.PathLike[str],
    *,
    extends: str | None = None,
    masks: Mapping[str, Sequence[int]] | None = None,
    takedown: dict[str, Any] | None = None,
) -> MergeResult:
    """Merge shard pairs virtually: write only the manifest of ``(key, prefix)`` pairs in order
    (``formats.virtual_merge``) from their dataset manifests, which all must share dtype and
    tokenizer settings. ``extends``: the version this one only appends shards to. ``masks``:
    shard key -> ordinals of documents taken down (``takedown``: the record of what did)."""
    start = time.perf_counter()
    if not shards:
        raise ConfigError("no shards to merge")
    out = Path(output_prefix)
    prefixes = [prefix for _, prefix in shards]
    read = _manifests(prefixes)  # each shard's manifest, read once
    for q, found in read:
        if found is None:
            raise InputError(f"{dataset_manifest_path(q)}: missing; a virtual merge needs it")
    provenance, quarantined = _provenance(read)
    manifests = [found for _, found in read if found is not None]
    entries, dtypes = [], set()
    for (key, q), manifest in zip(shards, manifests, strict=True):
        dtype = manifest["config"].get("dtype")
        if dtype is None:  # a manifest that does not say: the .idx header does
            with IndexedDataset(q, index_only=True) as data:
                dtype = data.dtype.name
        dtypes.add(str(dtype))
        entry = shard_entry(key, q, out.parent, manifest)
        if masks and len(masks.get(key, ())):
            entry["masked"] = sorted({int(o) for o in masks[key]})
        entries.append(entry)
    if len(dtypes) != 1:
        raise InputError(f"{out}: shards have token dtypes {sorted(dtypes)}; merge only one dtype")
    (dtype,) = dtypes
    manifest = write_virtual_manifest(
        dataset_manifest_path(out),
        name=out.name,
        shards=entries,
        dtype=dtype,
        config={"merge": "virtual", "dtype": dtype, **provenance},
        quarantined=quarantined,
        extends=extends,
        takedown=takedown,
    )
    nbytes = sum(int(e["files"]["bin"]["bytes"]) for e in entries)
    return MergeResult.of(out, prefixes, manifest, nbytes, start)
