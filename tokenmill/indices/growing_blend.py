"""Blends of growing datasets: each version of a split starts with its predecessor's samples.

Every dataset's growing index of a split only ever extends, and the blend keeps that property:

- **Weighted blends.** Megatron's greedy interleave with fixed weights picks step i's dataset
  from the step and the counts so far only, never from the datasets' sizes, so its first n picks
  are the same for any sizes. The blend is cut at the first pick a dataset cannot supply yet (no
  epochs), then at the cap (``*_samples``; None = no cap): growth only moves the cut later.
- **Temperature blends.** The weights follow the token counts, so they change as data grows: a
  version that extends its predecessor keeps its arrays and continues the greedy loop from its
  per-dataset counts with the new weights (then cuts as above).
- **Extends.** A build extends the current version when every setting but the caps is the same,
  each dataset's shard lineage starts with the recorded one and no cap is below the current
  size (docs/formats.md, ``extends``); else its arrays are built from scratch. A rebuild with
  unchanged inputs reuses the current version.

Every dataset stays in every split with a non-zero weight (one whose split has no whole era yet
has length 0, holding the blend at 0 samples until it has one): leaving one out would
renormalize the weights and change the order later on.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import ConfigError
from tokenmill.formats.blend_manifest import VERSIONS_DIR, load_blend_arrays, resolve
from tokenmill.formats.nanoset_cache import read_description, segment_keys
from tokenmill.indices._blend_kernels import greedy_blend, greedy_continue
from tokenmill.indices.blend import normalize_weights
from tokenmill.indices.growing import lineage_hash
from tokenmill.indices.growing_segments import NPY_HEADER

__all__ = [
    "GrowingState",
    "blend_segments",
    "extends_previous",
    "grow_blend",
    "growing_weights",
    "lineage_record",
]


@dataclass(frozen=True)
class GrowingState:
    """What a growing blend build needs beyond the reference plan."""

    era_samples: int
    shards: dict[str, list[tuple[str, int]]]  # each dataset's shard table
    extends: str | None = None  # the version this one extends
    previous: dict[str, Any] | None = None  # its manifest (when ``extends``)
    previous_path: Path | None = None  # that manifest's path (its arrays resolve against it)
    inputs: str = ""  # hash of the version's description without ``extends``

    def previous_arrays(
        self, split: str, weights: Sequence[float], names: Sequence[str]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The predecessor's arrays of ``split`` when the loop must continue from them (a grown
        temperature blend: other normalized weights); None when built from scratch (no
        predecessor, or the same weights, which replay it)."""
        if self.previous is None or self.previous_path is None:
            return None
        info = self.previous["splits"].get(split)
        old = self.previous["weighting"]["normalized"]
        same = [float(old[n]) for n in names] == growing_weights(weights).tolist()
        if info is None or same or info["size"] == 0:
            return None
        arrays = load_blend_arrays(info, self.previous_path)
        return arrays[0], arrays[1]

    def previous_index(self, split: str, name: str) -> dict[str, Any] | None:
        """The description of the index entry the predecessor used for dataset ``name`` in
        ``split`` (a new entry extends it: ``growing_segments``); None without one."""
        if self.previous is None or self.previous_path is None:
            return None
        for ds in self.previous["splits"].get(split, {}).get("datasets", []):
            if ds["name"] == name:
                path = ds["index"]["files"]["description"]["path"]
                return read_description(resolve(self.previous_path, path))
        return None


def blend_segments(
    state: GrowingState | None, split: str, size: int
) -> tuple[dict[str, dict[str, Any]], int]:
    """The predecessor's blend-array parts a version of ``size`` samples reads in place (as
    ``<array>.<i>`` records relative to the new version's folder) and the samples they hold, or
    ({}, 0): the version writes only the samples after them. Compacted as Nanoset segments are
    (``growing_segments``)."""
    if state is None or state.previous is None or state.extends is None:
        return {}, 0
    info = state.previous["splits"].get(split)
    if info is None or not info["size"]:
        return {}, 0
    files = info["files"]
    chain = []
    keys = [segment_keys(files, array) for array in ("dataset_index", "dataset_sample_index")]
    for di, dsi in zip(*keys, strict=True):
        rows = (int(files[dsi]["bytes"]) - NPY_HEADER) // 8  # int64
        if rows * 2 != int(files[di]["bytes"]) - NPY_HEADER:  # int16: not our layout
            return {}, 0
        chain.append((rows, files[di], files[dsi]))
    if sum(rows for rows, _, _ in chain) != int(info["size"]) or size < int(info["size"]):
        return {}, 0
    new = size - int(info["size"])
    while chain and chain[-1][0] <= 2 * new:
        new += chain.pop()[0]
    out = {}
    for i, (_, di_record, dsi_record) in enumerate(chain):
        for array, record in (("dataset_index", di_record), ("dataset_sample_index", dsi_record)):
            path = posixpath.relpath(str(record["path"]), f"{VERSIONS_DIR}/new")
            out[f"{array}.{i}"] = {**record, "path": path}
    return out, sum(rows for rows, _, _ in chain)


def growing_weights(weights: Sequence[float]) -> np.ndarray:
    """The weights normalized once; ConfigError for a zero weight (the greedy loop would pick
    that dataset once the others' errors turn negative: leave it out of the blend instead)."""
    w = normalize_weights(weights)
    if np.any(w == 0):
        raise ConfigError(
            f"weights {list(weights)}: growing blends need every weight > 0; leave the dataset "
            "out of the blend instead"
        )
    return w


def grow_blend(
    weights: Sequence[float],
    lengths: Sequence[int],
    cap: int | None,
    *,
    previous: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of a growing split (module docstring)
    over index ``lengths``, cut at ``cap`` (None: none); ``previous``: the predecessor's arrays
    to keep and continue from with these weights."""
    w = growing_weights(weights)
    sizes = np.asarray(lengths, dtype=np.int64)
    stop = int(sizes.sum()) if cap is None else min(int(cap), int(sizes.sum()))
    start, counts = 0, np.zeros(len(w), dtype=np.int64)
    if previous is not None:
        start = len(previous[0])
        counts = np.bincount(previous[0].astype(np.int64), minlength=len(w))
        if start > stop or len(counts) != len(w) or np.any(counts > sizes):
            raise ConfigError(
                f"the previous blend version ({start} samples, per dataset {counts.tolist()}) "
                f"does not fit the datasets' {sizes.tolist()} samples and the cap {cap}"
            )
    # The loop keeps every count near w·i, so the first dataset to run out does so near
    # min((size − count) / w) steps on: run that far, and twice as far while no pick overflows.
    bound = min(stop, start + int(np.min((sizes - counts) / w)) + len(w) + 1)
    while True:
        if previous is None:
            di, dsi, _ = greedy_blend(w, bound, index_dtype=np.int16)
        else:
            di, dsi = greedy_continue(w, counts, start, bound, index_dtype=np.int16)
        over = dsi >= sizes[di.astype(np.int64)]
        if over.any() or bound == stop:
            break
        bound = min(stop, start + 2 * (bound - start) + 1)
    end = int(np.argmax(over)) if over.any() else len(di)
    if previous is None:
        return di[:end], dsi[:end]
    return (
        np.concatenate([previous[0].astype(np.int16), di[:end]]),
        np.concatenate([previous[1].astype(np.int64), dsi[:end]]),
    )


Lineage = list[tuple[str, int, str]]


def lineage_record(rows: Lineage) -> dict[str, Any]:
    """``{"count", "sha256"}`` of a shard lineage: what a blend records per dataset."""
    return {"count": len(rows), "sha256": lineage_hash(rows)}


def extends_previous(
    previous: Mapping[str, Any] | None,
    header: Mapping[str, Any],
    lineages: Mapping[str, Lineage],
    sizes: Mapping[str, int | None],
) -> bool:
    """True when a blend with ``header`` (``blend_versioning.settings_header`` and
    ``growing.era_samples``) over datasets with ``lineages`` (in blend order) extends the
    ``previous`` manifest."""
    if previous is None or previous.get("semantics") != "growing":
        return False
    same = (
        all(previous.get(k) == v for k, v in header.items() if k not in ("weighting", "growing"))
        and previous.get("growing", {}).get("era_samples") == header["growing"]["era_samples"]
        and {k: previous["weighting"].get(k) for k in header["weighting"]} == header["weighting"]
        and [ds["name"] for ds in previous["datasets"]] == list(lineages)
    )
    if not same:
        return False
    for ds in previous["datasets"]:
        recorded = ds.get("shards") or {}
        rows = lineages[ds["name"]]
        count = recorded.get("count", -1)
        if not 0 <= count <= len(rows) or lineage_hash(rows[:count]) != recorded.get("sha256"):
            return False
    for split, info in previous["splits"].items():
        cap = sizes.get(split)
        if cap is not None and cap < int(info["size"]):
            return False
    return True
