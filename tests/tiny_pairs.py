"""Tiny random token datasets for tests: one home for the ``.bin``/``.idx`` pairs (and their
manifests) that the blend, version, index-cache, concurrency, hostile-config and S3 tests build."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter


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
