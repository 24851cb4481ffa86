"""Tiny random token datasets for tests: one home for the ``.bin``/``.idx`` pairs (and their
manifests) that the blend, version, index-cache, concurrency, hostile-config and S3 tests build,
and the settings value those tests build blends with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.nanoset import NanosetIndex, build_or_load
from tokenmill.indices.settings import BlendSettings, NanosetSettings


def blend_values(**fields: Any) -> BlendSettings:
    """The ``BlendSettings`` of ``weights``/``temperature`` and ``NanosetSettings`` fields given
    flat (tests vary one field of a dict of defaults)."""
    weighting = {k: fields.pop(k) for k in ("weights", "temperature") if k in fields}
    return BlendSettings(NanosetSettings(**fields), **weighting)


# The blend ``mix`` the blend-manifest and version tests build (with their sequence length).
MIX: dict[str, Any] = {
    "weights": {"docs": 0.7, "code": 0.3},
    "split_spec": "80,10,10",
    "seed": 5,
    "train_samples": 51,
}


def build_blend_at(root: Path, name: str, datasets: dict[str, Path], **fields: Any) -> dict:
    """``build_blend`` of blend ``name`` over ``datasets`` into ``root/blends/<name>``, its index
    cache in ``root/nanoset``, the settings given flat (``blend_values``); the manifest."""
    out = root / "blends" / name
    return build_blend(name, datasets, out, root / "nanoset", blend_values(**fields))


def index_of(prefix: str | Path, cache_dir: str | Path, **fields: Any) -> NanosetIndex | None:
    """``build_or_load`` of ``split``, ``num_samples`` (default None) and ``NanosetSettings``
    fields given flat (plain values: they cross processes, and tests vary one of them)."""
    split, num_samples = fields.pop("split"), fields.pop("num_samples", None)
    return build_or_load(prefix, cache_dir, split, NanosetSettings(**fields), num_samples)


def split_fields(split: str, semantics: str, train_samples: int) -> dict[str, Any]:
    """``index_of`` fields of one split of an 80/10/10 split in 16-token samples:
    ``train_samples`` for train, one epoch for valid and test."""
    return {
        "split": split,
        "split_spec": "80,10,10",
        "sequence_length": 16,
        "semantics": semantics,
        "num_samples": train_samples if split == "train" else None,
    }


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
