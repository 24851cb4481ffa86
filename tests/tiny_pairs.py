"""Tiny random token datasets for tests: one home for the ``.bin``/``.idx`` pairs (and their
manifests) that the blend, version, index-cache, concurrency, hostile-config and S3 tests build,
and the settings value those tests build blends with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.indices.nanoset import NanosetIndex, build_or_load
from tokenmill.indices.settings import BlendSettings, NanosetSettings


def blend_values(**fields: Any) -> BlendSettings:
    """The ``BlendSettings`` of ``weights``/``temperature`` and ``NanosetSettings`` fields given
    flat (tests vary one field of a dict of defaults)."""
    weighting = {k: fields.pop(k) for k in ("weights", "temperature") if k in fields}
    return BlendSettings(NanosetSettings(**fields), **weighting)


def index_of(prefix: str | Path, cache_dir: str | Path, **fields: Any) -> NanosetIndex | None:
    """``build_or_load`` of ``split``, ``num_samples`` (default None) and ``NanosetSettings``
    fields given flat (plain values: they cross processes, and tests vary one of them)."""
    split, num_samples = fields.pop("split"), fields.pop("num_samples", None)
    return build_or_load(prefix, cache_dir, split, NanosetSettings(**fields), num_samples)


def random_pair(
    prefix: Path,
    n_docs: int,
    seed: int,
    dtype: type = np.uint16,
    *,
    lengths: tuple[int, int] = (1, 30),
    vocab: int = 60000,
) -> Path:
    """``n_docs`` one-sequence documents of ``lengths[0]`` to ``lengths[1] - 1`` random tokens
    below ``vocab`` at ``prefix`` (no manifest); the same ``seed`` gives the same bytes."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(*lengths, size=n_docs)
    with IndexedDatasetWriter(prefix, dtype) as writer:
        writer.add_documents(rng.integers(0, vocab, size=int(sizes.sum())), sizes)
    return prefix


def random_dataset(
    prefix: Path,
    n_docs: int,
    seed: int,
    dtype: type = np.uint16,
    *,
    kind: str = "merged",
    lengths: tuple[int, int] = (1, 30),
    vocab: int = 60000,
    counted: bool = False,
) -> Path:
    """``random_pair`` plus the dataset manifest a ``kind`` run leaves (``counted``: with its
    document, sequence and token counts and file digests, as tokenize writes them)."""
    random_pair(prefix, n_docs, seed, dtype, lengths=lengths, vocab=vocab)
    counts: dict[str, int] = {}
    if counted:
        tokens = int(np.fromfile(f"{prefix}.bin", dtype=dtype).size)
        counts = {"documents": n_docs, "sequences": n_docs, "tokens": tokens}
    write_dataset_manifest(prefix, kind=kind, inputs=[], config={}, counts=counts)
    return prefix
