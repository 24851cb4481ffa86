"""Tokenize stage: tokenizers (load, fingerprint, verify, guard), the parallel tokenizer run,
the merge of shards into one dataset, and document-length statistics."""
