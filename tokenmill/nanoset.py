"""DESIGN-contract path for external conformance tests: a re-export of
``tokenmill.indices.nanoset`` (import from there in new code)."""

from tokenmill.indices.nanoset import build_nanoset_indices, split_ranges

__all__ = ["build_nanoset_indices", "split_ranges"]
