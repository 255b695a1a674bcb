"""hfpaged: paged KV cache + continuous batching for transformers models."""
