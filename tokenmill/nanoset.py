"""DESIGN-contract path kept for external conformance tests: ``tokenmill.nanoset.split_ranges`` and
``tokenmill.nanoset.build_nanoset_indices``. Thin re-export; the code lives in
``tokenmill.indices.nanoset`` (import from there in new code)."""

from tokenmill.indices.nanoset import build_nanoset_indices, split_ranges

__all__ = ["build_nanoset_indices", "split_ranges"]
