"""DESIGN-contract path kept for external conformance tests: ``tokenmill.blend.build_blend_indices``
and ``tokenmill.blend.blend_sample_counts``. Thin re-export; the code lives in
``tokenmill.indices.blend`` (import from there in new code)."""

from tokenmill.indices.blend import blend_sample_counts, build_blend_indices

__all__ = ["blend_sample_counts", "build_blend_indices"]
