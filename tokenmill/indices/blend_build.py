"""Owns the blend writer: builds (or reuses) a blend's version folder under a lock, then moves
the ``manifest.json`` pointer to it. Layout and reader: ``tokenmill.formats.blend_manifest``;
plan and version: ``blend_plan``, ``blend_versioning``.

The version is computed first (``prepare_blend``), so an unchanged blend reuses its complete
version folder. A new version is written into ``versions/.tmp/`` and renamed into place when
complete; only then does the pointer move (compare-and-swap). A failed build (any exception, a
full disk, a kill) leaves the previous pointer and version untouched.

``manifest.json`` (keys sorted; lists keep the blend's dataset order, which the indices use)::

    format_version=2, kind="blend", name, version, manifest_sha256, semantics, sequence_length,
    add_extra_token, drop_last_partial_validation (absent in older manifests: true),
    split (the split spec, e.g. "949,50,1"), seed,
    weighting: {weights: {name: w as configured} | null, temperature: T | null,
                normalized: {name: w}}
    datasets: [{name, prefix, content_hash, dtype, num_sequences, num_tokens,
                files: {bin: FILE, idx: FILE}}]
    splits: {train|valid|test: {mode: "weighted"|"exhaustive", samples_requested, size,
             files: {dataset_index: FILE, dataset_sample_index: FILE},
             datasets: [{name, split_range, tokens, num_samples, length, samples_used, epochs,
                         index: {cache_hash,
                                 files: {document, sample, shuffle, description: FILE}}}],
             skipped: [{name, reason}]}}   datasets left out of this split (may be absent: [])
    FILE = {path (relative to this manifest's folder), bytes, sha256}; a dataset's ``.bin``
           recorded by parts in its own manifest (a merge) is {path, bytes, parts,
           sha256_of_parts}, copied from that manifest: a blend never reads a ``.bin``.

``manifest_sha256`` is the sha256 of the manifest's canonical JSON (sorted keys, compact
separators) without that field. The pointer and the version's own manifest hold the same
content except the paths (each relative to its own folder) and their self-hashes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import posixpath
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import (
    atomic_open,
    create_temp,
    fsync_dir,
    remove_stale_temps,
    remove_temp_dir,
    write_json,
)
from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats.blend_manifest import (
    BLEND_ARRAYS,
    FORMAT_VERSION,
    KIND,
    MANIFEST_NAME,
    SPLITS,
    VERSIONS_DIR,
    blend_array_name,
    read_blend_manifest,
    seal,
)
from tokenmill.indices import blend as blending
from tokenmill.indices import growing_blend
from tokenmill.indices.blend_plan import Plan, file_entry
from tokenmill.indices.blend_versioning import (
    complete_version,
    prepare_blend,
    settings_header,
)
from tokenmill.indices.nanoset import FetchEntry, NanosetIndex, build_or_load
from tokenmill.indices.settings import BlendSettings
from tokenmill.storage.versions import READ_AT_START, Expected, pointer_version, swap_pointer


def build_blend(
    name: str,
    datasets: Mapping[str, str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    settings: BlendSettings,
    *,
    fetch: FetchEntry | None = None,
    expected: Expected = READ_AT_START,
) -> dict[str, Any]:
    """Build (or reuse) the blend's version, then point ``output_dir/manifest.json`` at it;
    returns the pointer manifest. ``fetch``: ``build_or_load``'s (e.g. a download from S3). The
    pointer moves by compare-and-swap against ``expected`` (its version read before the inputs,
    by default first by this call): ConflictError, with this build's version complete and the
    pointer as found, when another build moved it."""
    root = Path(output_dir)
    mpath = root / MANIFEST_NAME
    read_at_start = pointer_version(mpath) if expected == READ_AT_START else expected
    entries, plan, version = prepare_blend(name, datasets, root, cache_dir, settings)
    vdir = root / VERSIONS_DIR / version[:16]
    plan = replace(plan, base=vdir, fetch=fetch)
    remove_stale_temps(vdir)  # temp version folders of killed builds (versions/.tmp/ only)
    caches = {split: _split_caches(plan, split, h) for split, h in plan.cache_hashes().items()}
    manifest = complete_version(vdir, version)
    if manifest is None:
        normalized = blending.normalize_weights(plan.weights).tolist()
        header = {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "name": name,
            "version": version,
            **settings_header(plan, settings.weights, settings.temperature),
            "datasets": entries,
        }
        header["weighting"]["normalized"] = dict(zip(plan.prefixes, normalized, strict=True))
        if plan.growing is not None:
            era = settings.nanoset.era_samples
            header["growing"] = {"era_samples": era, "inputs": plan.growing.inputs}
            header["extends"] = plan.growing.extends
        with _versions_locked(vdir.parent):  # a build that waited finds the version done
            manifest = complete_version(vdir, version) or _write_version(plan, vdir, header, caches)
    pointer = seal(_rebased(manifest, f"{VERSIONS_DIR}/{vdir.name}"))
    remove_stale_temps(mpath)
    with contextlib.suppress(FormatError):
        if mpath.is_file() and read_blend_manifest(mpath) == pointer:
            return pointer  # already current: nothing is rewritten
    swap_pointer(mpath, version, pointer, expected=read_at_start)
    return pointer


@contextlib.contextmanager
def _versions_locked(versions: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the ``versions`` folder itself (no lock file is left), so
    concurrent builds write a version one at a time and one that waited finds it complete."""
    versions.mkdir(parents=True, exist_ok=True)
    fd = os.open(versions, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _write_version(
    plan: Plan,
    vdir: Path,
    header: dict[str, Any],
    caches: dict[str, tuple[list[NanosetIndex], list[int | None]]],
) -> dict[str, Any]:
    """Write a version into a temp folder (arrays, then its manifest) and rename it into place,
    replacing a folder of this version without a valid manifest; on error the temp goes."""
    vdir.parent.mkdir(parents=True, exist_ok=True)
    staging, _ = create_temp(vdir, Path.mkdir)
    try:
        splits = {split: _build_split(plan, staging, split, c) for split, c in caches.items()}
        manifest = seal({**header, "splits": splits})
        write_json(staging / MANIFEST_NAME, manifest)
        remove_temp_dir(staging)  # a private folder: a version holds no .tmp/
        if vdir.exists():  # no valid manifest there (checked under the lock): leftovers
            aside, _ = create_temp(vdir, functools.partial(os.rename, vdir))
            shutil.rmtree(aside)
        os.rename(staging, vdir)
        fsync_dir(vdir.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _rebased(manifest: dict[str, Any], folder: str) -> dict[str, Any]:
    """The manifest with every recorded path (relative to ``folder``) made relative to the
    folder above it: the pointer's copy of a version's manifest."""

    def move(path: str) -> str:
        return posixpath.normpath(posixpath.join(folder, path))

    def moved(files: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {k: {**entry, "path": move(entry["path"])} for k, entry in files.items()}

    datasets = [
        {**ds, "prefix": move(ds["prefix"]), "files": moved(ds["files"])}
        for ds in manifest["datasets"]
    ]
    splits = {}
    for split, info in manifest["splits"].items():
        parts = [
            {**ds, "index": {**ds["index"], "files": moved(ds["index"]["files"])}}
            for ds in info["datasets"]
        ]
        splits[split] = {**info, "files": moved(info["files"]), "datasets": parts}
    return {**manifest, "datasets": datasets, "splits": splits}


def _split_caches(
    plan: Plan, split: str, predicted: list[str | None]
) -> tuple[list[NanosetIndex], list[int | None]]:
    """Build or reuse each present dataset's index of ``split``, as the version predicted it."""
    counts = plan.counts(split)
    present = plan.present(SPLITS.index(split))
    expected_of = dict(zip(plan.prefixes, predicted, strict=True))
    indices = []
    for name, num in zip(present, counts, strict=True):
        expected = expected_of[name]
        try:
            built = build_or_load(
                plan.prefixes[name],
                plan.cache_dir,
                split,
                plan.settings,
                num,
                fetch=plan.fetch,
                previous=None if plan.growing is None else plan.growing.previous_index(split, name),
            )
        except ConfigError as exc:
            raise ConfigError(
                f"blend {plan.name!r}: dataset {name!r} split {split!r}: {exc}"
            ) from exc
        if built is None:
            raise ConfigError(
                f"blend {plan.name!r}: dataset {name!r} has no sequences in split {split!r} "
                f"with split {plan.settings.split_spec!r}; change the split or the datasets"
            )
        if built.cache_hash != expected:
            raise CacheError(
                f"blend {plan.name!r}: the index of {name!r} ({split}) is {built.cache_hash}, "
                f"the blend version was computed for {expected}: the dataset changed during "
                "the build; build the blend again"
            )
        indices.append(built)
    return indices, counts


def _blend_arrays(
    plan: Plan, split: str, indices: list[NanosetIndex]
) -> tuple[np.ndarray, np.ndarray, str]:
    """The blend arrays of one split over its present datasets' indices, and the blend mode."""
    semantics = plan.settings.semantics
    requested = plan.settings.sizes()[split]
    position = SPLITS.index(split)
    weights, present = plan.split_weights(position), plan.present(position)
    lengths = [len(ix) for ix in indices]
    where = f"blend {plan.name!r} split {split!r} (datasets in order: {', '.join(present)})"
    try:
        if plan.growing is not None:
            previous = plan.growing.previous_arrays(split, weights, present)
            grown = growing_blend.grow_blend(weights, lengths, requested, previous=previous)
            return (*grown, "growing")
        if requested is None and semantics == "megatron":
            return (*blending.exhaustive_blend_indices(lengths), "exhaustive")
        if requested is None:  # nanotron valid/test: one epoch of each, configured weights
            size = sum(lengths)
        else:
            size = blending.blend_size(weights, requested, semantics=semantics)
        blended = blending.build_blend_indices(
            weights, size, semantics=semantics, dataset_sizes=lengths
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return (*blended, "weighted")


def _build_split(
    plan: Plan,
    folder: Path,
    split: str,
    caches: tuple[list[NanosetIndex], list[int | None]],
) -> dict[str, Any]:
    """One split: blend arrays written into ``folder``, and the split's manifest part."""
    indices, counts = caches
    dataset_index, sample_index, mode = _blend_arrays(plan, split, indices)
    # growing: the predecessor's parts are read in place, only the samples after them written
    files, start = growing_blend.blend_segments(plan.growing, split, len(dataset_index))
    for array, values in zip(BLEND_ARRAYS, (dataset_index, sample_index), strict=True):
        path = folder / blend_array_name(split, array)
        with atomic_open(path, "wb") as fh:
            np.save(fh, np.asarray(values)[start:], allow_pickle=False)
        files[array] = {**file_entry(path, folder), "path": path.name}
    used = np.bincount(np.asarray(dataset_index, dtype=np.int64), minlength=len(indices))
    position = SPLITS.index(split)
    ranges, present = plan.ranges(position), plan.present(position)
    parts = []
    for name, ix, num, n_used in zip(present, indices, counts, used.tolist(), strict=True):
        span = ranges[name]  # None under growing semantics only (no range)
        if span is None:
            tokens = int(ix.description["counts"]["tokens"])
            per_epoch = max(1, len(ix))  # no epochs: the share of the emitted samples used
        else:
            tokens = int(plan.lengths[name][span[0] : span[1]].sum(dtype=np.int64))
            per_epoch = max(1, (tokens - 1) // plan.settings.sequence_length)
        records = ix.description["files"]
        index_files = {
            k: file_entry(Path(p), plan.base, records[k]["sha256"] if k in records else None)
            for k, p in ix.paths.items()
        }
        parts.append(
            {
                "name": name,
                "split_range": None if span is None else list(span),
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
        "samples_requested": plan.settings.sizes()[split],
        "size": len(dataset_index),
        "files": files,
        "datasets": parts,
        "skipped": [{"name": n, "reason": why} for n, why in plan.skipped(position).items()],
    }
