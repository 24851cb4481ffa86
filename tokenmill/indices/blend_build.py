"""Blend manifests: build every split of a named blend as an immutable version, then point
``manifest.json`` at it.

Layout of ``blends/<name>/`` (reader and constants: ``tokenmill.formats.blend_manifest``)::

    manifest.json                                 the current version's manifest (the pointer),
                                                  written last (temp -> fsync -> rename)
    versions/<version16>/manifest.json            one version; its files are never rewritten
    versions/<version16>/<split>-dataset_index.npy          dataset of each sample
                                                  (int16 megatron, uint64 nanotron)
    versions/<version16>/<split>-dataset_sample_index.npy   sample within that Nanoset (int64)

A build computes the version first (:func:`blend_version`: sha256 of the canonical JSON of every
setting, each dataset's content hash and path, and each Nanoset cache hash), so rebuilding an
unchanged blend finds the complete version folder and reuses it (same bytes, nothing rewritten).
A new version is written into a temp folder ``versions/.tmp/<version16>.tmp-<host>-<pid>-<rand>``
and renamed into place when complete; only then is the pointer replaced, by compare-and-swap
under the pointer's lock against the version read before the inputs (a build that lost a race
to a newer one leaves the pointer at the newer version: ConflictError). A failed build (any
exception, a full disk, a kill) leaves the previous pointer and version untouched.

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

A split whose spec weight is 0 is absent. A dataset whose split yields no sample (an empty split
range, e.g. no test documents with "949,50,1" on a small dataset; or too few tokens for one
sample) is left out of that split and listed in its ``skipped`` with the reason; the other
datasets are blended as if it were not in the blend (a weighted split renormalizes the
remaining configured weights: the blend Megatron builds from those datasets alone). A split
every dataset is left out of is absent, like a 0-weight split. Sizes follow FORMATS
§7.2/§7.3: a train split (and a valid/test split with a requested sample count) is a weighted
blend; megatron builds each
dataset's index with ``ceil(ceil(N·w)·1.005)`` samples and blends ``Σ ceil(N·w)``, nanotron
builds ``int(N·w·1.005)`` and blends ``N`` with wrap-around. A valid/test split without a
requested count uses one epoch of every dataset: megatron blends them exhaustively (every
sample exactly once, Megatron's full-validation rule: proportions follow dataset sizes),
nanotron blends ``Σ len`` samples with the configured weights (its reference behaviour).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import math
import os
import posixpath
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import (
    atomic_open,
    create_temp,
    file_sha256,
    fsync_dir,
    remove_stale_temps,
    remove_temp_dir,
    write_json,
)
from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats import nanoset_cache as _index_cache
from tokenmill.formats.blend_manifest import (
    BLEND_ARRAYS,
    FORMAT_VERSION,
    KIND,
    MANIFEST_NAME,
    SPLITS,
    VERSIONS_DIR,
    blend_array_name,
    check_file,
    load_index_array,
    manifest_path,
    read_blend_manifest,
    resolve,
    schema_errors,
    seal,
    verify_manifest,
)
from tokenmill.formats.dataset_manifest import (
    dataset_content_hash,
    dataset_manifest_path,
    file_problems,
    open_dataset,
    read_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDataset, data_file_path, index_file_path
from tokenmill.formats.virtual_merge import is_virtual
from tokenmill.indices import blend as blending
from tokenmill.indices import growing_blend
from tokenmill.indices._nanoset_indices import parse_split
from tokenmill.indices._sample_index import count_samples
from tokenmill.indices.growing import ERA_SAMPLES
from tokenmill.indices.nanoset import (
    SEMANTICS,
    FetchEntry,
    NanosetIndex,
    build_or_load,
    cache_key,
    entry_key,
    split_ranges,
)
from tokenmill.storage.versions import (
    READ_AT_START,
    Expected,
    pointer_version,
    swap_pointer,
    version_hash,
)

__all__ = [
    "blend_skips",
    "blend_version",
    "build_blend",
    "describe_blend",
    "read_blend_manifest",
    "skipped_warnings",
    "verify_blend",
]

# Megatron's add_extra_token_to_sequence and drop_last_partial_validation_sequence (both on by
# default; the second applies to the valid split only: train and test always drop).
FLAGS = ("add_extra_token", "drop_last_partial_validation")
DIGEST_FIELDS = ("bytes", "sha256", "parts", "sha256_of_parts")


def _file_entry(path: Path, base: Path, sha256: str | None = None) -> dict[str, Any]:
    """``{path relative to base, bytes, sha256}`` (hashing unless the hash is already known)."""
    return {
        "path": os.path.relpath(path, base),
        "bytes": path.stat().st_size,
        "sha256": sha256 or file_sha256(path),
    }


def _dataset_entry(name: str, prefix: Path, base: Path) -> dict[str, Any]:
    """A dataset's identity: relative prefix, content hash, dtype, counts and file digests.

    With a dataset manifest, the digests (``{bytes, sha256}`` or, for a merge, ``{bytes, parts,
    sha256_of_parts}``) and the content hash are copied from it after a size check (a file of
    another size is a FormatError, never hashed instead): the ``.bin`` is never read and need
    not be present (then the ``.idx`` size is checked). Only a hand-made pair without a manifest
    is hashed here.
    """
    has_manifest = dataset_manifest_path(prefix).is_file()
    if has_manifest and not index_file_path(prefix).is_file():
        manifest = read_dataset_manifest(prefix)
        if is_virtual(manifest):
            return _virtual_entry(name, prefix, base, manifest)
    # The .idx header and counts; with a manifest the .bin need not even be there (an S3 step
    # stages the .idx and manifest only), else it is sized and hashed.
    data = IndexedDataset(prefix, index_only=has_manifest)
    recorded: dict[str, Any] | None = None
    if has_manifest:
        manifest = read_dataset_manifest(prefix)
        if data_file_path(prefix).is_file():
            problems = file_problems(prefix, manifest, full=False)
        else:
            dataset_content_hash(prefix, index_only=True)  # the .idx size, or FormatError
            problems = []
        if problems:
            raise FormatError(prefix, "files", "; ".join(problems))
        recorded = manifest
    files = {}
    for kind, path in (("bin", data_file_path(prefix)), ("idx", index_file_path(prefix))):
        if recorded is None:
            files[kind] = _file_entry(path, base)
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


def _virtual_entry(name: str, prefix: Path, base: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """A virtual merge's identity: its manifest's digest (the manifest records every shard
    pair's digests in turn), content hash, dtype and counts; no shard file is read."""
    return {
        "name": name,
        "prefix": os.path.relpath(prefix, base),
        "content_hash": str(manifest["content_hash"]),
        "dtype": str(manifest["dtype"]),
        "num_sequences": int(manifest["counts"]["sequences"]),
        "num_tokens": int(manifest["counts"]["tokens"]),
        "files": {"manifest": _file_entry(dataset_manifest_path(prefix), base)},
    }


def _check_settings(
    datasets: Mapping[str, Any],
    weights: Mapping[str, float] | None,
    temperature: float | None,
    semantics: str,
    sizes: dict[str, int | None],
    settings: dict[str, Any],
) -> None:
    """ConfigError for every setting build_blend cannot use, naming the setting and value."""
    sequence_length = settings["sequence_length"]
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
    for flag in FLAGS:
        if not isinstance(settings[flag], bool):
            raise ConfigError(f"{flag} must be true or false, got {settings[flag]!r}")
    if semantics == "nanotron" and not all(settings[flag] for flag in FLAGS):
        raise ConfigError(
            "nanotron semantics always adds the extra token and drops the last partial "
            f"sample: add_extra_token and drop_last_partial_validation must be true, got "
            f"{settings['add_extra_token']} and {settings['drop_last_partial_validation']}"
        )
    if semantics == "growing" and not settings["drop_last_partial_validation"]:
        raise ConfigError(
            "growing semantics always drops the last partial sample (it would change as data "
            "grows): drop_last_partial_validation must be true"
        )
    for split, n in sizes.items():
        if (n is None and split == "train" and semantics != "growing") or (n is not None and n < 1):
            raise ConfigError(f"{split}_samples must be an integer >= 1, got {n!r}")


@dataclass(frozen=True)
class _Plan:
    """Everything the per-split builder needs, fixed for the whole blend."""

    name: str
    base: Path  # the version folder every recorded path is relative to (may not exist yet)
    cache_dir: Path
    prefixes: dict[str, Path]
    lengths: dict[str, np.ndarray]
    weights: list[float]
    settings: dict[str, Any]
    sizes: dict[str, int | None]
    content_hashes: dict[str, str]
    fetch: FetchEntry | None = None  # brings a stored index entry (remote storage) before a build
    growing: growing_blend.GrowingState | None = None  # growing semantics only

    def ranges(self, position: int) -> dict[str, tuple[int, int] | None]:
        """Each dataset's range of split ``SPLITS[position]`` (growing: None, no range)."""
        semantics = self.settings["semantics"]
        if self.growing is not None:
            return {n: None for n in self.lengths}
        return {
            n: split_ranges(self.settings["split_spec"], len(lengths), semantics)[position]
            for n, lengths in self.lengths.items()
        }

    def drop_last(self, split: str) -> bool:
        """The effective drop-last flag of ``split`` (the validation setting applies to valid
        only; train and test always drop, as Megatron)."""
        return split != "valid" or bool(self.settings["drop_last_partial_validation"])

    def index_settings(self, split: str) -> dict[str, Any]:
        """The keyword settings of ``build_or_load`` for ``split`` (without num_samples)."""
        era = {} if self.growing is None else {"era_samples": self.growing.era_samples}
        return {
            **era,
            "split": split,
            "split_spec": self.settings["split_spec"],
            "sequence_length": self.settings["sequence_length"],
            "seed": self.settings["seed"],
            "semantics": self.settings["semantics"],
            "add_extra_token": bool(self.settings["add_extra_token"]),
            "drop_last_partial": self.drop_last(split),
        }

    def skipped(self, position: int) -> dict[str, str]:
        """The datasets left out of split ``SPLITS[position]`` (their index would hold no
        sample), each with the reason, in blend order."""
        split = SPLITS[position]
        spec, seq = self.settings["split_spec"], self.settings["sequence_length"]
        extra = 1 if self.settings["add_extra_token"] else 0
        if self.growing is not None:  # every dataset stays in (growing_blend's docstring)
            if parse_split(spec)[position] > 0:
                return {}
            return {n: f"split {split!r} has weight 0 in {spec!r}" for n in self.prefixes}
        out = {}
        for name, r in self.ranges(position).items():
            if r is None or r[0] >= r[1]:
                out[name] = (
                    f"no sequences in split {split!r}: {len(self.lengths[name])} sequences "
                    f"split {spec!r} give it the range {r and list(r)}"
                )
                continue
            tokens = int(self.lengths[name][r[0] : r[1]].sum(dtype=np.int64))
            if self.settings["semantics"] == "nanotron":
                empty = (tokens - 1) // seq < 1
            elif tokens <= 1:
                empty = True
            else:  # with a requested size Megatron repeats the split: any token suffices
                one_epoch = count_samples(tokens, seq, extra, self.drop_last(split))
                empty = self.sizes[split] is None and one_epoch == 0
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
        requested = self.sizes[split]
        if requested is None or self.growing is not None:  # growing: the cap is the blend's
            return [None] * len(self.present(position))
        semantics = self.settings["semantics"]
        weights = self.split_weights(position)
        return list(blending.blend_sample_counts(weights, requested, semantics=semantics))

    def cache_hashes(self) -> dict[str, list[str | None]]:
        """The Nanoset cache hash of every (split, dataset) the blend uses, computed from the
        settings and content hashes without building anything (None: empty split range)."""
        found = {}
        for position, split in enumerate(SPLITS):
            ranges, present = self.ranges(position), self.present(position)
            if not present:
                continue
            nums = dict(zip(present, self.counts(split), strict=True))
            hashes: list[str | None] = []
            if self.growing is not None:
                for name in self.prefixes:
                    entry = entry_key(
                        len(self.lengths[name]),
                        self.content_hashes[name],
                        num_samples=None,
                        shards=self.growing.shards[name],
                        **self.index_settings(split),
                    )
                    hashes.append(None if entry is None else entry[1])
                found[split] = hashes
                continue
            for name in self.prefixes:
                r = ranges[name]
                if name not in nums or r is None:
                    hashes.append(None)
                    continue
                settings = self.index_settings(split)
                del settings["split"]
                key = cache_key(
                    self.content_hashes[name],
                    split=split,
                    split_range=r,
                    num_samples=nums[name],
                    **settings,
                )
                hashes.append(_index_cache.key_hash(key))
            found[split] = hashes
        return found


def _version_of(
    entries: list[dict[str, Any]],
    plan: _Plan,
    weights: Mapping[str, float] | None,
    temperature: float | None,
) -> str:
    """The version of a blend: sha256 (``tokenmill.storage.versions.version_hash``) of everything
    its samples and manifest depend on: format version, semantics, sequence length, flags, split,
    seed, configured weighting, requested sizes, each dataset's name, path and content hash, and
    each Nanoset cache hash with the cache's path; growing blends add the era size, each
    dataset's shard lineage and the version they extend."""
    description: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "semantics": plan.settings["semantics"],
        "sequence_length": plan.settings["sequence_length"],
        "add_extra_token": bool(plan.settings["add_extra_token"]),
        "drop_last_partial": bool(plan.settings["drop_last_partial_validation"]),
        "split": plan.settings["split_spec"],
        "seed": plan.settings["seed"],
        "weights": None if weights is None else {n: float(weights[n]) for n in plan.prefixes},
        "temperature": temperature,
        "samples": plan.sizes,
        "datasets": [[e["name"], e["prefix"], e["content_hash"]] for e in entries],
        "cache_dir": os.path.relpath(plan.cache_dir, plan.base),
        "indices": plan.cache_hashes(),
    }
    if plan.growing is not None:
        description["growing"] = {
            "era_samples": plan.growing.era_samples,
            "lineage": [e["shards"] for e in entries],
            "extends": plan.growing.extends,
        }
    return version_hash(description)


def _weighting(
    prefixes: Mapping[str, Path], weights: Mapping[str, float] | None, temperature: float | None
) -> dict[str, Any]:
    """The configured weighting as a manifest records it (without the normalized weights)."""
    configured = None if weights is None else {n: float(weights[n]) for n in prefixes}
    return {"weights": configured, "temperature": temperature}


def _current_manifest(root: Path) -> dict[str, Any] | None:
    """The blend's current pointer manifest, or None when there is none, it is unreadable or
    its version folder is incomplete (a build then extends nothing, and replaces it)."""
    mpath = root / MANIFEST_NAME
    try:
        current = read_blend_manifest(mpath) if mpath.is_file() else None
    except FormatError:
        return None
    if current is None:
        return None
    version = str(current["version"])
    return current if _complete_version(root / VERSIONS_DIR / version[:16], version) else None


def _grow(
    entries: list[dict[str, Any]],
    plan: _Plan,
    root: Path,
    weights: Mapping[str, float] | None,
    temperature: float | None,
) -> tuple[_Plan, str]:
    """The plan and version of a growing blend: its shard lineages recorded in ``entries``, and
    whether it extends the current version (``growing_blend``'s docstring)."""
    lineages = {n: growing_blend.dataset_lineage(p) for n, p in plan.prefixes.items()}
    for entry in entries:
        entry["shards"] = growing_blend.lineage_record(lineages[entry["name"]])
    state = growing_blend.GrowingState(
        era_samples=plan.settings["era_samples"],
        shards={n: [(k, d) for k, d, _ in rows] for n, rows in lineages.items()},
    )
    plan = replace(plan, growing=state)
    inputs = _version_of(entries, plan, weights, temperature)  # the inputs, extending nothing
    current = _current_manifest(root)
    if current is not None and current.get("growing", {}).get("inputs") == inputs:
        state = replace(state, inputs=inputs, extends=current.get("extends"))
        return replace(plan, growing=state), str(current["version"])  # unchanged: reuse it
    header = {
        "semantics": "growing",
        "sequence_length": plan.settings["sequence_length"],
        "add_extra_token": plan.settings["add_extra_token"],
        "drop_last_partial_validation": plan.settings["drop_last_partial_validation"],
        "split": plan.settings["split_spec"],
        "seed": plan.settings["seed"],
        "weighting": _weighting(plan.prefixes, weights, temperature),
        "growing": {"era_samples": state.era_samples},
    }
    state = replace(state, inputs=inputs)
    if current is not None and growing_blend.extends_previous(
        current, header, lineages, plan.sizes
    ):
        state = replace(
            state,
            extends=str(current["version"]),
            previous=current,
            previous_path=root / MANIFEST_NAME,
        )
    plan = replace(plan, growing=state)
    return plan, _version_of(entries, plan, weights, temperature)


def _prepare(
    name: str,
    datasets: Mapping[str, str | os.PathLike[str]],
    root: Path,
    cache_dir: Path,
    weights: Mapping[str, float] | None,
    temperature: float | None,
    sizes: dict[str, int | None],
    settings: dict[str, Any],
) -> tuple[list[dict[str, Any]], _Plan, str]:
    """Checked settings, dataset entries (from the datasets' manifests and ``.idx``), the plan
    and the version, without building anything."""
    _check_settings(datasets, weights, temperature, settings["semantics"], sizes, settings)
    base = root / VERSIONS_DIR / ("0" * 16)  # any version folder: all sit at the same depth
    prefixes = {n: Path(p) for n, p in datasets.items()}
    entries = [_dataset_entry(n, p, base) for n, p in prefixes.items()]
    if temperature is not None:
        tokens = [e["num_tokens"] for e in entries]
        configured = [float(w) for w in blending.temperature_weights(tokens, temperature)]
    else:
        configured = [float(weights[n]) for n in prefixes]  # type: ignore[index]
    plan = _Plan(
        name=name,
        base=base,
        cache_dir=cache_dir,
        prefixes=prefixes,
        lengths={
            n: np.asarray(
                open_dataset(p, index_only=dataset_manifest_path(p).is_file()).sequence_lengths
            )
            for n, p in prefixes.items()
        },
        weights=configured,
        settings=dict(settings),
        sizes=sizes,
        content_hashes={e["name"]: e["content_hash"] for e in entries},
    )
    if settings["semantics"] == "growing":
        plan, version = _grow(entries, plan, root, weights, temperature)
        return entries, plan, version
    return entries, plan, _version_of(entries, plan, weights, temperature)


def _prepared(
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
    train_samples: int | None,
    valid_samples: int | None = None,
    test_samples: int | None = None,
    semantics: str = "megatron",
    add_extra_token: bool = True,
    drop_last_partial_validation: bool = True,
    era_samples: int = ERA_SAMPLES,
) -> tuple[list[dict[str, Any]], _Plan, str]:
    """:func:`_prepare` from :func:`build_blend`'s arguments (less ``fetch`` and ``expected``)."""
    sizes = {"train": train_samples, "valid": valid_samples, "test": test_samples}
    settings = {
        "sequence_length": sequence_length,
        "split_spec": split_spec,
        "seed": seed,
        "semantics": semantics,
        "add_extra_token": add_extra_token,
        "drop_last_partial_validation": drop_last_partial_validation,
        "era_samples": era_samples,
    }
    root, cache = Path(output_dir), Path(cache_dir)
    return _prepare(name, datasets, root, cache, weights, temperature, sizes, settings)


def blend_version(
    name: str,
    datasets: Mapping[str, str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    **arguments: Any,
) -> str:
    """The version :func:`build_blend` with the same arguments builds or reuses, computed
    without building anything (reads the datasets' manifests and ``.idx`` only): e.g. to
    stage ``versions/<v16>/`` from remote storage before building, or to compare."""
    return _prepared(name, datasets, output_dir, cache_dir, **arguments)[2]


def blend_skips(
    name: str,
    datasets: Mapping[str, str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    **arguments: Any,
) -> dict[str, dict[str, str]]:
    """``{split: {dataset: reason}}``: the datasets :func:`build_blend` with the same arguments
    would leave out of each split the spec gives a share, computed without building anything
    (so a caller can refuse a blend where a weighted dataset would vanish, before it exists)."""
    plan = _prepared(name, datasets, output_dir, cache_dir, **arguments)[1]
    shares = parse_split(str(arguments.get("split_spec", "949,50,1")))
    skips = {split: plan.skipped(i) for i, split in enumerate(SPLITS) if shares[i] > 0}
    return {split: out for split, out in skips.items() if out}


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
    train_samples: int | None,
    valid_samples: int | None = None,
    test_samples: int | None = None,
    semantics: str = "megatron",
    add_extra_token: bool = True,
    drop_last_partial_validation: bool = True,
    fetch: FetchEntry | None = None,
    era_samples: int = ERA_SAMPLES,
    expected: Expected = READ_AT_START,
) -> dict[str, Any]:
    """Build (or reuse) the blend's version, then point ``output_dir/manifest.json`` at it.

    Each dataset's index caches are built or reused; the version (``versions/<v16>/``: blend
    arrays + manifest) is written only when no complete folder of that version exists. Returns
    the pointer manifest (``output_dir/manifest.json``, paths relative to ``output_dir``). On any
    error the previous pointer and versions are left as they were. ``fetch`` is passed to
    ``build_or_load`` (e.g. a pipeline step's download of an index entry stored on S3).
    ``add_extra_token`` and ``drop_last_partial_validation`` are Megatron's
    ``add_extra_token_to_sequence`` and ``drop_last_partial_validation_sequence`` (the latter
    for the valid split only). A dataset left out of a split is listed in the returned
    manifest's ``splits.<split>.skipped``. ``semantics="growing"``: ``train_samples`` may be
    None (no cap), ``era_samples`` is the era size, and the manifest says whether the version
    ``extends`` the current one (``tokenmill.indices.growing_blend``).

    The pointer moves by compare-and-swap (``tokenmill.storage.versions.swap_pointer``) against
    ``expected`` (the pointer's version read by the caller before it read the inputs; by
    default the version this call reads before anything else): ConflictError, with this
    build's version complete and the pointer left as found, when another build moved it
    meanwhile to another version.
    """
    sizes = {"train": train_samples, "valid": valid_samples, "test": test_samples}
    root = Path(output_dir)
    mpath = root / MANIFEST_NAME
    read_at_start = pointer_version(mpath) if expected == READ_AT_START else expected
    entries, plan, version = _prepare(
        name, datasets, root, Path(cache_dir), weights, temperature, sizes,
        {"sequence_length": sequence_length, "split_spec": split_spec, "seed": seed,
         "semantics": semantics, "add_extra_token": add_extra_token,
         "drop_last_partial_validation": drop_last_partial_validation,
         "era_samples": era_samples},
    )  # fmt: skip
    configured, prefixes = plan.weights, plan.prefixes
    vdir = root / VERSIONS_DIR / version[:16]
    plan = _Plan(**{**plan.__dict__, "base": vdir, "fetch": fetch})
    remove_stale_temps(vdir)  # temp version folders of killed builds (versions/.tmp/ only)
    predicted = plan.cache_hashes()
    caches = {}
    for split in SPLITS:
        if split in predicted:
            caches[split] = _split_caches(plan, split, predicted[split])
    manifest = _complete_version(vdir, version)
    if manifest is None:
        normalized = blending.normalize_weights(configured).tolist()
        header = {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "name": name,
            "version": version,
            "semantics": semantics,
            "sequence_length": sequence_length,
            "add_extra_token": add_extra_token,
            "drop_last_partial_validation": drop_last_partial_validation,
            "split": split_spec,
            "seed": seed,
            "weighting": {
                **_weighting(prefixes, weights, temperature),
                "normalized": dict(zip(prefixes, normalized, strict=True)),
            },
            "datasets": entries,
        }
        if plan.growing is not None:
            header["growing"] = {"era_samples": era_samples, "inputs": plan.growing.inputs}
            header["extends"] = plan.growing.extends
        with _versions_locked(vdir.parent):  # a build that waited finds the version done
            manifest = _complete_version(vdir, version) or _write_version(
                plan, vdir, header, caches
            )
    pointer = seal(_rebased(manifest, f"{VERSIONS_DIR}/{vdir.name}"))
    remove_stale_temps(mpath)
    with contextlib.suppress(FormatError):
        if mpath.is_file() and read_blend_manifest(mpath) == pointer:
            return pointer  # already current: nothing is rewritten
    swap_pointer(mpath, version, pointer, expected=read_at_start)
    return pointer


@contextlib.contextmanager
def _versions_locked(versions: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the ``versions`` folder itself (no lock file is left):
    concurrent builds of one blend write a version one at a time, and a build that waited
    finds the version another one completed."""
    versions.mkdir(parents=True, exist_ok=True)
    fd = os.open(versions, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _complete_version(vdir: Path, version: str) -> dict[str, Any] | None:
    """The manifest of an existing, complete version folder (its own hash and version check
    out, and every file of the folder has its recorded size), or None when there is none to
    reuse. Only the folder's own files are looked at: the datasets and index caches it reads
    are fixed by the version hash, and a remote step need not stage a merged ``.bin``."""
    mpath = vdir / MANIFEST_NAME
    if not mpath.is_file():
        return None
    try:
        manifest = read_blend_manifest(mpath)
        if manifest.get("version") != version:
            return None
        for info in manifest["splits"].values():
            for entry in info["files"].values():
                if check_file(resolve(mpath, entry["path"]), entry, hash_it=False):
                    return None
    except (FormatError, KeyError, TypeError, AttributeError):
        return None
    return manifest


def _write_version(
    plan: _Plan,
    vdir: Path,
    header: dict[str, Any],
    caches: dict[str, tuple[list[NanosetIndex], list[int | None]]],
) -> dict[str, Any]:
    """Write a version into a temp folder (arrays, then its manifest) and rename it into place.

    On any error the temp folder is removed; a folder of this version without a valid manifest
    (a partial copy, never a readable version) is replaced."""
    vdir.parent.mkdir(parents=True, exist_ok=True)
    staging, _ = create_temp(vdir, Path.mkdir)
    try:
        splits = {}
        for position, split in enumerate(SPLITS):
            if split in caches:
                ranges = plan.ranges(position)
                splits[split] = _build_split(plan, staging, split, ranges, caches[split])
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

    def moved(entry: dict[str, Any]) -> dict[str, Any]:
        return {**entry, "path": move(entry["path"])}

    datasets = [
        {
            **ds,
            "prefix": move(ds["prefix"]),
            "files": {k: moved(f) for k, f in ds["files"].items()},
        }
        for ds in manifest["datasets"]
    ]
    splits = {}
    for split, info in manifest["splits"].items():
        parts = [
            {
                **ds,
                "index": {
                    **ds["index"],
                    "files": {k: moved(f) for k, f in ds["index"]["files"].items()},
                },
            }
            for ds in info["datasets"]
        ]
        files = {k: moved(f) for k, f in info["files"].items()}
        splits[split] = {**info, "files": files, "datasets": parts}
    return {**manifest, "datasets": datasets, "splits": splits}


def _split_caches(
    plan: _Plan, split: str, predicted: list[str | None]
) -> tuple[list[NanosetIndex], list[int | None]]:
    """Build or reuse the index of ``split`` of each dataset present in it (the cache hashes
    the version names)."""
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
                num_samples=num,
                fetch=plan.fetch,
                previous=None if plan.growing is None else plan.growing.previous_index(split, name),
                **plan.index_settings(split),
            )
        except ConfigError as exc:
            raise ConfigError(
                f"blend {plan.name!r}: dataset {name!r} split {split!r}: {exc}"
            ) from exc
        if built is None:
            raise ConfigError(
                f"blend {plan.name!r}: dataset {name!r} has no sequences in split {split!r} "
                f"with split {plan.settings['split_spec']!r}; change the split or the datasets"
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
    plan: _Plan, split: str, indices: list[NanosetIndex]
) -> tuple[np.ndarray, np.ndarray, str]:
    """The blend arrays of one split over its present datasets' indices, and the blend mode."""
    semantics = plan.settings["semantics"]
    requested = plan.sizes[split]
    position = SPLITS.index(split)
    weights, present = plan.split_weights(position), plan.present(position)
    lengths = [len(ix) for ix in indices]
    where = f"blend {plan.name!r} split {split!r} (datasets in order: {', '.join(present)})"
    try:
        if plan.growing is not None:
            previous = plan.growing.previous_arrays(split, weights, present)
            grown = growing_blend.grow_blend(weights, lengths, requested, previous=previous)
            return grown[0], grown[1], "growing"
        if requested is None and semantics == "megatron":
            dataset_index, sample_index = blending.exhaustive_blend_indices(lengths)
            return dataset_index, sample_index, "exhaustive"
        if requested is None:  # nanotron valid/test: one epoch of each, configured weights
            size = sum(lengths)
        else:
            size = blending.blend_size(weights, requested, semantics=semantics)
        dataset_index, sample_index = blending.build_blend_indices(
            weights, size, semantics=semantics, dataset_sizes=lengths
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return dataset_index, sample_index, "weighted"


def _build_split(
    plan: _Plan,
    folder: Path,
    split: str,
    ranges: dict[str, tuple[int, int] | None],
    caches: tuple[list[NanosetIndex], list[int | None]],
) -> dict[str, Any]:
    """One split: blend arrays written into ``folder``, and the split's manifest part."""
    indices, counts = caches
    dataset_index, sample_index, mode = _blend_arrays(plan, split, indices)
    files = {}
    for array, values in zip(BLEND_ARRAYS, (dataset_index, sample_index), strict=True):
        path = folder / blend_array_name(split, array)
        with atomic_open(path, "wb") as fh:
            np.save(fh, np.asarray(values), allow_pickle=False)
        files[array] = {**_file_entry(path, folder), "path": path.name}
    used = np.bincount(np.asarray(dataset_index, dtype=np.int64), minlength=len(indices))
    position = SPLITS.index(split)
    present = plan.present(position)
    parts = []
    for name, ix, num, n_used in zip(present, indices, counts, used.tolist(), strict=True):
        span = ranges[name]  # None under growing semantics only (no range)
        if span is None:
            tokens = int(ix.description["counts"]["tokens"])
            per_epoch = max(1, len(ix))  # no epochs: the share of the emitted samples used
        else:
            tokens = int(plan.lengths[name][span[0] : span[1]].sum(dtype=np.int64))
            per_epoch = max(1, (tokens - 1) // plan.settings["sequence_length"])
        records = ix.description["files"]
        index_files = {
            k: _file_entry(Path(p), plan.base, records[k]["sha256"] if k in records else None)
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
        "samples_requested": plan.sizes[split],
        "size": len(dataset_index),
        "files": files,
        "datasets": parts,
        "skipped": [{"name": n, "reason": why} for n, why in plan.skipped(position).items()],
    }


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


def verify_blend(path: str | os.PathLike[str], *, full: bool = False) -> list[str]:
    """Problems between a blend manifest and its files (empty list = consistent).

    Fast (O(1) in the index sizes): the manifest's schema and own hash, every file's size, the
    index descriptions' records. ``full``: also the sha256 of every file (``.bin`` by its parts
    when recorded so) and every index value in bounds (what ``open_blend(verify="full")``
    checks).
    """
    problems = verify_manifest(path, full=full)
    if full and not problems:  # the files hash right: now every index value and pointer
        from tokenmill.loader import open_blend_split

        mpath = manifest_path(path)
        manifest = read_blend_manifest(mpath)
        for split in manifest["splits"]:
            try:
                with schema_errors(mpath):
                    open_blend_split(manifest, mpath, split, full=True)
            except (FormatError, CacheError) as exc:
                problems.append(f"split {split!r}: {exc}")
    return problems


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
        # a dataset left out of the split: the others' weights are renormalized
        total = sum(float(normalized[ds["name"]]) for ds in info["datasets"]) or 1.0
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
                    requested=float(normalized[ds["name"]]) / total,
                    realized=count / max(1, len(dataset_index)),
                    samples=count,
                    size=len(dataset_index),
                    weighted=info["mode"] in ("weighted", "growing"),
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
        elif info["mode"] == "growing":
            cap = info["samples_requested"]
            how = f"growing, weighted, {'no cap' if cap is None else f'cap {cap}'}"
            how += f", extends {manifest.get('extends') or 'nothing'}"
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
        lines += [
            f"  left out: {entry['name']} ({entry['reason']})" for entry in info.get("skipped", [])
        ]
    return "\n".join(lines)
