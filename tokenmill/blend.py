"""DESIGN-contract path for external conformance tests: a re-export of ``tokenmill.indices.blend``
(import from there in new code)."""

from tokenmill.indices.blend import blend_sample_counts, build_blend_indices

__all__ = ["blend_sample_counts", "build_blend_indices"]
