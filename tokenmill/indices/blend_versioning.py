"""Owns a blend's version: the hash of everything its samples depend on, computed from the plan
without building anything (``prepare_blend``), the reuse check of a complete
version folder, and whether a growing blend extends the current version."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from tokenmill.errors import FormatError
from tokenmill.formats.blend_manifest import (
    FORMAT_VERSION,
    KIND,
    MANIFEST_NAME,
    SPLITS,
    VERSIONS_DIR,
    check_file,
    read_blend_manifest,
    resolve,
)
from tokenmill.indices import blend as blending
from tokenmill.indices import growing_blend
from tokenmill.indices._nanoset_indices import parse_split
from tokenmill.indices.blend_plan import Plan, check_settings, dataset_entry
from tokenmill.indices.growing import shard_lineage
from tokenmill.indices.nanoset import index_lengths
from tokenmill.indices.settings import BlendSettings
from tokenmill.storage.versions import version_hash


def version_of(
    entries: list[dict[str, Any]],
    plan: Plan,
    weights: Mapping[str, float] | None,
    temperature: float | None,
) -> str:
    """The version of a blend: sha256 (``version_hash``) of everything its samples and manifest
    depend on: every setting, the configured weighting, each dataset's name, path and content
    hash, and each Nanoset cache hash with the cache's path; growing blends add the era size,
    each dataset's shard lineage and the version they extend."""
    settings = BlendSettings(plan.settings, weights=weights, temperature=temperature)
    description: dict[str, Any] = {
        **settings_description(settings, list(plan.prefixes)),
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


def settings_description(settings: BlendSettings, names: Sequence[str]) -> dict[str, Any]:
    """The part of a blend's version description its settings give (datasets ``names`` in
    blend order): shared by :func:`version_of` and :func:`blend_data_version`."""
    nanoset, weights = settings.nanoset, settings.weights
    return {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "semantics": nanoset.semantics,
        "sequence_length": nanoset.sequence_length,
        "add_extra_token": bool(nanoset.add_extra_token),
        "drop_last_partial": bool(nanoset.drop_last_partial_validation),
        "split": nanoset.split_spec,
        "seed": nanoset.seed,
        "weights": None if weights is None else {n: float(weights[n]) for n in names},
        "temperature": settings.temperature,
        "samples": nanoset.sizes(),
    }


def blend_data_version(settings: BlendSettings, members: Sequence[tuple[str, str | None]]) -> str:
    """A blend's version known before its inputs are read: :func:`version_of`'s settings with
    each member's ``(name, nanoset.index_version)`` in place of the datasets and caches those
    fix. An orchestrator records it (e.g. as a Dagster data version) to tell a stale blend from
    its upstream versions alone."""
    names = [name for name, _ in members]
    description = {**settings_description(settings, names), "members": [list(m) for m in members]}
    if settings.nanoset.semantics == "growing":
        description["growing"] = {"era_samples": settings.nanoset.era_samples}
    return version_hash(description)


def settings_header(
    plan: Plan, weights: Mapping[str, float] | None, temperature: float | None
) -> dict[str, Any]:
    """The settings and configured weighting as a blend manifest records them (the build adds
    the normalized weights)."""
    settings = plan.settings
    configured = None if weights is None else {n: float(weights[n]) for n in plan.prefixes}
    return {
        "semantics": settings.semantics,
        "sequence_length": settings.sequence_length,
        "add_extra_token": settings.add_extra_token,
        "drop_last_partial_validation": settings.drop_last_partial_validation,
        "split": settings.split_spec,
        "seed": settings.seed,
        "weighting": {"weights": configured, "temperature": temperature},
    }


def _current_manifest(root: Path) -> dict[str, Any] | None:
    """The blend's current pointer manifest, or None when there is none, it is unreadable or
    its version folder is incomplete (a build then extends nothing, and replaces it)."""
    try:
        current = read_blend_manifest(root / MANIFEST_NAME)
    except FormatError:
        return None
    version = str(current["version"])
    return current if complete_version(root / VERSIONS_DIR / version[:16], version) else None


def _grow(
    entries: list[dict[str, Any]],
    plan: Plan,
    root: Path,
    weights: Mapping[str, float] | None,
    temperature: float | None,
) -> tuple[Plan, str]:
    """The plan and version of a growing blend: its shard lineages recorded in ``entries``, and
    whether it extends the current version (``growing_blend``'s docstring)."""
    lineages = {n: shard_lineage(p) for n, p in plan.prefixes.items()}
    for entry in entries:
        entry["shards"] = growing_blend.lineage_record(lineages[entry["name"]])
    state = growing_blend.GrowingState(
        era_samples=plan.settings.era_samples,
        shards={n: [(k, d) for k, d, _ in rows] for n, rows in lineages.items()},
    )
    plan = replace(plan, growing=state)
    inputs = version_of(entries, plan, weights, temperature)  # the inputs, extending nothing
    current = _current_manifest(root)
    if current is not None and current.get("growing", {}).get("inputs") == inputs:
        state = replace(state, inputs=inputs, extends=current.get("extends"))
        return replace(plan, growing=state), str(current["version"])  # unchanged: reuse it
    header = {
        **settings_header(plan, weights, temperature),
        "growing": {"era_samples": state.era_samples},
    }
    state = replace(state, inputs=inputs)
    if current is not None and growing_blend.extends_previous(
        current, header, lineages, plan.settings.sizes()
    ):
        version, path = str(current["version"]), root / MANIFEST_NAME
        state = replace(state, extends=version, previous=current, previous_path=path)
    plan = replace(plan, growing=state)
    return plan, version_of(entries, plan, weights, temperature)


class PreparedBlend(NamedTuple):
    """A blend as :func:`build_blend` with the same arguments builds or reuses it, computed
    without building anything: its dataset entries, plan and version."""

    entries: list[dict[str, Any]]
    plan: Plan
    version: str

    def skips(self) -> dict[str, dict[str, str]]:
        """``{split: {dataset: reason}}``: the datasets the build leaves out of each split of
        non-zero share (a caller may refuse a blend where a weighted dataset would vanish)."""
        shares = parse_split(self.plan.settings.split_spec)
        skips = {split: self.plan.skipped(i) for i, split in enumerate(SPLITS) if shares[i] > 0}
        return {split: out for split, out in skips.items() if out}


def prepare_blend(
    name: str,
    datasets: Mapping[str, str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    settings: BlendSettings,
) -> PreparedBlend:
    """Checked settings, dataset entries, plan and version of :func:`build_blend`'s arguments,
    reading only manifests and ``.idx`` (e.g. to stage ``versions/<v16>/`` before building)."""
    weights, temperature, nanoset = settings.weights, settings.temperature, settings.nanoset
    check_settings(datasets, weights, temperature, nanoset)
    root = Path(output_dir)
    base = root / VERSIONS_DIR / ("0" * 16)  # any version folder: all sit at the same depth
    prefixes = {n: Path(p) for n, p in datasets.items()}
    entries = [dataset_entry(n, p, base) for n, p in prefixes.items()]
    if temperature is not None:
        tokens = [e["num_tokens"] for e in entries]
        configured = [float(w) for w in blending.temperature_weights(tokens, temperature)]
    else:
        configured = [float(weights[n]) for n in prefixes]  # type: ignore[index]
    plan = Plan(
        name=name,
        base=base,
        cache_dir=Path(cache_dir),
        prefixes=prefixes,
        lengths={n: index_lengths(p, nanoset.semantics) for n, p in prefixes.items()},
        weights=configured,
        settings=nanoset,
        content_hashes={e["name"]: e["content_hash"] for e in entries},
    )
    if nanoset.semantics == "growing":
        return PreparedBlend(entries, *_grow(entries, plan, root, weights, temperature))
    return PreparedBlend(entries, plan, version_of(entries, plan, weights, temperature))


def complete_version(vdir: Path, version: str) -> dict[str, Any] | None:
    """The manifest of a complete version folder (its hash and version check out, and its own
    files have their recorded sizes), else None: the datasets and caches it reads are fixed by
    the version hash, and a remote step need not stage a merged ``.bin``."""
    mpath = vdir / MANIFEST_NAME
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
