"""Blend manifest layout, reader and verifier; over 400 lines: one format's parts stay together.

Numpy and stdlib only (the loader imports it). A blend lives in ``blends/<name>/``; every build
writes an immutable version, then moves the pointer::

    manifest.json                                   the current version's manifest (the pointer),
                                                    written last (temp -> fsync -> rename)
    versions/<version16>/manifest.json              one version, never rewritten
    versions/<version16>/<split>-dataset_index.npy            which dataset each sample is from
    versions/<version16>/<split>-dataset_sample_index.npy     which sample of that Nanoset

Every path inside a manifest is relative to its own folder, so a copy with the same relative
layout opens elsewhere. Each file entry is ``{"path", "bytes", "sha256"}`` (a merged ``.bin`` by
parts: ``{"path", "bytes", "parts", "sha256_of_parts"}``). Both manifests carry ``"version"`` (the
content hash of everything the samples depend on) and ``"manifest_sha256"`` (sha256 of the
canonical JSON without that field), checked on every read. The writer (and schema) is
``tokenmill.indices.blend_build.build_blend``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import file_sha256, json_sha256, load_json
from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats.dataset_manifest import (
    dataset_manifest_path,
    digest_problem,
    parts_sha256,
    read_dataset_manifest,
)
from tokenmill.formats.nanoset_cache import SegmentedArray, segment_keys
from tokenmill.formats.virtual_merge import shard_problems
from tokenmill.paths import VERSION_CHARS, has_control_character, is_lower_hex, leading_parents

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2  # 2: versioned blends (version, manifest_sha256, versions/<v>/ layout)
VERSIONS_DIR = "versions"
SELF_HASH = "manifest_sha256"
KIND = "blend"
SPLITS = ("train", "valid", "test")
BLEND_ARRAYS = ("dataset_index", "dataset_sample_index")
INDEX_ARRAYS = ("document", "sample", "shuffle")


def blend_array_name(split: str, array: str) -> str:
    """File name of a blend array inside the blend directory, e.g. ``train-dataset_index.npy``."""
    return f"{split}-{array}.npy"


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of a manifest's canonical JSON (sorted keys, compact) without its own hash."""
    return json_sha256({k: v for k, v in manifest.items() if k != SELF_HASH})


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` carrying its own hash (``manifest_sha256``)."""
    body = {k: v for k, v in manifest.items() if k != SELF_HASH}
    return {**body, SELF_HASH: manifest_digest(body)}


def versions_root(mpath: Path) -> Path:
    """The blend folder holding ``versions/`` for a pointer or a version manifest path."""
    folder = mpath.parent
    if folder.parent.name == VERSIONS_DIR and len(folder.name) == VERSION_CHARS:
        return folder.parent.parent
    return folder


def available_versions(mpath: Path) -> list[str]:
    """The version folders (16 hex digits) with a manifest beside a blend manifest, sorted."""
    folder = versions_root(mpath) / VERSIONS_DIR  # a missing folder globs nothing
    return sorted(p.parent.name for p in folder.glob(f"*/{MANIFEST_NAME}"))


def version_manifest_path(mpath: Path, version: str) -> Path:
    """``versions/<v16>/manifest.json`` beside the pointer ``mpath`` for a full version hash or
    its 16-digit prefix; ConfigError listing the available versions when it is not there."""
    if not isinstance(version, str) or len(version) < VERSION_CHARS or not is_lower_hex(version):
        raise ConfigError(
            f"version {version!r}: expected the blend version (>= {VERSION_CHARS} lowercase hex "
            "digits, as recorded in ds.version or the manifest's 'version')"
        )
    path = versions_root(mpath) / VERSIONS_DIR / version[:VERSION_CHARS] / MANIFEST_NAME
    if not path.is_file():
        found = available_versions(mpath)
        raise ConfigError(
            f"{mpath}: blend version {version} is not there (removed by `tokenmill gc`, or "
            f"never built here); available: {', '.join(found) or 'none'}"
        )
    return path


def manifest_path(path: str | os.PathLike[str]) -> Path:
    """The manifest file for a blend directory or a manifest path."""
    p = Path(path)
    return p / MANIFEST_NAME if p.is_dir() else p


def resolve(manifest: str | os.PathLike[str], relative: object) -> Path:
    """A path recorded in the manifest, resolved against the manifest's directory. Only what the
    builder writes is accepted (relative, ``..`` only leading and never above ``/``, no control
    characters): anything else is a FormatError, so a tampered manifest cannot name any file."""
    mpath = Path(manifest)
    problem = None
    if not isinstance(relative, str) or not relative:
        problem = "is not a relative path"
    elif has_control_character(relative):
        problem = "contains a control character"
    elif os.path.isabs(relative):
        problem = "is absolute; manifest paths are relative to the manifest's folder"
    else:
        leading = leading_parents(relative)
        if leading is None:
            problem = "has '..' after a folder name"
        elif leading >= len(Path(os.path.abspath(mpath.parent)).parts):
            problem = "climbs above the filesystem root"
    if problem or not isinstance(relative, str):
        raise FormatError(mpath, "path", f"{relative!r} {problem}; rebuild the blend")
    return Path(os.path.normpath(mpath.parent / relative))


def read_blend_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a blend manifest; FormatError when it is missing, malformed or of another version."""
    mpath = manifest_path(path)
    if not mpath.is_file():
        raise FormatError(
            mpath,
            "manifest",
            "missing: the blend was never completed "
            "(or is being rebuilt); build it with `tokenmill blend`",
        )
    return parse_blend_manifest(mpath.read_bytes(), mpath)


def parse_blend_manifest(raw: bytes, mpath: object) -> dict[str, Any]:
    """``read_blend_manifest`` of bytes already read (e.g. from S3); errors name ``mpath``."""
    manifest = load_json(raw, mpath, "manifest")
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise FormatError(mpath, "kind", f"expected {KIND!r}: this is not a blend manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise FormatError(
            mpath,
            "format_version",
            f"found {manifest.get('format_version')!r}, "
            f"expected {FORMAT_VERSION}; rebuild the blend",
        )
    recorded = manifest.get(SELF_HASH)
    if recorded != manifest_digest(manifest):
        raise FormatError(
            mpath,
            SELF_HASH,
            f"{recorded!r:.80} is not the hash of the manifest's content: it was edited or "
            "damaged after it was written; rebuild the blend (or pull it again)",
        )
    keys = ("name", "version", "datasets", "splits", "sequence_length", "add_extra_token")
    for key in (*keys, "semantics"):
        if key not in manifest:
            raise FormatError(mpath, key, "missing from the blend manifest")
    flag = manifest.get("drop_last_partial_validation", True)
    if not isinstance(flag, bool):
        raise FormatError(
            mpath, "drop_last_partial_validation", f"expected true or false: {flag!r}"
        )
    for key, kind in (("datasets", list), ("splits", dict)):
        if not isinstance(manifest[key], kind):
            raise FormatError(mpath, key, f"expected a {kind.__name__}, found {manifest[key]!r}")
    return manifest


@contextlib.contextmanager
def schema_errors(mpath: Path) -> Iterator[None]:
    """Turn a missing key or wrong type deep inside a manifest into a FormatError."""
    try:
        yield
    except (KeyError, TypeError, AttributeError) as exc:
        raise FormatError(
            mpath, "manifest", f"malformed ({exc!r}); rebuild the blend with `tokenmill blend`"
        ) from exc


def load_index_array(path: str | os.PathLike[str], *, ndim: int, what: str) -> np.ndarray:
    """Memory-map an integer ``.npy`` (never unpickles); FormatError names what to rebuild."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise FormatError(path, what, f"unreadable .npy ({exc}); rebuild it") from exc
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu" or arr.ndim != ndim:
        raise FormatError(
            path,
            what,
            f"expected a {ndim}-D integer array, found "
            f"{getattr(arr, 'ndim', '?')}-D {getattr(arr, 'dtype', type(arr))}; "
            "rebuild it",
        )
    return np.asarray(arr)


def index_part_paths(ds: dict[str, Any], mpath: Path) -> list[list[Path]]:
    """The files of a blend dataset entry's three index arrays, each in part order."""
    return blend_part_paths(ds["index"], mpath, INDEX_ARRAYS)


def blend_part_paths(
    info: dict[str, Any], mpath: Path, arrays: tuple[str, ...] = BLEND_ARRAYS
) -> list[list[Path]]:
    """The files of a split's two blend arrays (or of ``arrays``), each in part order: a growing
    version records its predecessor's parts as ``<array>.<i>`` first."""
    files = info["files"]
    return [
        [resolve(mpath, files[key]["path"]) for key in segment_keys(files, array)]
        for array in arrays
    ]


def load_blend_arrays(info: dict[str, Any], mpath: Path) -> list[np.ndarray]:
    """A split's two blend arrays as plain arrays (parts concatenated): for whole-array use."""
    return [
        np.asarray(load_index_parts(parts, ndim=1, what=array))
        for array, parts in zip(BLEND_ARRAYS, blend_part_paths(info, mpath), strict=True)
    ]


def load_index_parts(paths: list[Path], *, ndim: int, what: str) -> Any:
    """:func:`load_index_array` of one file, or a SegmentedArray over several parts."""
    parts = [load_index_array(p, ndim=ndim, what=what) for p in paths]
    if len(parts) == 1:
        return parts[0]
    try:
        return SegmentedArray(parts)
    except CacheError as exc:
        raise FormatError(paths[-1], what, f"{exc}; rebuild it") from exc


def check_file(path: Path, entry: dict[str, Any], *, hash_it: bool) -> str | None:
    """Why ``path`` does not match its recorded ``{bytes, sha256}`` or ``{bytes, parts,
    sha256_of_parts}`` (size, then with ``hash_it`` the hash of the file or of each part)."""
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size
    if size != entry.get("bytes"):
        return f"{path}: {size} bytes, recorded {entry.get('bytes')!r}"
    if not hash_it:
        return None
    if "parts" not in entry:
        ok = file_sha256(path) == entry.get("sha256")
        return None if ok else f"{path}: sha256 differs from the recorded one"
    if parts_sha256(entry["parts"]) != entry.get("sha256_of_parts"):
        return f"{path}: sha256_of_parts is not the hash of the recorded parts"
    problem = digest_problem(path, {"parts": entry["parts"]}, "the recorded one")
    return None if problem is None else f"{path}: {problem}"


def drop_last_partial(manifest: dict[str, Any], split: str) -> bool:
    """The effective drop-last flag of a split: the manifest's ``drop_last_partial_validation``
    (true when absent) for valid; train and test always drop."""
    flag = manifest.get("drop_last_partial_validation", True)
    return split != "valid" or flag


def skipped_problems(manifest: dict[str, Any], split: str) -> list[str]:
    """What is wrong with a split's ``skipped`` list (optional: ``[{name, reason}]`` naming
    datasets of the blend that the split does not blend)."""
    skipped = manifest["splits"][split].get("skipped", [])
    if not isinstance(skipped, list):
        return [f"split {split!r} skipped: expected a list, found {skipped!r:.80}"]
    names = {ds["name"] for ds in manifest["datasets"]}
    blended = {ds["name"] for ds in manifest["splits"][split]["datasets"]}
    problems = []
    for entry in skipped:
        ok = isinstance(entry, dict) and set(entry) == {"name", "reason"}
        if not ok or not all(isinstance(v, str) for v in entry.values()):
            problems.append(f"split {split!r} skipped: malformed entry {entry!r:.80}")
        elif entry["name"] not in names or entry["name"] in blended:
            problems.append(
                f"split {split!r} skipped: {entry['name']!r} is not a dataset of the blend "
                "left out of this split"
            )
    return problems


def split_problems(
    manifest: dict[str, Any], mpath: Path, split: str, *, full: bool = False
) -> list[str]:
    """Mismatches between one split's files (blend arrays, index caches) and the manifest:
    sizes and the index descriptions' records (small JSON files); ``full`` also hashes."""
    info = manifest["splits"][split]
    problems = skipped_problems(manifest, split)
    for array, entry in info["files"].items():
        why = check_file(resolve(mpath, entry["path"]), entry, hash_it=full)
        if why:
            problems.append(f"split {split!r} blend array {array}: {why}")
    for ds in info["datasets"]:
        failed = set()
        for kind, entry in ds["index"]["files"].items():
            why = check_file(resolve(mpath, entry["path"]), entry, hash_it=full)
            if why:
                failed.add(kind)
                problems.append(
                    f"split {split!r} dataset {ds['name']!r} index cache "
                    f"{ds['index']['cache_hash']} ({kind}): {why}"
                )
        if "description" not in failed:
            problems += _key_problems(manifest, mpath, split, ds)
    return problems


def _key_problems(
    manifest: dict[str, Any], mpath: Path, split: str, ds: dict[str, Any]
) -> list[str]:
    """Sample settings and array records (size, sha256) of the manifest that its index
    description contradicts, so an edited manifest cannot change samples (no array is read)."""
    path = resolve(mpath, ds["index"]["files"]["description"]["path"])
    try:
        description = load_json(path.read_bytes(), path, "description")
        key, records = description["key"], description["files"]
    except (OSError, FormatError, KeyError, TypeError) as exc:
        return [f"{path}: unreadable index description ({exc!r})"]
    wanted = {
        "sequence_length": manifest["sequence_length"],
        "add_extra_token": manifest["add_extra_token"],
        "drop_last_partial": drop_last_partial(manifest, split),
        "split": split,
    }
    problems = [
        f"split {split!r} dataset {ds['name']!r}: the manifest says {setting} {value!r}, its "
        f"index {path.name} was built with {key.get(setting)!r}"
        for setting, value in wanted.items()
        if key.get(setting) != value or type(key.get(setting)) is not type(value)
    ]
    kinds = [k for kind in INDEX_ARRAYS for k in segment_keys(ds["index"]["files"], kind)]
    if kinds != [k for kind in INDEX_ARRAYS for k in segment_keys(records, kind)]:
        problems.append(
            f"split {split!r} dataset {ds['name']!r}: the manifest's index parts {kinds} are "
            f"not those of its description {path.name}"
        )
        return problems
    for kind in kinds:
        entry, record = ds["index"]["files"][kind], records.get(kind) or {}
        if (entry.get("bytes"), entry.get("sha256")) != (record.get("bytes"), record.get("sha256")):
            problems.append(
                f"split {split!r} dataset {ds['name']!r} index cache ({kind}): the manifest "
                f"records {entry.get('bytes')!r} bytes / sha256 {entry.get('sha256')!r:.20}, "
                f"its description {path.name} {record.get('bytes')!r} / "
                f"{record.get('sha256')!r:.20}"
            )
    return problems


def dataset_problems(
    manifest: dict[str, Any],
    mpath: Path,
    names: set[str],
    *,
    full: bool,
    merges: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    """Mismatches of the datasets' ``.idx``/``.bin`` files: sizes; ``full`` also the sha256 of
    the ``.idx`` and of the ``.bin`` (or of each recorded part of a merged ``.bin``). ``merges``
    receives each virtual merge's manifest as checked, by dataset name (read once)."""
    problems = []
    unknown = names - {ds["name"] for ds in manifest["datasets"]}
    if unknown:
        raise FormatError(mpath, "datasets", f"no entry for {sorted(unknown)} named by a split")
    for ds in manifest["datasets"]:
        if ds["name"] in names:
            problems += _dataset_problems(mpath, ds, full, merges)
    return problems


def _dataset_problems(
    mpath: Path, ds: dict[str, Any], full: bool, merges: dict[str, dict[str, Any]] | None
) -> list[str]:
    """One dataset's mismatches: its ``.bin`` and ``.idx``; for a virtual merge, its manifest
    (small: always hashed) and every shard pair it names."""
    prefix = resolve(mpath, ds["prefix"])
    if "manifest" not in ds["files"]:
        found = {kind: _file_problem(mpath, ds, kind, prefix, full) for kind in ("bin", "idx")}
        return [
            f"dataset {ds['name']!r} {kind}: {why} (the dataset changed after the blend was built)"
            for kind, why in found.items()
            if why
        ]
    why = _file_problem(mpath, ds, "manifest", prefix, True)
    if why:
        return [f"dataset {ds['name']!r} manifest: {why} (the merge changed after the blend)"]
    manifest = read_dataset_manifest(prefix)
    if merges is not None:
        merges[ds["name"]] = manifest
    return [
        f"dataset {ds['name']!r}: {why}"
        for why in shard_problems(prefix.parent, manifest, full=full)
    ]


def _file_problem(
    mpath: Path, ds: dict[str, Any], kind: str, prefix: Path, hash_it: bool
) -> str | None:
    """:func:`check_file` of the dataset's recorded ``kind`` file, which must be that of its
    ``prefix`` (FormatError otherwise: an edited manifest must not vouch for other data)."""
    entry = ds["files"][kind]
    path = resolve(mpath, entry["path"])
    wanted = dataset_manifest_path(prefix) if kind == "manifest" else Path(f"{prefix}.{kind}")
    if path != wanted:
        raise FormatError(
            mpath,
            f"datasets.{ds['name']}.files.{kind}",
            f"{path} is not the {kind} file of the dataset's prefix {prefix}; rebuild the blend",
        )
    return check_file(path, entry, hash_it=hash_it)


def verify_manifest(
    path: str | os.PathLike[str],
    splits: list[str] | None = None,
    *,
    full: bool = False,
    at: str | os.PathLike[str] | None = None,
    merges: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    """Problems of a blend (empty list = consistent) for ``splits`` (default: all of them).

    Always (O(1) in the indices' size): schema, own hash, every file's size, the index
    descriptions' settings and records; ``full``: every file's sha256 too. ``at``: the path
    recorded paths resolve against, when ``path`` is a temp elsewhere. ``merges``: as in
    ``dataset_problems``.
    """
    manifest = read_blend_manifest(path)
    mpath = manifest_path(path) if at is None else Path(at)
    chosen = list(manifest["splits"]) if splits is None else splits
    problems: list[str] = []
    names: set[str] = set()
    with schema_errors(mpath):
        for split in chosen:
            problems += split_problems(manifest, mpath, split, full=full)
            names |= {ds["name"] for ds in manifest["splits"][split]["datasets"]}
        return dataset_problems(manifest, mpath, names, full=full, merges=merges) + problems


def rebuild_hint(manifest: dict[str, Any], mpath: Path) -> str:
    """What to run to rebuild a stale or partial blend."""
    return (
        f"rebuild blend {manifest.get('name', mpath.parent.name)!r}: "
        f"`tokenmill blend --output {mpath.parent} ...` with the same settings, or "
        f"materialize the Dagster asset blend/{manifest.get('name', mpath.parent.name)}"
    )
