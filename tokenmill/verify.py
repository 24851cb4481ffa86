"""Consistency checks of a ``.bin``/``.idx`` dataset and, when present, its manifest."""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill.errors import FormatError
from tokenmill.formats.indexed import IndexedDataset
from tokenmill.manifest import dataset_manifest_path, file_problems, read_dataset_manifest


def verify_dataset(prefix: str | os.PathLike[str], *, full: bool = True) -> list[str]:
    """Every problem found (empty list = consistent).

    Checks the header, counts and file sizes (on open), the pointers against the lengths, and —
    if a manifest exists — its recorded counts, sizes and (``full``) sha256 of both files.
    """
    prefix = Path(prefix)
    problems: list[str] = []
    try:
        with IndexedDataset(prefix) as ds:
            ds.check_pointers()
            counts = {"documents": ds.num_documents, "sequences": len(ds), "tokens": ds.num_tokens}
    except FormatError as exc:
        return [str(exc)]
    if not dataset_manifest_path(prefix).is_file():
        return problems
    try:
        manifest = read_dataset_manifest(prefix)
    except FormatError as exc:
        return [str(exc)]
    problems += file_problems(prefix, manifest, full=full)
    for key, value in counts.items():
        recorded = manifest["counts"].get(key)
        if recorded is not None and recorded != value:
            problems.append(
                f"{dataset_manifest_path(prefix)}: counts.{key} is {recorded}, files have {value}"
            )
    return problems
