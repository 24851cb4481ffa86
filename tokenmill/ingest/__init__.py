"""Ingest stage: read raw inputs (JSONL, Parquet/Arrow) into record batches with quarantine and
stats, and export them as an HF Parquet dataset."""
