"""Per-dataset manifests (``manifests/<name>.manifest.json`` beside the pair ``<name>.{bin,idx}``):
written last, the only thing that says "done".

A manifest records the format version, the artifact's kind, its inputs (with content hashes), its
config, counts, and its files' sizes and sha256. It lives in a sidecar folder so that Megatron's
and nanotron's folder scans (``tools/merge_datasets.py``) see only pairs.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from tokenmill.atomic import file_sha256, load_json, write_json
from tokenmill.errors import FormatError
from tokenmill.formats.indexed import IndexedDataset, data_file_path, index_file_path
from tokenmill.formats.virtual_merge import (
    VirtualDataset,
    check_manifest,
    is_count,
    is_digest,
    is_virtual,
    shard_problems,
)

FORMAT_VERSION = 1
DATASET_MANIFESTS = "manifests"  # the pairs' manifests' sidecar folder (storage.layout)
DATASET_MANIFEST_SUFFIX = ".manifest.json"


def dataset_manifest_path(prefix: str | os.PathLike[str]) -> Path:
    """``<dir>/manifests/<name>.manifest.json``, the manifest of the pair ``<dir>/<name>``
    (``.is_file()`` answers "is the pair done?")."""
    prefix = Path(prefix)
    return prefix.parent / DATASET_MANIFESTS / f"{prefix.name}{DATASET_MANIFEST_SUFFIX}"


def prefix_of_manifest(path: str | os.PathLike[str]) -> Path:
    """The pair prefix a dataset manifest path belongs to; ValueError for a path that is not a
    ``manifests/*.manifest.json``."""
    path = Path(path)
    if not path.name.endswith(DATASET_MANIFEST_SUFFIX):
        raise ValueError(f"{path}: not a dataset manifest (*{DATASET_MANIFEST_SUFFIX})")
    if path.parent.name != DATASET_MANIFESTS:
        raise ValueError(
            f"{path}: a dataset manifest lives in a {DATASET_MANIFESTS}/ folder beside its pair "
            "(one beside the pair is tokenmill 0.1.0's layout: run tokenmill migrate ROOT)"
        )
    return path.parent.parent / path.name[: -len(DATASET_MANIFEST_SUFFIX)]


def describe_files(paths: list[Path], *, root: Path) -> dict[str, dict[str, Any]]:
    """``{relative name: {bytes, sha256}}`` for files, names relative to ``root``."""
    return {
        str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in paths
    }


BLOCK_BYTES = 8 << 20  # the block size of the per-block sha256 lists of .bin and .idx
HASH_THREADS = min(4, os.cpu_count() or 1)


def block_sha256(path: str | os.PathLike[str], block_bytes: int = BLOCK_BYTES) -> list[str]:
    """The sha256 of each ``block_bytes`` block of a file (the last possibly short), what a
    streaming reader checks blocks against; hashed in threads (hashlib releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor  # writers only: readers skip the import

    count = -(-os.path.getsize(path) // block_bytes)
    with open(path, "rb") as fh:

        def one(i: int) -> str:
            return hashlib.sha256(os.pread(fh.fileno(), block_bytes, i * block_bytes)).hexdigest()

        with ThreadPoolExecutor(min(HASH_THREADS, max(1, count))) as pool:
            return list(pool.map(one, range(count)))


def input_files(path: Path) -> list[Path]:
    """An input's files: itself, or a folder's (an HF dataset) in name order."""
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def input_sha256(path: str | os.PathLike[str]) -> str:
    """Content hash of an input: a file's sha256; for a folder (an HF dataset), the sha256 of
    its files' relative names and sha256s, one per line in name order."""
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path)
    lines = [f"{p.relative_to(path).as_posix()}\0{file_sha256(p)}\n" for p in input_files(path)]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def write_dataset_manifest(
    prefix: str | os.PathLike[str],
    *,
    kind: str,
    inputs: list[dict[str, Any]],
    config: dict[str, Any],
    counts: dict[str, int],
    bin_parts: list[dict[str, Any]] | None = None,
    digests: dict[str, dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Hash the pair's files and write the manifest atomically (call after the pair is final).

    Taken instead of re-reading the files (sizes checked): ``digests`` (e.g.
    ``IndexedDatasetWriter.file_digests``), or ``bin_parts`` (``[{bytes, sha256}, ...]`` of
    consecutive ranges of the ``.bin``, e.g. a merge's inputs: merging runs at copy speed).
    ``extra``: further fields (a merge's ``shards`` and ``extends``).
    """
    prefix = Path(prefix)
    pair = (data_file_path(prefix), index_file_path(prefix))
    if digests is not None:
        files = {}
        for path, key in zip(pair, ("bin", "idx"), strict=True):
            size = path.stat().st_size
            if size != int(digests[key]["bytes"]):
                raise FormatError(path, "size", f"{size} bytes, the writer recorded {digests[key]}")
            files[path.name] = {"bytes": size, "sha256": str(digests[key]["sha256"])}
    elif bin_parts is None:
        files = describe_files(list(pair), root=prefix.parent)
    else:
        files = describe_files([pair[1]], root=prefix.parent)
        total, size = sum(int(p["bytes"]) for p in bin_parts), pair[0].stat().st_size
        if total != size:
            raise FormatError(pair[0], "size", f"{size} bytes, its parts add up to {total}")
        files[pair[0].name] = {
            "bytes": size,
            "parts": bin_parts,
            "sha256_of_parts": parts_sha256(bin_parts),
        }
    for path in pair:
        entry = files[path.name]  # a post-pass: streaming and pull check blocks by these
        entry["block_bytes"] = BLOCK_BYTES
        entry["block_sha256"] = block_sha256(path, BLOCK_BYTES)
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "prefix": prefix.name,
        "inputs": inputs,
        "config": config,
        "counts": counts,
        "files": files,
        "content_hash": _content_hash(files),
        **(extra or {}),
    }
    sidecar = dataset_manifest_path(prefix)
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    write_json(sidecar, manifest)
    return manifest


def parts_sha256(parts: list[dict[str, Any]]) -> str:
    """``sha256_of_parts`` of a file recorded by parts: sha256 over their sha256s, in order."""
    return hashlib.sha256("".join(str(p["sha256"]) for p in parts).encode()).hexdigest()


def digest_problem(path: Path, info: dict[str, Any], source: str = "the manifest") -> str | None:
    """Why a file differs from ``source`` (None if not): its ``sha256``, else each recorded
    ``parts`` range (``sha256`` first, as the content hash)."""
    if "sha256" in info or "parts" not in info:
        return None if file_sha256(path) == info.get("sha256") else f"sha256 differs from {source}"
    offset = 0
    for i, part in enumerate(info["parts"]):
        if file_sha256(path, offset, int(part["bytes"])) != part["sha256"]:
            return f"sha256 of part {i} (bytes {offset}..) differs from {source}"
        offset += int(part["bytes"])
    return None


def _content_hash(files: dict[str, dict[str, Any]]) -> str:
    """One hash for the pair: sha256 over the sorted (name suffix, sha256) entries (a file
    hashed by parts enters with its ``sha256_of_parts``)."""
    h = hashlib.sha256()
    for name in sorted(files, key=lambda n: Path(n).suffix):
        info = files[name]
        digest = str(info["sha256"] if "sha256" in info else info["sha256_of_parts"])
        h.update(Path(name).suffix.encode() + b"\0" + digest.encode() + b"\0")
    return h.hexdigest()


def read_dataset_manifest(prefix: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and sanity-check a dataset manifest; FormatError if missing or malformed."""
    path = dataset_manifest_path(prefix)
    if not path.is_file():
        raise FormatError(path, "manifest", "missing: the dataset was never completed")
    manifest = load_json(path.read_bytes(), path, "manifest")
    virtual = isinstance(manifest, dict) and is_virtual(manifest)  # its own versions
    if not isinstance(manifest, dict) or (
        not virtual and manifest.get("format_version") != FORMAT_VERSION
    ):
        found = manifest.get("format_version") if isinstance(manifest, dict) else manifest
        raise FormatError(path, "format_version", f"found {found!r}, expected {FORMAT_VERSION}")
    for key in ("files", "counts", "content_hash"):
        if key not in manifest:
            raise FormatError(path, key, "missing from the manifest")
    if virtual:
        check_manifest(path, manifest)
    else:
        _check_schema(path, Path(prefix).name, manifest)
    return manifest


def open_dataset(
    prefix: str | os.PathLike[str],
    *,
    index_only: bool = False,
    recorded: dict[str, Any] | None = None,
) -> IndexedDataset | VirtualDataset:
    """The dataset at ``prefix``: a ``.bin``/``.idx`` pair or a virtual merge, with one reading
    surface; a pair whose manifest records its token count opens in O(1).

    ``recorded``: a checked record of the pair's ``num_sequences``, ``num_tokens`` and ``dtype``
    (a blend's dataset entry), opened from without parsing its own manifest (megabytes of block
    hashes) and checked against its header; or a virtual merge's checked manifest."""
    if recorded is not None and is_virtual(recorded) and not index_file_path(prefix).is_file():
        path = dataset_manifest_path(prefix)
        return VirtualDataset(prefix, recorded, path, index_only=index_only)
    counted = ("num_tokens", "num_sequences")
    if recorded and "dtype" in recorded and all(is_count(recorded.get(k)) for k in counted):
        data = IndexedDataset(prefix, index_only=index_only, num_tokens=recorded["num_tokens"])
        if len(data) != recorded["num_sequences"] or data.dtype.name != recorded["dtype"]:
            raise FormatError(
                data.idx_path,
                "header",
                f"{len(data)} {data.dtype} sequences, the manifest records "
                f"{recorded['num_sequences']} {recorded.get('dtype')}: the dataset changed after "
                "the manifest was written",
            )
        return data
    path = dataset_manifest_path(prefix)
    if not path.is_file():
        return IndexedDataset(prefix, index_only=index_only)
    manifest = read_dataset_manifest(prefix)
    if is_virtual(manifest) and not index_file_path(prefix).is_file():
        return VirtualDataset(prefix, manifest, path, index_only=index_only)
    tokens = manifest["counts"].get("tokens")  # recorded: an O(1) open
    return IndexedDataset(
        prefix, index_only=index_only, num_tokens=tokens if is_count(tokens) else None
    )


def _check_schema(path: Path, name: str, manifest: dict[str, Any]) -> None:
    """FormatError for fields of the wrong shape, or ``files`` naming anything but the pair
    beside the manifest (a tampered manifest must not make readers look elsewhere)."""
    for key, kind, expected in (("counts", dict, "a mapping"), ("content_hash", str, "a string")):
        if not isinstance(manifest[key], kind):
            raise FormatError(path, key, f"expected {expected}, found {manifest[key]!r}")
    files = manifest["files"]
    pair = sorted(f"{name}{suffix}" for suffix in (".bin", ".idx"))
    if not isinstance(files, dict) or sorted(files) != pair:
        shown = sorted(files) if isinstance(files, dict) else files
        raise FormatError(path, "files", f"expected entries for {pair}, found {shown!r}")
    for file_name, info in files.items():
        parts = info.get("parts") if isinstance(info, dict) else None
        by_parts = (
            isinstance(parts, list)
            and all(is_digest(part) for part in parts)
            and type(info.get("bytes")) is int
            and isinstance(info.get("sha256_of_parts"), str)
        )
        if not (is_digest(info) or by_parts):
            raise FormatError(
                path, f"files.{file_name}", f"expected {{bytes, sha256}} or parts, found {info!r}"
            )


def check_dataset_files(prefix: str | os.PathLike[str], *, full: bool = False) -> list[str]:
    """Problems between a dataset's manifest and its files: sizes always, sha256 when ``full``."""
    return file_problems(Path(prefix), read_dataset_manifest(prefix), full=full)


def file_problems(prefix: Path, manifest: dict[str, Any], *, full: bool) -> list[str]:
    """Problems between an already loaded dataset manifest and the files beside ``prefix``
    (for a virtual merge: its shards' pairs)."""
    if is_virtual(manifest):
        return shard_problems(prefix.parent, manifest, full=full)
    problems = []
    for name, info in manifest["files"].items():
        p = prefix.parent / name
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        size = p.stat().st_size
        if size != info["bytes"]:
            problems.append(f"{p}: {size} bytes, manifest says {info['bytes']}")
        elif full and (msg := digest_problem(p, info)):
            problems.append(f"{p}: {msg}")
    return problems


def bin_parts(prefix: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ``.bin`` of a dataset as ``[{bytes, sha256}, ...]`` parts: taken from its manifest
    when the recorded size matches (no re-read), else hashed now. Merges chain these."""
    prefix = Path(prefix)
    path = data_file_path(prefix)
    size = path.stat().st_size
    if dataset_manifest_path(prefix).is_file():
        info = read_dataset_manifest(prefix)["files"].get(path.name, {})
        if info.get("bytes") == size:
            if "sha256" in info:
                return [{"bytes": size, "sha256": info["sha256"]}]
            return list(info["parts"])
    return [{"bytes": size, "sha256": file_sha256(path)}]


def dataset_content_hash(prefix: str | os.PathLike[str], *, index_only: bool = False) -> str:
    """The content hash of a ``.bin``/``.idx`` pair: from its manifest when the sizes agree,
    otherwise computed from the files (so hand-made Megatron datasets work too). With
    ``index_only`` (a step that staged the ``.idx`` and manifest, not the ``.bin``) only the
    ``.idx`` size is compared, and a dataset without a manifest is an error."""
    prefix = Path(prefix)
    if dataset_manifest_path(prefix).is_file():
        manifest = read_dataset_manifest(prefix)
        if is_virtual(manifest):
            problems = [] if index_only else file_problems(prefix, manifest, full=False)
            if problems:
                raise FormatError(prefix, "shards", "; ".join(problems))
            return str(manifest["content_hash"])
        if index_only:
            idx = index_file_path(prefix)
            recorded = manifest["files"][idx.name]["bytes"]
            if not idx.is_file() or idx.stat().st_size != recorded:
                raise FormatError(idx, "size", f"missing or not the {recorded} bytes recorded")
            return str(manifest["content_hash"])
        if not file_problems(prefix, manifest, full=False):
            return str(manifest["content_hash"])
    if index_only:
        raise FormatError(dataset_manifest_path(prefix), "manifest", "missing")
    files = describe_files([data_file_path(prefix), index_file_path(prefix)], root=prefix.parent)
    return _content_hash(files)
