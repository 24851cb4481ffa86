"""Blend manifests: build every split of a named blend and record it in ``manifest.json``.

Layout of ``blends/<name>/`` (reader and constants: ``tokenmill.loader._manifest``)::

    manifest.json                       written last (temp -> fsync -> rename) = "complete"
    <split>-dataset_index.npy           dataset of each sample (int16 megatron, uint64 nanotron)
    <split>-dataset_sample_index.npy    sample within that dataset's Nanoset (int64)

``manifest.json`` (keys sorted; lists keep the blend's dataset order, which the indices use)::

    format_version, kind="blend", name, semantics, sequence_length, add_extra_token,
    split (the split spec, e.g. "949,50,1"), seed,
    weighting: {weights: {name: w as configured} | null, temperature: T | null,
                normalized: {name: w}}
    datasets: [{name, prefix, content_hash, dtype, num_sequences, num_tokens,
                files: {bin: FILE, idx: FILE}}]
    splits: {train|valid|test: {mode: "weighted"|"exhaustive", samples_requested, size,
             files: {dataset_index: FILE, dataset_sample_index: FILE},
             datasets: [{name, split_range, tokens, num_samples, length, samples_used, epochs,
                         index: {cache_hash,
                                 files: {document, sample, shuffle, description: FILE}}}]}}
    FILE = {path (relative to this directory), bytes, sha256}

A split whose spec weight is 0 is absent. Sizes follow FORMATS §7.2/§7.3: a train split (and a
valid/test split with a requested sample count) is a weighted blend; megatron builds each
dataset's index with ``ceil(ceil(N·w)·1.005)`` samples and blends ``Σ ceil(N·w)``, nanotron
builds ``int(N·w·1.005)`` and blends ``N`` with wrap-around. A valid/test split without a
requested count uses one epoch of every dataset: megatron blends them exhaustively (every
sample exactly once, Megatron's full-validation rule: proportions follow dataset sizes),
nanotron blends ``Σ len`` samples with the configured weights (its reference behaviour).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill import blend as blending
from tokenmill._atomic import atomic_open, file_sha256, remove_stale_temps, write_json
from tokenmill.errors import ConfigError
from tokenmill.formats.indexed import IndexedDataset, data_file_path, index_file_path
from tokenmill.loader._manifest import (
    BLEND_ARRAYS,
    FORMAT_VERSION,
    KIND,
    MANIFEST_NAME,
    SPLITS,
    blend_array_name,
    load_index_array,
    manifest_path,
    read_blend_manifest,
    resolve,
    schema_errors,
    verify_manifest,
)
from tokenmill.manifest import dataset_content_hash, dataset_manifest_path, read_dataset_manifest
from tokenmill.nanoset import NanosetIndex, build_or_load, split_ranges

__all__ = ["build_blend", "describe_blend", "read_blend_manifest", "verify_blend"]

SEMANTICS = ("megatron", "nanotron")


def _file_entry(path: Path, root: Path, sha256: str | None = None) -> dict[str, Any]:
    """``{path relative to root, bytes, sha256}`` (hashing unless the hash is already known)."""
    return {
        "path": os.path.relpath(path, root),
        "bytes": path.stat().st_size,
        "sha256": sha256 or file_sha256(path),
    }


def _dataset_entry(name: str, prefix: Path, root: Path) -> dict[str, Any]:
    """A dataset's identity: relative prefix, content hash, counts and file hashes.

    The per-file sha256 comes from the dataset's own manifest when its sizes still match,
    so a multi-GB ``.bin`` is not re-hashed for every blend.
    """
    data = IndexedDataset(prefix)
    known: dict[str, str] = {}
    if dataset_manifest_path(prefix).is_file():
        recorded = read_dataset_manifest(prefix)["files"]
        for path in (data_file_path(prefix), index_file_path(prefix)):
            info = recorded.get(path.name, {})
            if info.get("bytes") == path.stat().st_size:
                known[path.suffix] = info.get("sha256")
    files = {
        kind: _file_entry(path, root, known.get(path.suffix))
        for kind, path in (("bin", data.bin_path), ("idx", data.idx_path))
    }
    return {
        "name": name,
        "prefix": os.path.relpath(prefix, root),
        "content_hash": dataset_content_hash(prefix),
        "dtype": data.dtype.name,
        "num_sequences": len(data),
        "num_tokens": data.num_tokens,
        "files": files,
    }


def _check_settings(
    datasets: Mapping[str, Any],
    weights: Mapping[str, float] | None,
    temperature: float | None,
    semantics: str,
    sizes: dict[str, int | None],
    sequence_length: int,
) -> None:
    """ConfigError for every setting build_blend cannot use, naming the setting and value."""
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
            raise ConfigError(f"weights must be finite, >= 0 and not all 0, got {weights}")
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    if semantics not in SEMANTICS:
        raise ConfigError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    if sequence_length < 2:
        raise ConfigError(f"sequence_length must be >= 2, got {sequence_length}")
    for split, n in sizes.items():
        if (n is None and split == "train") or (n is not None and n < 1):
            raise ConfigError(f"{split}_samples must be an integer >= 1, got {n!r}")


@dataclass(frozen=True)
class _Plan:
    """Everything the per-split builder needs, fixed for the whole blend."""

    name: str
    root: Path
    cache_dir: Path
    prefixes: dict[str, Path]
    lengths: dict[str, np.ndarray]
    weights: list[float]
    settings: dict[str, Any]


def build_blend(
    name: str,
    datasets: Mapping[str, str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    *,
    weights: Mapping[str, float] | None = None,
    temperature: float | None = None,
    sequence_length: int,
    split_spec: str = "949,50,1",
    seed: int = 1234,
    train_samples: int,
    valid_samples: int | None = None,
    test_samples: int | None = None,
    semantics: str = "megatron",
) -> dict[str, Any]:
    """Build (or reuse) each dataset's index caches, the blend arrays, then the manifest.

    Returns the manifest written to ``output_dir/manifest.json``. An existing manifest is
    removed first, so an interrupted rebuild leaves an incomplete blend, never a stale one.
    """
    sizes = {"train": train_samples, "valid": valid_samples, "test": test_samples}
    _check_settings(datasets, weights, temperature, semantics, sizes, sequence_length)
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    mpath = root / MANIFEST_NAME
    mpath.unlink(missing_ok=True)
    remove_stale_temps(mpath)
    prefixes = {n: Path(p) for n, p in datasets.items()}
    entries = [_dataset_entry(n, p, root) for n, p in prefixes.items()]
    if temperature is not None:
        tokens = [e["num_tokens"] for e in entries]
        configured = [float(w) for w in blending.temperature_weights(tokens, temperature)]
    else:
        configured = [float(weights[n]) for n in prefixes]  # type: ignore[index]
    plan = _Plan(
        name=name,
        root=root,
        cache_dir=Path(cache_dir),
        prefixes=prefixes,
        lengths={n: np.asarray(IndexedDataset(p).sequence_lengths) for n, p in prefixes.items()},
        weights=configured,
        settings={
            "sequence_length": sequence_length,
            "split_spec": split_spec,
            "seed": seed,
            "semantics": semantics,
        },
    )
    splits = {}
    with _arrays_removed_on_error(root):
        for position, split in enumerate(SPLITS):
            ranges = {
                n: split_ranges(split_spec, len(lengths), semantics)[position]
                for n, lengths in plan.lengths.items()
            }
            if any(r is not None for r in ranges.values()):
                splits[split] = _build_split(plan, split, ranges, sizes[split])
    normalized = blending.normalize_weights(configured).tolist()
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "name": name,
        "semantics": semantics,
        "sequence_length": sequence_length,
        "add_extra_token": True,
        "split": split_spec,
        "seed": seed,
        "weighting": {
            "weights": None if weights is None else {n: float(weights[n]) for n in prefixes},
            "temperature": temperature,
            "normalized": dict(zip(prefixes, normalized, strict=True)),
        },
        "datasets": entries,
        "splits": splits,
    }
    with _arrays_removed_on_error(root):
        write_json(mpath, manifest)
    return manifest


@contextlib.contextmanager
def _arrays_removed_on_error(root: Path) -> Iterator[None]:
    """On an error (e.g. a full disk) remove the blend arrays: none stays without a manifest."""
    try:
        yield
    except BaseException:
        for split in SPLITS:
            for array in BLEND_ARRAYS:
                (root / blend_array_name(split, array)).unlink(missing_ok=True)
        raise


def _split_indices(
    plan: _Plan, split: str, requested: int | None
) -> tuple[list[NanosetIndex], list[int | None], np.ndarray, np.ndarray, str]:
    """Per-dataset indices (with the sample counts they were built for) and the blend arrays."""
    semantics = plan.settings["semantics"]
    counts: list[int | None] = [None] * len(plan.prefixes)
    if requested is not None:
        counts = list(blending.blend_sample_counts(plan.weights, requested, semantics=semantics))
    indices = []
    for (name, prefix), num in zip(plan.prefixes.items(), counts, strict=True):
        built = build_or_load(prefix, plan.cache_dir, split=split, num_samples=num, **plan.settings)
        if built is None:
            raise ConfigError(
                f"blend {plan.name!r}: dataset {name!r} has no sequences in split {split!r} "
                f"with split {plan.settings['split_spec']!r}; change the split or the datasets"
            )
        indices.append(built)
    lengths = [len(ix) for ix in indices]
    if requested is None and semantics == "megatron":
        dataset_index, sample_index = blending.exhaustive_blend_indices(lengths)
        return indices, counts, dataset_index, sample_index, "exhaustive"
    if requested is None:  # nanotron valid/test: one epoch of each, configured weights
        size = sum(lengths)
    else:
        size = blending.blend_size(plan.weights, requested, semantics=semantics)
    try:
        dataset_index, sample_index = blending.build_blend_indices(
            plan.weights, size, semantics=semantics, dataset_sizes=lengths
        )
    except ConfigError as exc:
        raise ConfigError(
            f"blend {plan.name!r} split {split!r} (datasets in order: "
            f"{', '.join(plan.prefixes)}): {exc}"
        ) from exc
    return indices, counts, dataset_index, sample_index, "weighted"


def _build_split(
    plan: _Plan, split: str, ranges: dict[str, tuple[int, int] | None], requested: int | None
) -> dict[str, Any]:
    """One split: index caches and blend arrays on disk, and the split's manifest part."""
    indices, counts, dataset_index, sample_index, mode = _split_indices(plan, split, requested)
    files = {}
    for array, values in zip(BLEND_ARRAYS, (dataset_index, sample_index), strict=True):
        path = plan.root / blend_array_name(split, array)
        with atomic_open(path, "wb") as fh:
            np.save(fh, np.asarray(values), allow_pickle=False)
        files[array] = _file_entry(path, plan.root)
    used = np.bincount(np.asarray(dataset_index, dtype=np.int64), minlength=len(indices))
    parts = []
    for name, ix, num, n_used in zip(plan.prefixes, indices, counts, used.tolist(), strict=True):
        lo, hi = ranges[name]  # type: ignore[misc]  # not None: the index was built
        tokens = int(plan.lengths[name][lo:hi].sum(dtype=np.int64))
        per_epoch = max(1, (tokens - 1) // plan.settings["sequence_length"])
        index_files = {k: _file_entry(Path(p), plan.root) for k, p in ix.paths.items()}
        parts.append(
            {
                "name": name,
                "split_range": [lo, hi],
                "tokens": tokens,
                "num_samples": num,
                "length": len(ix),
                "samples_used": n_used,
                "epochs": round(n_used / per_epoch, 6),
                "index": {"cache_hash": ix.cache_hash, "files": index_files},
            }
        )
    return {
        "mode": mode,
        "samples_requested": requested,
        "size": len(dataset_index),
        "files": files,
        "datasets": parts,
    }


def verify_blend(path: str | os.PathLike[str], *, full: bool = False) -> list[str]:
    """Problems between a blend manifest and its files (empty list = consistent).

    Fast: sizes of every file, sha256 of the index files; ``full``: also the ``.bin`` files.
    """
    return verify_manifest(path, full=full)


def describe_blend(path: str | os.PathLike[str]) -> str:
    """A per-split table of requested weights against the realized blend proportions."""
    mpath = manifest_path(path)
    manifest = read_blend_manifest(mpath)
    with schema_errors(mpath):
        return _describe(manifest, mpath)


@dataclass(frozen=True)
class Share:
    """One dataset's part of one split of a blend: requested (normalized weight) vs realized."""

    split: str
    dataset: str
    requested: float
    realized: float
    samples: int
    size: int
    weighted: bool


def realized_shares(manifest: dict[str, Any], mpath: Path) -> list[Share]:
    """Requested against realized share per split and dataset (exhaustive splits follow the
    dataset sizes by design, so only weighted ones are expected to match the weights)."""
    normalized = manifest["weighting"]["normalized"]
    shares = []
    for split in (s for s in SPLITS if s in manifest["splits"]):
        info = manifest["splits"][split]
        entry = info["files"]["dataset_index"]
        dataset_index = load_index_array(
            resolve(mpath, entry["path"]), ndim=1, what="dataset_index"
        )
        counts = np.bincount(dataset_index.astype(np.int64), minlength=len(info["datasets"]))
        for ds, count in zip(info["datasets"], counts.tolist(), strict=True):
            shares.append(
                Share(
                    split=split,
                    dataset=ds["name"],
                    requested=float(normalized[ds["name"]]),
                    realized=count / max(1, len(dataset_index)),
                    samples=count,
                    size=len(dataset_index),
                    weighted=info["mode"] == "weighted",
                )
            )
    return shares


def _describe(manifest: dict[str, Any], mpath: Path) -> str:
    """The table of ``describe_blend`` for a loaded manifest."""
    lines = [
        f"blend {manifest['name']!r}: semantics {manifest['semantics']}, sequence length "
        f"{manifest['sequence_length']}, split {manifest['split']}, seed {manifest['seed']}"
    ]
    shares = realized_shares(manifest, mpath)
    for split in (s for s in SPLITS if s in manifest["splits"]):
        info = manifest["splits"][split]
        if info["mode"] == "exhaustive":
            how = "exhaustive: one epoch of every dataset, shares follow dataset sizes"
        elif info["samples_requested"] is None:
            how = "weighted, one epoch of every dataset"
        else:
            how = f"weighted, requested {info['samples_requested']}"
        split_shares = [sh for sh in shares if sh.split == split]
        size = split_shares[0].size if split_shares else 0
        lines += ["", f"{split}: {size} samples ({how})"]
        rows = [["dataset", "weight", "realized", "diff", "samples", "index len", "epochs"]]
        for ds, sh in zip(info["datasets"], split_shares, strict=True):
            rows.append(
                [
                    ds["name"],
                    f"{sh.requested:.4f}",
                    f"{sh.realized:.4f}",
                    f"{sh.realized - sh.requested:+.4f}",
                    str(sh.samples),
                    str(ds["length"]),
                    f"{ds['epochs']:.3f}",
                ]
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += [
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
            for r in rows
        ]
    return "\n".join(lines)
