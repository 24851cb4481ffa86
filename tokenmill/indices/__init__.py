"""Index stage: Nanoset document/sample/shuffle indices, blend indices and the blend builder
(pure index math in the private modules, caching and manifests around it)."""
