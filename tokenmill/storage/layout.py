"""The storage layout: every artifact's key relative to the storage root (local or ``s3://``), as
a pure string; every name part that comes from outside (dataset, shard, blend, text key,
version) is checked first, so no key can climb out of its folder.

Versioned artifacts (merged datasets and blends) live under a folder naming the version; a small
pointer names the current one and is the only thing a refresh moves::

    merged/<ds>/current.json                                  pointer: {"version", "target"}
    merged/<ds>/<version>/<ds>_<text_key>_document.{bin,idx}
    merged/<ds>/<version>/manifests/<ds>_<text_key>_document.manifest.json
    blends/<name>/manifest.json                               pointer: the current manifest
    blends/<name>/versions/<version>/manifest.json            + <split>-*.npy
    nanoset/<hash>-Nanoset-<split>-*                          content-addressed, never rewritten
    takedowns/<id>.json                                       audit records (tokenmill.takedown)

A pair's manifest lives in a ``manifests/`` folder beside the pair: Megatron's and nanotron's
``tools/merge_datasets.py`` take every file of a folder as half of a ``.bin``/``.idx`` pair.
"""

from __future__ import annotations

import posixpath
import unicodedata

from tokenmill.atomic import TEMP_NAME_EXTRA
from tokenmill.errors import ConfigError
from tokenmill.formats.dataset_manifest import DATASET_MANIFEST_SUFFIX as DATASET_MANIFEST_SUFFIX
from tokenmill.formats.dataset_manifest import DATASET_MANIFESTS as DATASET_MANIFESTS
from tokenmill.formats.takedown_records import TAKEDOWNS as TAKEDOWNS
from tokenmill.formats.takedown_records import record_key
from tokenmill.paths import VERSION_CHARS as VERSION_CHARS
from tokenmill.paths import document_stem, is_lower_hex, name_problem

POINTER_NAME = "current.json"
BLEND_MANIFEST = "manifest.json"
NAME_MAX = 255  # bytes in one file name: Linux file systems and most others


def check_name(name: str, what: str = "name") -> str:
    """``name`` if it is one safe artifact name part (``tokenmill.paths.name_problem``'s rule, and
    no ``..``, leading ``.``, control or format character), else ConfigError naming the problem."""
    if ".." in name:
        problem = "it contains '..'"
    elif (base := name_problem(name)) is not None:
        problem = f"it {base}"
    elif name.startswith("."):
        problem = "it starts with '.' (hidden and temporary files are not artifacts)"
    elif any(unicodedata.category(c) in ("Cc", "Cf") for c in name):
        problem = "it contains a control character"
    else:
        return name
    raise ConfigError(f"{what} {name!r} rejected: {problem}")


def version_dir_name(version: str) -> str:
    """The folder name of a version: the first ``VERSION_CHARS`` hex digits of its hash."""
    short = version[:VERSION_CHARS]
    if len(short) != VERSION_CHARS or not is_lower_hex(short):
        raise ConfigError(f"version {version!r} rejected: expected >= 16 lowercase hex digits")
    return short


def document_name(name: str, text_key: str) -> str:
    """``<name>_<text_key>_document`` of a checked artifact name (``paths.document_stem``)."""
    return document_stem(check_name(name), text_key)


def dataset_manifest(prefix: str) -> str:
    """``<dir>/manifests/<name>.manifest.json``: the manifest of the pair at ``<dir>/<name>``
    (a posix key or path; the sidecar folder keeps the pair's folder Megatron-scannable)."""
    head, name = posixpath.split(prefix)
    return posixpath.join(head, DATASET_MANIFESTS, name + DATASET_MANIFEST_SUFFIX)


def dataset_files(prefix: str) -> list[str]:
    """Staging inputs for a whole pair: the prefix (``.bin`` and ``.idx``) and its manifest."""
    return [prefix, dataset_manifest(prefix)]


def raw_dir(ds: str) -> str:
    """``raw/<ds>``: a dataset's raw stats and quarantine files."""
    return f"raw/{check_name(ds, 'dataset')}"


def tokens_dir(ds: str) -> str:
    """``tokens/<ds>``: a dataset's tokenized shards."""
    return f"tokens/{check_name(ds, 'dataset')}"


def _shard_file(folder: str, shard: str, suffix: str) -> str:
    """``<folder>/<shard><suffix>``: one shard's file, its name checked."""
    return f"{folder}/{check_name(shard, 'partition key')}{suffix}"


def raw_stats(ds: str, shard: str) -> str:
    """``raw/<ds>/<shard>.stats.json``: a shard's validation counts (written last)."""
    return _shard_file(raw_dir(ds), shard, ".stats.json")


def quarantine(ds: str, shard: str) -> str:
    """``raw/<ds>/<shard>.quarantine.jsonl``: a shard's bad lines with their line numbers."""
    return _shard_file(raw_dir(ds), shard, ".quarantine.jsonl")


def dochash(ds: str, shard: str) -> str:
    """``raw/<ds>/<shard>.dochash.npy``: sha256 of each document's normalized text, in order."""
    return _shard_file(raw_dir(ds), shard, ".dochash.npy")


def hf_dir(ds: str) -> str:
    """``hf/<ds>``: the HF Parquet layout of a dataset."""
    return f"hf/{check_name(ds, 'dataset')}"


def parquet(ds: str, shard: str) -> str:
    """``hf/<ds>/data/<shard>.parquet``: one shard's Parquet export."""
    return _shard_file(f"{hf_dir(ds)}/data", shard, ".parquet")


def export_record(ds: str, shard: str) -> str:
    """``hf/<ds>/shards/<shard>.json``: one shard's export record (rows, bytes, sha256, schema,
    input), from which ``dataset_info.json`` is assembled without reading any Parquet."""
    return _shard_file(f"{hf_dir(ds)}/shards", shard, ".json")


def dataset_info(ds: str) -> str:
    """``hf/<ds>/dataset_info.json``: the HF description of every current shard."""
    return f"{hf_dir(ds)}/dataset_info.json"


def shard_name_problem(file_name: str, shard: str, text_key: str) -> str | None:
    """Why a shard's files could not all be written (a derived name, or a temp of one, longer
    than NAME_MAX bytes whatever the host name), or None. Checked when the source is listed, so
    a long name is refused with the other refused names instead of failing every run."""
    shard_files = (raw_stats, quarantine, dochash, parquet, export_record)
    derived = [
        file_name,  # a downloaded S3 shard keeps its name
        *(posixpath.basename(path("d", shard)) for path in shard_files),
        posixpath.basename(dataset_manifest(tokens_prefix("d", shard, text_key))),
        document_name(shard, text_key) + ".bin",
    ]
    longest = max(len(name.encode("utf-8", "surrogateescape")) for name in derived)
    if longest + TEMP_NAME_EXTRA <= NAME_MAX:
        return None
    spare = NAME_MAX - TEMP_NAME_EXTRA - (longest - len(shard.encode("utf-8", "surrogateescape")))
    return (
        f"the name is too long: its files' names reach {longest} bytes, and with a writer's temp "
        f"suffix ({TEMP_NAME_EXTRA} bytes) pass the file-name limit of {NAME_MAX} bytes; rename "
        f"the shard to at most {max(spare, 0)} bytes before its suffix"
    )


def tokens_prefix(ds: str, shard: str, text_key: str) -> str:
    """``tokens/<ds>/<shard>_<text_key>_document``: one shard's ``.bin``/``.idx`` prefix."""
    return f"{tokens_dir(ds)}/{document_name(shard, text_key)}"


MERGED = "merged"
BLENDS = "blends"


def merged_dir(ds: str) -> str:
    """``merged/<ds>``: a dataset's merged versions and its pointer (``manifests`` is not a
    dataset name there: it is the sidecar folder of unversioned ``merged/<prefix>`` pairs)."""
    if check_name(ds, "dataset") == DATASET_MANIFESTS:
        raise ConfigError(f"dataset {ds!r} rejected: the name is reserved for manifest folders")
    return f"{MERGED}/{ds}"


def merged_pointer(ds: str) -> str:
    """``merged/<ds>/current.json``: names the current merged version."""
    return f"{merged_dir(ds)}/{POINTER_NAME}"


def merged_prefix(ds: str, text_key: str, version: str) -> str:
    """``merged/<ds>/<version>/<ds>_<text_key>_document``: one immutable merged version."""
    return f"{merged_dir(ds)}/{version_dir_name(version)}/{document_name(ds, text_key)}"


def nanoset_dir() -> str:
    """``nanoset``: the content-addressed index cache shared by datasets and blends."""
    return "nanoset"


def blend_dir(name: str) -> str:
    """``blends/<name>``: a blend's pointer manifest and its versions."""
    return f"{BLENDS}/{check_name(name, 'blend')}"


def blend_manifest(name: str) -> str:
    """``blends/<name>/manifest.json``: the current version's manifest (the pointer)."""
    return f"{blend_dir(name)}/{BLEND_MANIFEST}"


def blend_version_dir(name: str, version: str) -> str:
    """``blends/<name>/versions/<version>``: one immutable blend version."""
    return f"{blend_dir(name)}/versions/{version_dir_name(version)}"


def takedown_record(record_id: str) -> str:
    """``takedowns/<id>.json``: one takedown's audit record (``tokenmill.takedown``)."""
    return record_key(record_id)
