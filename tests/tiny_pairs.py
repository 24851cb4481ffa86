"""Random ``.bin``/``.idx`` pairs for the blend and version tests (one copy of the helper)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenmill.formats.indexed import IndexedDatasetWriter


def random_pair(prefix: Path, n_docs: int, seed: int, dtype: type = np.uint16) -> Path:
    """``n_docs`` one-sequence documents of 1-29 random tokens at ``prefix`` (no manifest)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, n_docs)
    with IndexedDatasetWriter(prefix, dtype) as writer:
        writer.add_documents(rng.integers(0, 60000, int(lengths.sum())), lengths)
    return prefix
