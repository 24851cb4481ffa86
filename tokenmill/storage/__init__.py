"""Storage stage: where artifacts live (the storage-root layout, versions and pointers), S3,
publishing and pulling blends, and garbage collection of old versions."""
