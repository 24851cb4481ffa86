"""The training-side loader: numpy only (no torch, Dagster, transformers or pyarrow imports).

    from tokenmill.loader import open_blend, BatchSampler
    ds = open_blend("blends/mix/manifest.json", split="train")   # checks files vs manifest
    version = ds.version                  # record it; open_blend(..., version=version) on resume
    sampler = BatchSampler(len(ds), global_batch_size=512, rank=r, world_size=w, start_step=b)
    for indices in sampler:
        tokens = ds.get_batch(indices)        # int64 [B, sequence_length + 1]

``ds[k]`` is one sample as Megatron's GPTDataset assembles it (FORMATS §5.5). A growing blend
is followed at step boundaries by ``FollowGrowth``; ``tokenmill.loader.torch`` adapts to torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tokenmill.errors import CacheError, ConfigError
from tokenmill.formats.blend_manifest import (
    BLEND_ARRAYS,
    INDEX_ARRAYS,
    blend_part_paths,
    index_part_paths,
    load_index_parts,
    manifest_path,
    read_blend_manifest,
    rebuild_hint,
    resolve,
    schema_errors,
    split_problems,
    verify_manifest,
    version_manifest_path,
)
from tokenmill.loader._blended import BlendedDataset
from tokenmill.loader._datasets import PAD_ID, NanosetDataset, part_names
from tokenmill.loader._open import is_full, open_local, open_nanoset
from tokenmill.loader._sampler import BatchSampler

__all__ = [
    "BatchSampler",
    "BlendedDataset",
    "FollowGrowth",
    "NanosetDataset",
    "newest_extension",
    "open_blend",
    "open_blend_split",
    "open_nanoset",
    "reopen_if_extended",
]


def open_blend(
    manifest: str | os.PathLike[str],
    split: str = "train",
    *,
    version: str | None = None,
    verify: str = "fast",
    pad_id: int = PAD_ID,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_bytes: int | None = None,
) -> BlendedDataset:
    """Open one split of a blend after checking its files against the manifest.

    ``manifest`` is ``blends/<name>/manifest.json`` (or its folder): the current version;
    ``version`` (``ds.version``, or its first 16 hex digits) opens that immutable version
    instead (ConfigError listing the available ones when it was removed).
    ``verify="fast"`` (O(1) in index size, every rank): the manifest's schema and sha256, file
    sizes, index descriptions; index values are checked per batch. ``"full"`` (``tokenmill
    verify``, once): also every file's sha256 and every index value and ``.idx`` pointer. A stale
    or partial blend raises CacheError naming what to rebuild; a malformed file FormatError.
    ``pad_id`` fills short samples (default -1, Megatron's without a tokenizer pad id).

    An ``s3://`` manifest (the ``tokenmill[s3]`` extra; endpoint and credentials from the AWS
    environment) mirrors its small files into ``cache_dir`` (default ``$TOKENMILL_CACHE_DIR`` or
    ``~/.cache/tokenmill/s3``) and reads token files by blocks through the node-local cache
    there, each block checked by its sha256, at most ``cache_bytes`` kept (None: unbounded);
    ``verify="full"`` is local only.
    """
    full = is_full(verify)
    where: object = manifest
    opener = None
    if str(manifest).startswith("s3://"):
        if full:
            raise ConfigError(
                "verify='full' reads every byte: pull the blend and verify it locally"
            )
        mpath, opener = _mirror_s3_blend(str(manifest), version, cache_dir, cache_bytes)
    else:
        mpath = manifest_path(manifest)
        if version is not None:
            mpath = version_manifest_path(mpath, version)
        where = mpath
    info = read_blend_manifest(mpath)
    if split not in info["splits"]:
        raise ConfigError(
            f"{where}: blend {info['name']!r} has no {split!r} split "
            f"(it has: {', '.join(info['splits']) or 'none'})"
        )
    if version is not None and not str(info["version"]).startswith(version):
        raise CacheError(f"{where}: records version {info['version']}, not {version}")
    merges: dict[str, dict[str, Any]] = {}  # virtual merges' manifests, read once
    with schema_errors(mpath):
        if opener is None:  # local: the datasets' files too (S3: checked when read)
            problems = verify_manifest(mpath, [split], full=full, merges=merges)
            hint = f"; {rebuild_hint(info, mpath)}"
        else:
            problems, hint = split_problems(info, mpath, split, full=False), ""
        if problems:
            raise CacheError(
                f"{where}: blend is stale or incomplete{hint}:\n  " + "\n  ".join(problems)
            )
        return open_blend_split(
            info, mpath, split, full=full, pad_id=pad_id, open_data=opener, merges=merges
        )


def _mirror_s3_blend(
    uri: str,
    version: str | None,
    cache_dir: str | os.PathLike[str] | None,
    cache_bytes: int | None,
) -> tuple[Path, Any]:
    """The local manifest of an ``s3://`` blend's mirrored small files and the opener of its
    datasets (read by blocks through the cache: tokenmill.loader._s3*, imported here only)."""
    from tokenmill.loader._s3 import cache_for
    from tokenmill.loader._s3_data import RemoteData, remote_dataset
    from tokenmill.loader._s3_open import default_cache_dir, mirror_blend

    cache = cache_for(cache_dir if cache_dir is not None else default_cache_dir(), cache_bytes)

    def remote(prefix: Path, *, full: bool, recorded: dict[str, Any] | None) -> RemoteData:
        return remote_dataset(prefix, recorded, cache)

    return mirror_blend(uri, version, cache.root, cache.client), remote


def open_blend_split(
    info: dict[str, Any],
    mpath: Path,
    split: str,
    *,
    full: bool,
    pad_id: int = PAD_ID,
    open_data: Any = None,
    merges: dict[str, dict[str, Any]] | None = None,
) -> BlendedDataset:
    """Open one split of a manifest already read and verified as a BlendedDataset (``full``:
    every index value checked too; ``tokenmill verify`` reuses this). ``open_data(prefix,
    full=, recorded=)`` opens each dataset (default: local); ``recorded`` is a pair's blend entry
    (it opens from those counts) or a virtual merge's manifest already checked (``merges``)."""
    opener = open_local if open_data is None else open_data
    entries = {ds["name"]: ds for ds in info["datasets"]}
    part = info["splits"][split]
    datasets = {}
    for ds in part["datasets"]:
        entry = entries[ds["name"]]
        recorded = (merges or {}).get(ds["name"]) if "manifest" in entry["files"] else entry
        paths = index_part_paths(ds, mpath)
        arrays = [
            load_index_parts(
                parts,
                ndim=2 if kind == "sample" else 1,
                what=f"{kind}_index of dataset {ds['name']!r}",
            )
            for kind, parts in zip(INDEX_ARRAYS, paths, strict=True)
        ]
        datasets[ds["name"]] = NanosetDataset(
            opener(resolve(mpath, entry["prefix"]), full=full, recorded=recorded),
            *arrays,
            sequence_length=info["sequence_length"],
            add_extra_token=info["add_extra_token"],
            pad_id=pad_id,
            name=ds["name"],
            validate=full,
            index_paths=part_names(paths),
            version=ds["index"]["cache_hash"],
        )
    array_paths = blend_part_paths(part, mpath)
    blend_arrays = [
        load_index_parts(paths, ndim=1, what=a)
        for a, paths in zip(BLEND_ARRAYS, array_paths, strict=True)
    ]
    return BlendedDataset(
        datasets,
        *blend_arrays,
        manifest=info,
        split=split,
        validate=full,
        array_paths=part_names(array_paths),
        version=str(info["version"]),
    )


def newest_extension(manifest: str | os.PathLike[str], version: str) -> str | None:
    """The blend's current version when it is ``version`` or extends it through a chain of
    versions each recording the one it extends (all still present), else None: a job pinned
    to ``version`` may then switch to it at the same step, with no replay and no gap."""
    mpath = manifest_path(manifest)
    current = read_blend_manifest(mpath)
    info, seen = current, set()
    while str(info["version"]) != version:
        parent = info.get("extends")
        if parent is None or parent in seen:
            return None
        seen.add(parent)
        try:
            info = read_blend_manifest(version_manifest_path(mpath, str(parent)))
        except ConfigError:  # a version of the chain was removed: the chain cannot be checked
            return None
    return str(current["version"])


def reopen_if_extended(
    ds: BlendedDataset,
    manifest: str | os.PathLike[str],
    *,
    verify: str = "fast",
    pad_id: int = PAD_ID,
) -> BlendedDataset:
    """The same split of the blend's current version when that version extends ``ds``'s (its
    first ``len(ds)`` samples are ``ds``'s), else ``ds`` itself (same version, or no extension)."""
    if ds.version is None:
        raise ConfigError("the dataset has no blend version: open it with open_blend")
    newest = newest_extension(manifest, ds.version)
    if newest is None or newest == ds.version:
        return ds
    return open_blend(manifest, ds.split, version=newest, verify=verify, pad_id=pad_id)


class FollowGrowth:
    """One split of a blend that moves to newer versions extending the one in use: call
    ``refresh()`` at a checkpoint, then iterate ``sampler(step)`` from the same step (steps count
    global batches, so no sample is replayed or skipped); the user guide's §5 shows the loop."""

    def __init__(
        self,
        manifest: str | os.PathLike[str],
        split: str = "train",
        *,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        version: str | None = None,
        verify: str = "fast",
        pad_id: int = PAD_ID,
    ) -> None:
        self.manifest = Path(manifest)
        self.global_batch_size = global_batch_size
        self.rank, self.world_size = rank, world_size
        self.verify, self.pad_id = verify, pad_id
        self.ds = open_blend(manifest, split, version=version, verify=verify, pad_id=pad_id)

    @property
    def version(self) -> str | None:
        """The version in use (record it with the checkpoint; pass it back on resume)."""
        return self.ds.version

    def refresh(self) -> bool:
        """Switch to the current version if it extends the one in use; True when switched."""
        newer = reopen_if_extended(self.ds, self.manifest, verify=self.verify, pad_id=self.pad_id)
        switched = newer is not self.ds
        self.ds = newer
        return switched

    def sampler(self, start_step: int = 0) -> BatchSampler:
        """This rank's batches of the version in use, from ``start_step`` on."""
        return BatchSampler(
            len(self.ds), self.global_batch_size, self.rank, self.world_size, start_step
        )
