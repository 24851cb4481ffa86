"""tokenmill: LLM pretraining data preparation (library; never imports Dagster)."""

__version__ = "0.2.0.dev0"
